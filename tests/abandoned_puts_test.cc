// AbandonedPuts (cachestore/abandoned_puts.h): an abandon before, during and
// after its BeginPut; tokens scoped by tenant; the time and size bounds.
#include "cachestore/abandoned_puts.h"

#include <gtest/gtest.h>

namespace kvtier::store {
namespace {

using namespace std::chrono_literals;

TEST(AbandonedPuts, AnAbandonBeforeItsBeginPutRefusesIt) {
  AbandonedPuts a(10s, 16);
  EXPECT_EQ(a.Abandon(-1, 7), 0u);  // not served yet: a tombstone
  EXPECT_TRUE(a.GivenUp(-1, 7));
  EXPECT_FALSE(a.GivenUp(-1, 7)) << "a tombstone refuses one call, then is gone";
  EXPECT_EQ(a.size(), 0u);
}

TEST(AbandonedPuts, AnAbandonAfterTheLeaseOpenedNamesTheLease) {
  AbandonedPuts a(10s, 16);
  EXPECT_FALSE(a.GivenUp(-1, 7));
  EXPECT_FALSE(a.Opened(-1, 7, 42));
  EXPECT_EQ(a.Abandon(-1, 7), 42u);
  EXPECT_EQ(a.Abandon(-1, 7), 0u) << "the lease is named once";
}

TEST(AbandonedPuts, AnAbandonWhileTheBeginPutIsServedAbortsItsLease) {
  AbandonedPuts a(10s, 16);
  EXPECT_FALSE(a.GivenUp(-1, 7));   // the call passed the check
  EXPECT_EQ(a.Abandon(-1, 7), 0u);  // then its writer gave up
  EXPECT_TRUE(a.Opened(-1, 7, 42)) << "the lease it opened must be aborted";
}

TEST(AbandonedPuts, ATenantCannotGiveUpAnothersPut) {
  AbandonedPuts a(10s, 16);
  EXPECT_FALSE(a.Opened(1, 7, 42));
  EXPECT_EQ(a.Abandon(2, 7), 0u);
  EXPECT_FALSE(a.GivenUp(1, 7));
  EXPECT_EQ(a.Abandon(1, 7), 42u);
}

TEST(AbandonedPuts, EntriesLastALeasePeriodAndTheOldestGoFirst) {
  auto now = std::chrono::steady_clock::time_point{} + 1h;
  AbandonedPuts a(50ms, 4, [&] { return now; });
  for (uint64_t t = 1; t <= 6; ++t) EXPECT_FALSE(a.Opened(-1, t, 100 + t));
  EXPECT_EQ(a.size(), 4u);
  EXPECT_EQ(a.Abandon(-1, 1), 0u) << "the oldest went first";
  EXPECT_EQ(a.Abandon(-1, 6), 106u);
  now += 49ms;
  EXPECT_FALSE(a.Opened(-1, 8, 108));  // within the period: all kept
  EXPECT_EQ(a.size(), 4u);
  now += 1ms;
  EXPECT_FALSE(a.Opened(-1, 9, 109));  // prunes what is past its period
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(a.Abandon(-1, 5), 0u);
  EXPECT_EQ(a.Abandon(-1, 8), 108u);
}

}  // namespace
}  // namespace kvtier::store
