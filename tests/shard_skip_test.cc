// ShardSkip's rules on a clock the test turns: a failure skips for min_ms,
// doubling to max_ms while failures go on; one probe when a skip ends, the
// others held off until it answers or probe_hold_ms passes; any other
// outcome ends the skipping; min_ms 0 never skips.
#include "client/shard_skip.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

const absl::Status kDown = absl::UnavailableError("connection refused");
const absl::Status kSlow = absl::DeadlineExceededError("deadline");
const absl::Status kNotFound = absl::NotFoundError("no such namespace");

TEST(ShardSkip, AFailureSkipsAndTheSkipDoublesUpToItsBound) {
  ShardSkip s(600, 2400, 1400);
  int64_t left = -1;
  EXPECT_TRUE(s.Admit(0, &left));
  s.Note(kDown, 1000);
  EXPECT_FALSE(s.Admit(1000, &left));
  EXPECT_EQ(left, 600);
  EXPECT_FALSE(s.Admit(1599, &left));
  EXPECT_EQ(left, 1);
  // The skip ends: one probe; it fails too, so the next skip is twice as long.
  EXPECT_TRUE(s.Admit(1600, &left));
  s.Note(kSlow, 2000);
  EXPECT_FALSE(s.Admit(2000 + 1199, &left));
  EXPECT_EQ(left, 1);
  EXPECT_TRUE(s.Admit(3200, &left));
  s.Note(kDown, 3200);  // 2400
  EXPECT_FALSE(s.Admit(5599, &left));
  EXPECT_TRUE(s.Admit(5600, &left));
  s.Note(kDown, 5600);  // 4800 would pass the bound: 2400 again
  EXPECT_FALSE(s.Admit(7999, &left));
  EXPECT_TRUE(s.Admit(8000, &left));
}

TEST(ShardSkip, OneCallerProbesTheOthersWaitForItsAnswer) {
  ShardSkip s(100, 1000, 500);
  int64_t left = 0;
  s.Note(kDown, 0);
  EXPECT_TRUE(s.Admit(100, &left));   // the probe
  EXPECT_FALSE(s.Admit(100, &left));  // held off while it runs
  EXPECT_EQ(left, 500);
  EXPECT_FALSE(s.Admit(599, &left));
  // A probe that never answered holds the others off no longer than that.
  EXPECT_TRUE(s.Admit(600, &left));
  // It answers: skipping ends for everyone.
  s.Note(absl::OkStatus(), 650);
  EXPECT_TRUE(s.Admit(650, &left));
  EXPECT_TRUE(s.Admit(650, &left));
  // And a later failure starts again from min_ms.
  s.Note(kDown, 700);
  EXPECT_FALSE(s.Admit(799, &left));
  EXPECT_EQ(left, 1);
}

TEST(ShardSkip, OnlyUnreachableEndsInASkip) {
  ShardSkip s(100, 1000, 500);
  int64_t left = 0;
  s.Note(kNotFound, 0);  // the shard answered: it is reachable
  EXPECT_TRUE(s.Admit(0, &left));
  s.Note(kDown, 0);
  s.Note(kNotFound, 10);  // an answer of any kind ends the skip
  EXPECT_TRUE(s.Admit(10, &left));
  EXPECT_TRUE(ShardSkip::Unreachable(kDown));
  EXPECT_TRUE(ShardSkip::Unreachable(kSlow));
  EXPECT_FALSE(ShardSkip::Unreachable(kNotFound));
}

TEST(ShardSkip, MinZeroNeverSkips) {
  ShardSkip s(0, 0, 500);
  int64_t left = 0;
  s.Note(kDown, 0);
  EXPECT_TRUE(s.Admit(0, &left));
  EXPECT_TRUE(s.Admit(1, &left));
}

}  // namespace
}  // namespace kvtier
