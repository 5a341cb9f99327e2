// PagePool (worker/page_pool.h): free, filling and cached pages, prefix
// matches that take references, duplicate commits, and eviction of the
// least recently used unreferenced page (told first, bytes still intact).
#include "worker/page_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <utility>
#include <vector>

namespace kvtier::worker {
namespace {

BlockHash H(uint64_t i) { return BlockHash{0x9a9e, i}; }

gpu::KvLayout Layout(uint64_t pages) { return gpu::KvLayout{2, 1, 8, 4, gpu::Dtype::kFp16, pages}; }

// Fills a page with `chain`'s blocks committed in order, and unreferences
// them tail first (as an engine does when a request ends).
std::vector<uint32_t> Cache(PagePool& pool, const std::vector<BlockHash>& chain) {
  std::vector<uint32_t> pages;
  for (const auto& h : chain) {
    auto p = pool.Allocate();
    EXPECT_TRUE(p.has_value());
    pages.push_back(pool.Commit(h, *p));
  }
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) pool.Unref(*it);
  return pages;
}

TEST(PagePool, CommittedPagesMatchAsAPrefixAndTakeReferences) {
  PagePool pool(Layout(8));
  const auto pages = Cache(pool, {H(1), H(2), H(3)});
  EXPECT_EQ(pool.Match({H(1), H(2), H(9)}), 2u);
  EXPECT_EQ(pool.Match({H(9), H(2)}), 0u) << "a prefix, not any block";
  auto refd = pool.MatchAndRef({H(1), H(2), H(3), H(4)});
  EXPECT_EQ(refd, pages);
  auto c = pool.counters();
  EXPECT_EQ(c.cached, 3u);
  EXPECT_EQ(c.referenced, 3u);
  EXPECT_EQ(c.free, 5u);
  for (auto p : refd) pool.Unref(p);
  EXPECT_EQ(pool.counters().referenced, 0u);
}

TEST(PagePool, ACommitOfACachedHashKeepsTheCachedPageAndFreesTheNewOne) {
  PagePool pool(Layout(4));
  const auto first = Cache(pool, {H(1)});
  auto p = pool.Allocate();
  ASSERT_TRUE(p.has_value());
  EXPECT_NE(*p, first[0]);
  EXPECT_EQ(pool.Commit(H(1), *p), first[0]);
  EXPECT_EQ(pool.counters().free, 3u) << "the duplicate page went back";
  pool.Unref(first[0]);
  // A page allocated and discarded comes back too.
  auto q = pool.Allocate();
  pool.Discard(*q);
  EXPECT_EQ(pool.counters().free, 3u);
}

TEST(PagePool, EvictionTakesTheLeastRecentlyUsedUnreferencedPageAndTellsFirst) {
  PagePool pool(Layout(3));
  std::vector<std::pair<BlockHash, uint32_t>> told;
  std::vector<uint8_t> bytes_when_told;
  pool.SetEvictCallback([&](const BlockHash& h, uint32_t page) {
    told.emplace_back(h, page);
    bytes_when_told.push_back(pool.layer_bases()[0][page * pool.layout().layer_page_bytes()]);
  });
  const auto a = Cache(pool, {H(1), H(2)});  // tail first: page of H(2) is older in LRU
  const auto b = Cache(pool, {H(3)});
  pool.layer_bases()[0][a[1] * pool.layout().layer_page_bytes()] = 0x5a;
  // Every page is cached: the next allocation reclaims H(2)'s (the chain's
  // tail, unreferenced before its head), telling first with its bytes intact.
  auto p = pool.Allocate();
  ASSERT_TRUE(p.has_value());
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].first, H(2));
  EXPECT_EQ(told[0].second, a[1]);
  EXPECT_EQ(*p, a[1]);
  EXPECT_EQ(bytes_when_told[0], 0x5a);
  EXPECT_EQ(pool.Match({H(1), H(2)}), 1u) << "the evicted block no longer matches";
  // Referenced pages are never reclaimed: with all three held, none is had.
  auto held = pool.MatchAndRef({H(1)});
  auto held3 = pool.MatchAndRef({H(3)});
  EXPECT_FALSE(pool.Allocate().has_value());
  EXPECT_EQ(pool.counters().evictions, 1u);
  pool.Discard(*p);
  for (auto x : held) pool.Unref(x);
  for (auto x : held3) pool.Unref(x);
  (void)b;
}

TEST(PagePool, CachedBlocksRankByHitsThenRecencyWithAPrefixBeforeItsTail) {
  PagePool pool(Layout(16));
  Cache(pool, {H(1), H(2), H(3)});  // a chain found twice below
  Cache(pool, {H(10), H(11)});      // never found again, used last
  for (int i = 0; i < 2; ++i) {
    auto pages = pool.MatchAndRef({H(1), H(2), H(3)});
    ASSERT_EQ(pages.size(), 3u);
    for (auto it = pages.rbegin(); it != pages.rend(); ++it) pool.Unref(*it);
  }
  auto ranked = pool.CachedByValue();
  ASSERT_EQ(ranked.size(), 5u);
  std::vector<BlockHash> order;
  for (const auto& b : ranked) order.push_back(b.hash);
  EXPECT_EQ(order, (std::vector<BlockHash>{H(1), H(2), H(3), H(10), H(11)}));
  EXPECT_EQ(ranked[0].hits, 2u);
  EXPECT_EQ(ranked[3].hits, 0u);
  // A page handed to another block is no longer what it held.
  EXPECT_TRUE(pool.RefIfHolds(ranked[4].page, H(11)));
  pool.Unref(ranked[4].page);
  EXPECT_FALSE(pool.RefIfHolds(ranked[4].page, H(12)));
  // Recommitting a page resets its hits: the count is the block's.
  PagePool small(Layout(1));
  Cache(small, {H(1)});
  auto again = small.MatchAndRef({H(1)});
  small.Unref(again[0]);
  Cache(small, {H(2)});  // evicts H(1)
  ASSERT_EQ(small.CachedByValue().size(), 1u);
  EXPECT_EQ(small.CachedByValue()[0].hits, 0u);
}

}  // namespace
}  // namespace kvtier::worker
