// FetchMeter (cachestore/fetch_meter.h): what a shard reports of its own
// fetches over its sliding window, on a clock the test sets.
#include "cachestore/fetch_meter.h"

#include <gtest/gtest.h>

namespace kvtier::store {
namespace {

using namespace std::chrono_literals;
using Clock = FetchMeter::Clock;

TEST(FetchMeter, FiguresCoverTheLastOneToTwoWindowsPerTier) {
  FetchMeter m(1s);
  const Clock::time_point t0{};
  m.Served(FetchMeter::kRam, 4, 4096, 0.002, t0 + 1s);
  m.Served(FetchMeter::kDisk, 1, 1024, 0.010, t0 + 1s + 100ms);
  m.Served(FetchMeter::kRam, 0, 0, 5.0, t0 + 1s);  // no blocks: nothing
  auto f = m.Figures(t0 + 1s + 500ms);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_STREQ(f[0].tier, "ram");
  EXPECT_EQ(f[0].blocks, 4u);
  EXPECT_EQ(f[0].bytes, 4096u);
  EXPECT_DOUBLE_EQ(f[0].us_per_block(), 500.0);
  EXPECT_STREQ(f[1].tier, "disk");
  EXPECT_DOUBLE_EQ(f[1].bytes_per_s(), 1024 / 0.010);
  // A window on, the previous window still counts; two on, nothing does.
  m.Served(FetchMeter::kRam, 2, 2048, 0.001, t0 + 2s + 200ms);
  f = m.Figures(t0 + 2s + 300ms);
  ASSERT_FALSE(f.empty());
  EXPECT_EQ(f[0].blocks, 6u);
  EXPECT_TRUE(m.Figures(t0 + 5s).empty());
}

TEST(FetchMeter, QueueDepthIsTheFetchesInFlight) {
  FetchMeter m(1s);
  const Clock::time_point t0{};
  m.Started();
  m.Started();
  m.Served(FetchMeter::kRam, 1, 1, 0.001, t0 + 1s);
  EXPECT_EQ(m.Figures(t0 + 1s)[0].queue_depth, 2u);
  m.Ended();
  m.Ended();
  m.Ended();  // one too many: the depth stays at 0, never wraps
  EXPECT_EQ(m.Figures(t0 + 1s)[0].queue_depth, 0u);
}

}  // namespace
}  // namespace kvtier::store
