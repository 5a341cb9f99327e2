#include "cachestore/eviction_policy.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "common/limits.h"

namespace kvtier::store {
namespace {

std::unique_ptr<EvictionPolicy> Make(const std::string& name,
                                     std::map<std::string, double> params = {}) {
  auto p = MakePolicy(name, params);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

std::vector<uint64_t> Drain(EvictionPolicy& p) {
  std::vector<uint64_t> out;
  while (auto v = p.Evict([](uint64_t) { return true; })) out.push_back(*v);
  return out;
}

const auto kAny = [](uint64_t) { return true; };

TEST(Lru, EvictsLeastRecentlyUsedFirst) {
  auto p = Make("lru");
  for (uint64_t i : {1, 2, 3, 4}) p->Insert(i);
  p->Touch(1);
  p->Touch(3);
  EXPECT_EQ(Drain(*p), (std::vector<uint64_t>{2, 4, 1, 3}));
}

TEST(Lru, SkipsPinnedAndKeepsThem) {
  auto p = Make("lru");
  for (uint64_t i : {1, 2, 3}) p->Insert(i);
  EXPECT_EQ(*p->Evict([](uint64_t id) { return id != 1; }), 2u);
  EXPECT_EQ(p->size(), 2u);
  EXPECT_FALSE(p->Evict([](uint64_t) { return false; }).has_value());
  EXPECT_EQ(p->size(), 2u);
}

// A pin is not a use: passing over a pinned resident leaves it where it
// was (it used to move to the most recent place on every pass).
TEST(Lru, PinnedResidentsKeepTheirPlace) {
  auto p = Make("lru");
  for (uint64_t i : {1, 2, 3, 4}) p->Insert(i);
  EXPECT_EQ(*p->Evict([](uint64_t id) { return id != 1; }), 2u);
  EXPECT_EQ(*p->Evict([](uint64_t id) { return id != 1; }), 3u);
  EXPECT_EQ(Drain(*p), (std::vector<uint64_t>{1, 4}));
}

// One eviction looks at most limits::kEvictScan residents: behind that many
// pinned ones it finds no victim, and nothing moves or is lost.
TEST(Lru, TheSearchPastPinnedResidentsIsBounded) {
  auto p = Make("lru");
  const uint64_t pinned = limits::kEvictScan;
  for (uint64_t i = 0; i < pinned + 10; ++i) p->Insert(i);  // 0 is the least recent
  size_t looked = 0;
  auto pin_old = [&](uint64_t id) {
    looked++;
    return id >= pinned;
  };
  EXPECT_FALSE(p->Evict(pin_old).has_value());
  EXPECT_EQ(looked, limits::kEvictScan);
  EXPECT_EQ(p->size(), pinned + 10);
  // One fewer pinned: the first one past them goes.
  EXPECT_EQ(*p->Evict([&](uint64_t id) { return id >= pinned - 1; }), pinned - 1);
  EXPECT_EQ(*p->Evict(kAny), 0u);  // the least recent, still in its place
}

TEST(Lru, TheSearchBoundIsItsMaxScanParameter) {
  auto p = MakePolicy("lru", {{"max_scan", 8}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->params().at("max_scan"), 8);
  EXPECT_EQ(Make("lru")->params().at("max_scan"), static_cast<double>(limits::kEvictScan));
  for (uint64_t i = 0; i < 20; ++i) (*p)->Insert(i);
  size_t looked = 0;
  EXPECT_FALSE((*p)->Evict([&](uint64_t id) { return ++looked, id >= 10; }).has_value());
  EXPECT_EQ(looked, 8u);
  for (double bad : {0.0, 2.5, 1e9}) {
    auto r = MakePolicy("lru", {{"max_scan", bad}});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("max_scan"), std::string::npos) << r.status();
  }
  EXPECT_FALSE(MakePolicy("lru", {{"small_fraction", 0.1}}).ok());
}

TEST(Sieve, ReferenceOrder) {
  // Queue head..tail: 4 3 2 1. Hits on 1 and 3 set their visited bits. The
  // hand starts at the tail: 1 (visited: clear) -> 2 evicted; hand at 3
  // (visited: clear) -> 4 evicted; hand wraps to the tail: 1 evicted, then 3.
  auto p = Make("sieve");
  for (uint64_t i : {1, 2, 3, 4}) p->Insert(i);
  p->Touch(1);
  p->Touch(3);
  EXPECT_EQ(Drain(*p), (std::vector<uint64_t>{2, 4, 1, 3}));
}

TEST(Sieve, NewEntriesGoBehindTheHand) {
  auto p = Make("sieve");
  for (uint64_t i : {1, 2, 3}) p->Insert(i);
  p->Touch(1);
  EXPECT_EQ(*p->Evict(kAny), 2u);  // hand now at 3
  p->Insert(5);                    // new head, ahead of the hand
  EXPECT_EQ(*p->Evict(kAny), 3u);
  EXPECT_EQ(*p->Evict(kAny), 5u);  // hand reached the head
  EXPECT_EQ(*p->Evict(kAny), 1u);  // wrapped; 1's bit was cleared on the first pass
}

TEST(Sieve, EraseUnderTheHand) {
  auto p = Make("sieve");
  for (uint64_t i : {1, 2, 3}) p->Insert(i);
  p->Touch(1);
  EXPECT_EQ(*p->Evict(kAny), 2u);  // hand at 3
  p->Erase(3);
  EXPECT_EQ(Drain(*p), (std::vector<uint64_t>{1}));
}

TEST(S3Fifo, ReferenceOrder) {
  auto p = Make("s3fifo");
  for (uint64_t i : {1, 2, 3, 4}) p->Insert(i);  // all in S
  EXPECT_EQ(*p->Evict(kAny), 1u);                // S tail, never read -> ghost
  p->Touch(2);
  p->Touch(2);                     // freq 2: promoted to M on its turn
  EXPECT_EQ(*p->Evict(kAny), 3u);  // 2 moved to M, 3 evicted -> ghost (cap 1)
  p->Insert(3);                    // ghost hit: straight into M
  p->Insert(1);                    // ghost forgot 1: into S
  // S: 1 4 (tail 4); M: 3 2 (tail 2).
  EXPECT_EQ(Drain(*p), (std::vector<uint64_t>{4, 1, 2, 3}));
}

TEST(S3Fifo, MainQueueReinsertsReadBlocks) {
  auto p = Make("s3fifo", {{"small_fraction", 0.5}});
  for (uint64_t i : {1, 2}) p->Insert(i);
  p->Touch(1);
  p->Touch(1);
  EXPECT_EQ(*p->Evict(kAny), 2u);  // 1 moves to M, 2 evicted from S
  p->Insert(10);
  p->Insert(11);
  p->Touch(1);  // M: 1 with freq 1 -> one more chance
  // S = {11, 10} (2 of 3 >= 0.5): 10 goes first, then 11, then M's 1.
  EXPECT_EQ(Drain(*p), (std::vector<uint64_t>{10, 11, 1}));
}

TEST(Policies, AllPinnedMeansNoVictimAndNothingLost) {
  for (const auto& name : PolicyNames()) {
    auto p = Make(name);
    for (uint64_t i = 0; i < 10; ++i) p->Insert(i);
    EXPECT_FALSE(p->Evict([](uint64_t) { return false; }).has_value()) << name;
    EXPECT_EQ(p->size(), 10u) << name;
    auto rest = Drain(*p);
    EXPECT_EQ(std::set<uint64_t>(rest.begin(), rest.end()).size(), 10u) << name;
  }
}

TEST(Policies, EraseAndTouchOfUnknownIdsAreHarmless) {
  for (const auto& name : PolicyNames()) {
    auto p = Make(name);
    p->Touch(7);
    p->Erase(7);
    p->Insert(1);
    p->Erase(1);
    EXPECT_EQ(p->size(), 0u) << name;
    EXPECT_FALSE(p->Evict(kAny).has_value()) << name;
  }
}

TEST(Policies, BadNamesAndParametersAreRefused) {
  EXPECT_FALSE(MakePolicy("fifo").ok());
  EXPECT_NE(MakePolicy("fifo").status().message().find("fifo"), std::string::npos);
  EXPECT_FALSE(MakePolicy("lru", {{"x", 1}}).ok());
  EXPECT_FALSE(MakePolicy("s3fifo", {{"small_fraction", 0.9}}).ok());
  EXPECT_FALSE(MakePolicy("s3fifo", {{"ghosts", 1}}).ok());
  EXPECT_TRUE(MakePolicy("s3fifo", {{"small_fraction", 0.2}}).ok());
}

}  // namespace
}  // namespace kvtier::store
