// ChangeFeed (cachestore/change_feed.h): tier changes queued under tier
// locks reach the sink in batches per namespace, off those locks, and a
// block is reported removed only once it has left every tier.
#include "cachestore/change_feed.h"

#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>

#include "tests/test_util.h"

namespace kvtier::store {
namespace {

class Recorder : public ChangeSink {
 public:
  void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) override {
    std::lock_guard lk(mu_);
    calls_++;
    for (const auto& h : hashes) stored_[ns].insert(h.lo);
  }
  void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) override {
    std::lock_guard lk(mu_);
    calls_++;
    for (const auto& h : hashes) removed_[ns].insert(h.lo);
  }
  std::set<uint64_t> stored(uint64_t ns) {
    std::lock_guard lk(mu_);
    return stored_[ns];
  }
  std::set<uint64_t> removed(uint64_t ns) {
    std::lock_guard lk(mu_);
    return removed_[ns];
  }

 private:
  std::mutex mu_;
  int calls_ = 0;
  std::map<uint64_t, std::set<uint64_t>> stored_, removed_;
};

BlockKey K(uint64_t ns, uint64_t i) { return BlockKey{ns, BlockHash{0, i}}; }

TEST(ChangeFeed, BlocksReachTheSinkPerNamespaceAndRemovalsOnlyOnceGoneEverywhere) {
  Recorder sink;
  std::mutex mu;
  std::set<uint64_t> still_present = {2};  // block 2 is still in another tier
  {
    ChangeFeed feed(&sink, [&](const BlockKey& k) {
      std::lock_guard lk(mu);
      return still_present.count(k.hash.lo) > 0;
    });
    feed.Add(K(7, 1), true);
    feed.Add(K(7, 2), true);
    feed.Add(K(9, 3), true);
    ASSERT_TRUE(testing::WaitFor([&] { return sink.stored(7).size() == 2; }));
    EXPECT_EQ(sink.stored(9), std::set<uint64_t>{3});
    feed.Add(K(7, 1), false);
    feed.Add(K(7, 2), false);  // left one tier, still in another: not removed
    ASSERT_TRUE(testing::WaitFor([&] { return sink.removed(7).size() == 1; }));
    EXPECT_EQ(sink.removed(7), std::set<uint64_t>{1});
    feed.Add(K(9, 3), false);  // queued when the feed stops: still delivered
  }
  EXPECT_EQ(sink.removed(9), std::set<uint64_t>{3});
  EXPECT_EQ(sink.removed(7), std::set<uint64_t>{1});
}

}  // namespace
}  // namespace kvtier::store
