// The crash test (kvtier-bench crash, in the style of RocksDB's
// db_crashtest.py), short: the store is SIGKILLed 20 times (more on a slow
// host, until enough reads after restarts were of NVMe blocks) at random
// moments under put/get/evict load with demotions to NVMe and restarted on
// the same data; after every restart each block it had reported on NVMe is
// back byte-exact and nothing served is wrong, in each --disk-sync mode. And
// the checker checks: with the data wiped before one restart, the run
// reports the loss.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "testing/process.h"

namespace kvtier {
namespace {

nlohmann::json RunCrash(const std::string& args, int* exit_code) {
  ShellResult r =
      RunShell(std::string(KVTIER_BENCH_BIN) + " crash --json " + args + " 2>/dev/null");
  *exit_code = r.exit_code;
  return nlohmann::json::parse(r.out, nullptr, false);
}

TEST(Crash, AcknowledgedNvmeBlocksSurviveTwentyKillsByteExact) {
  int code = -1;
  nlohmann::json j = RunCrash("--kills 20 --seed 7 --min-acknowledged 150", &code);
  ASSERT_TRUE(j.is_object()) << "no JSON from kvtier-bench crash (exit " << code << ")";
  EXPECT_EQ(code, 0) << j.dump(2);
  EXPECT_GE(j["kills"].get<uint64_t>(), 20u);
  EXPECT_EQ(j["lost"].get<uint64_t>(), 0u) << j.dump(2);
  EXPECT_EQ(j["wrong"].get<uint64_t>(), 0u) << j.dump(2);
  // The oracle had something to hold the store to.
  EXPECT_GT(j["acknowledged_on_nvme"].get<uint64_t>(), 100u) << j.dump(2);
  EXPECT_GT(j["checked_after_restarts"].get<uint64_t>(), 100u) << j.dump(2);
  EXPECT_GT(j["served_blocks"].get<uint64_t>(), 100u) << j.dump(2);
  EXPECT_GT(j["evicts"].get<uint64_t>(), 0u) << j.dump(2);
}

// Each --disk-sync mode: what the store reports on NVMe survives SIGKILL
// (a crash of the host, which commit and group also survive, cannot be
// made here: docs/reliability.md).
class CrashPerSyncMode : public ::testing::TestWithParam<std::string> {};

TEST_P(CrashPerSyncMode, AcknowledgedNvmeBlocksSurviveKillsByteExact) {
  int code = -1;
  nlohmann::json j =
      RunCrash("--kills 8 --seed 5 --min-acknowledged 80 --disk-sync " + GetParam(), &code);
  ASSERT_TRUE(j.is_object()) << "no JSON from kvtier-bench crash (exit " << code << ")";
  EXPECT_EQ(code, 0) << j.dump(2);
  EXPECT_EQ(j["disk_sync"].get<std::string>(), GetParam());
  EXPECT_GE(j["kills"].get<uint64_t>(), 8u);
  EXPECT_EQ(j["lost"].get<uint64_t>(), 0u) << j.dump(2);
  EXPECT_EQ(j["wrong"].get<uint64_t>(), 0u) << j.dump(2);
  // The checks had acknowledged blocks to hold the store to (evictions may
  // leave the oracle few at the end of a run on a loaded host).
  EXPECT_GT(j["acknowledged_checked_after_restarts"].get<uint64_t>(), 50u) << j.dump(2);
}

INSTANTIATE_TEST_SUITE_P(Modes, CrashPerSyncMode, ::testing::Values("commit", "group"));

TEST(Crash, TheOracleReportsBlocksLostWithTheData) {
  int code = -1;
  nlohmann::json j = RunCrash("--kills 4 --seed 3 --wipe-at 3", &code);
  ASSERT_TRUE(j.is_object()) << "no JSON from kvtier-bench crash (exit " << code << ")";
  EXPECT_EQ(code, 1);
  EXPECT_GT(j["lost"].get<uint64_t>(), 0u) << j.dump(2);
}

}  // namespace
}  // namespace kvtier
