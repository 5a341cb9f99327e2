// LeaseTable (cachestore/lease_table.h): claims and limits, Take's checks,
// and the transfer holds the socket data plane takes (Use): what a hold
// may cover, that a held lease is never waited on (a commit is refused, an
// end is deferred to the last hold), and that an
// expired lease's slots are not released while a transfer still holds it.
#include "cachestore/lease_table.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace kvtier::store {
namespace {

using namespace std::chrono_literals;

// A lease of two 4 KiB slots, at arena offsets 8192 and 32768.
Lease TwoSlots(bool is_put, int tenant = -1) {
  Lease l;
  l.client = "c";
  l.tenant = tenant;
  l.is_put = is_put;
  l.items = {{BlockKey{1, BlockHash{1, 1}}, Slot{32768, 4096, 0}},
             {BlockKey{1, BlockHash{2, 2}}, Slot{8192, 4096, 0}}};
  return l;
}

class Released {
 public:
  LeaseTable::ReleaseFn Fn() {
    return [this](const Lease&) { count_++; };
  }
  int count() const { return count_.load(); }

 private:
  std::atomic<int> count_{0};
};

TEST(LeaseTable, ClaimsCountAgainstTheirHolderUpToItsLimit) {
  Released r;
  LeaseTable t(10000, 2, r.Fn());
  auto a = t.Claim("c"), b = t.Claim("c");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  auto c = t.Claim("c");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("already holds 2"), std::string::npos) << c.status();
  EXPECT_TRUE(t.Claim("other").ok());
  t.Unclaim("c");
  EXPECT_TRUE(t.Claim("c").ok());
  EXPECT_EQ(t.Held("c"), 2u);
}

TEST(LeaseTable, TakeChecksKindAndTenant) {
  Released r;
  LeaseTable t(10000, 0, r.Fn());
  const uint64_t id = *t.Claim(LeaseOwner("c", 0, 3));
  t.Open(id, TwoSlots(true, 3));
  EXPECT_EQ(t.Take(id, false, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Take(id, true, 4).status().code(), absl::StatusCode::kFailedPrecondition)
      << "another tenant's lease reads as unknown";
  auto l = t.Take(id, true, 3);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->items.size(), 2u);
  EXPECT_EQ(t.Take(id, true, 3).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LeaseTable, AHoldCoversOnlyWholeRangesInsideOneOfTheLeasesSlots) {
  Released r;
  LeaseTable t(10000, 0, r.Fn());
  const uint64_t id = *t.Claim(LeaseOwner("c", 0, 1));
  t.Open(id, TwoSlots(false, 1));
  // Inside: whole slots, and a segment of one.
  EXPECT_TRUE(t.Use(id, false, 1, 8192, 4096).ok());
  EXPECT_TRUE(t.Use(id, false, 1, 32768, 4096).ok());
  EXPECT_TRUE(t.Use(id, false, 1, 8192 + 1024, 1024).ok());
  // Outside: before, after, straddling, between the slots, past the end of
  // the address space, empty.
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{{8191, 2},
                                                                    {8192, 4097},
                                                                    {12288, 1},
                                                                    {16384, 4096},
                                                                    {32768 + 4095, 2},
                                                                    {0, 1},
                                                                    {~uint64_t{0} - 10, 20},
                                                                    {8192, ~uint64_t{0}},
                                                                    {8192, 0}}) {
    auto h = t.Use(id, false, 1, off, len);
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << off << "+" << len;
  }
  // Another kind, another tenant, no tenant, an unknown lease.
  EXPECT_EQ(t.Use(id, true, 1, 8192, 4096).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Use(id, false, 2, 8192, 4096).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Use(id, false, -1, 8192, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Use(id + 1, false, 1, 8192, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(LeaseTable, ALeaseOpenedOnASessionIsThatSessions) {
  // Opened by a data-plane call of session "s1": another session finds no
  // such lease, for a transfer or a call; s1 and a gRPC caller (no
  // session) do. A lease opened over gRPC is bound to no session.
  Released r;
  LeaseTable t(10000, 0, r.Fn());
  const uint64_t bound = *t.Claim("c"), free = *t.Claim("c");
  Lease l = TwoSlots(true);
  l.session = "s1";
  t.Open(bound, std::move(l));
  t.Open(free, TwoSlots(true));
  EXPECT_EQ(t.Use(bound, true, -1, 8192, 4096, "s2").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Take(bound, true, -1, LeaseTable::WhenHeld::kRefuse, "s2").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(t.Use(bound, true, -1, 8192, 4096, "s1").ok());
  EXPECT_TRUE(t.Use(free, true, -1, 8192, 4096, "s2").ok());
  auto taken = t.Take(bound, true, -1, LeaseTable::WhenHeld::kRefuse, "s1");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->session, "s1");
  EXPECT_TRUE(t.Take(free, true).ok()) << "a gRPC caller";
}

TEST(LeaseTable, AHeldLeaseIsNeverWaitedOn) {
  // A transfer on another connection holds the lease (a client can trickle
  // it until the deadline). A commit is refused at once, nothing changed;
  // an end (abort, release) ends it at once and the hold's end releases it.
  // Neither parks the calling thread.
  Released r;
  LeaseTable t(10000, 0, r.Fn());
  const uint64_t put = *t.Claim("c"), get = *t.Claim("c");
  t.Open(put, TwoSlots(true));
  t.Open(get, TwoSlots(false));
  auto put_hold = t.Use(put, true, -1, 8192, 4096);
  auto get_hold = t.Use(get, false, -1, 8192, 4096);
  ASSERT_TRUE(put_hold.ok() && get_hold.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto commit = t.Take(put, true);
  EXPECT_EQ(commit.status().code(), absl::StatusCode::kUnavailable) << commit.status();
  EXPECT_NE(commit.status().message().find("still under way"), std::string::npos);
  auto end = t.Take(get, false, -1, LeaseTable::WhenHeld::kDefer);
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->items.empty()) << "nothing for the caller to release";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 100ms) << "a call waited on a transfer";
  EXPECT_EQ(t.Use(get, false, -1, 8192, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "a new transfer of an ended lease";
  EXPECT_EQ(t.Take(get, false, -1, LeaseTable::WhenHeld::kDefer).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "ended twice";
  EXPECT_EQ(r.count(), 0) << "released under its transfer";
  get_hold->token.reset();  // the get's transfer ends: its lease goes with it
  EXPECT_EQ(r.count(), 1);
  EXPECT_EQ(t.counts().get, 0u);
  put_hold->token.reset();  // the put's bytes are in: the commit goes through
  auto again = t.Take(put, true);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->items.size(), 2u);
}

// On a clock the test turns (no reaper thread, no sleeping): a lease
// expires at its deadline, its slots go one lease period later, and an
// expired lease a transfer still holds keeps its slots until the hold ends.
TEST(LeaseTable, AnExpiredLeasesSlotsStayWhileATransferHoldsIt) {
  Released r;
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  LeaseTable t(
      100, 0, r.Fn(), [&] { return now; }, /*reaper=*/false);  // 100 ms leases
  const uint64_t held = *t.Claim("c"), idle = *t.Claim("c");
  t.Open(held, TwoSlots(true));
  t.Open(idle, TwoSlots(true));
  auto hold = t.Use(held, true, -1, 32768, 4096);
  ASSERT_TRUE(hold.ok());
  EXPECT_EQ(hold->deadline, now + 100ms) << "a transfer must end by the lease's deadline";
  now += 99ms;
  t.ReapNow();
  EXPECT_EQ(t.counts().expired, 0u);
  EXPECT_TRUE(t.Use(idle, true, -1, 32768, 4096).ok()) << "live until its deadline";
  now += 1ms;  // the deadline: both expire, their slots wait a lease period
  t.ReapNow();
  EXPECT_EQ(t.counts().expired, 2u);
  EXPECT_EQ(r.count(), 0);
  EXPECT_EQ(t.Use(held, true, -1, 32768, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "an expired lease grants nothing";
  now += 99ms;
  t.ReapNow();
  EXPECT_EQ(r.count(), 0) << "released before the grace period ended";
  now += 1ms;
  t.ReapNow();
  EXPECT_EQ(r.count(), 1) << "the idle lease's slots go after its grace";
  now += 10s;  // however long the held one's transfer runs past that
  t.ReapNow();
  EXPECT_EQ(r.count(), 1) << "a held lease's slots were released under its transfer";
  hold->token.reset();
  t.ReapNow();
  EXPECT_EQ(r.count(), 2);
}

// The same with the reaper thread on the real clock: it does the passes.
TEST(LeaseTable, TheReaperExpiresAndReleasesOnItsOwn) {
  Released r;
  LeaseTable t(50, 0, r.Fn());
  const uint64_t id = *t.Claim("c");
  t.Open(id, TwoSlots(false));
  ASSERT_TRUE(testing::WaitFor([&] { return r.count() == 1; }, 5s));
  EXPECT_EQ(t.counts().expired, 1u);
}

}  // namespace
}  // namespace kvtier::store
