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

}  // namespace
}  // namespace kvtier::worker
