// A short replay of the shipped trace through a whole cluster (store, router,
// simulated workers) -- the main job in small.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "testing/process.h"

namespace {

using kvtier::RunShell;
using kvtier::ShellResult;

const char* kTrace = KVTIER_SOURCE_DIR "/bench/traces/conversation_trace.jsonl";

nlohmann::json Replay(const std::string& args, int* rc) {
  std::string cmd = std::string(KVTIER_BENCH_BIN) + " replay " + args + " --json 2>/dev/null";
  ShellResult r = RunShell(cmd);
  *rc = r.exit_code;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

// The infinite shared cache, computed here from the trace file directly.
double IndependentOracleComputedFraction(size_t limit) {
  std::ifstream in(kTrace);
  std::string line;
  std::set<uint64_t> seen;
  uint64_t tokens = 0, hit = 0;
  for (size_t i = 0; i < limit && std::getline(in, line); ++i) {
    auto r = nlohmann::json::parse(line);
    uint64_t len = r["input_length"];
    const auto& ids = r["hash_ids"];
    size_t k = 0;
    while (k < ids.size() && seen.count(ids[k].get<uint64_t>())) ++k;
    hit += std::min<uint64_t>(k * 512, len);
    tokens += len;
    for (const auto& id : ids) seen.insert(id.get<uint64_t>());
  }
  return 1.0 - double(hit) / double(tokens);
}

TEST(Replay, AWholeClusterServesTheTraceAndKvtierComputesLeast) {
  int rc = 0;
  auto j = Replay(std::string("--trace ") + kTrace +
                      " --limit 300 --workers 2 --pages 256 --block-bytes 16KiB --speed 0",
                  &rc);
  ASSERT_EQ(rc, 0) << "the replay failed or found mismatched bytes";
  const auto& m = j["modes"];
  for (const char* mode : {"round-robin", "round-robin+store", "kv-aware", "kvtier", "oracle"}) {
    ASSERT_TRUE(m.contains(mode)) << mode;
    EXPECT_TRUE(m[mode].contains("computed_fraction")) << mode;
  }
  for (const char* mode : {"round-robin", "round-robin+store", "kv-aware", "kvtier"}) {
    EXPECT_EQ(m[mode]["requests"].get<uint64_t>(), 300u) << mode;
  }
  EXPECT_EQ(j["mismatched_blocks"].get<uint64_t>(), 0u);
  EXPECT_GT(m["kvtier"]["verified_blocks"].get<uint64_t>(), 0u);
  EXPECT_GT(m["kvtier"]["store_ram_fraction"].get<double>() +
                m["kvtier"]["store_disk_fraction"].get<double>(),
            0.0);
  EXPECT_LT(m["kvtier"]["computed_fraction"].get<double>(),
            m["round-robin"]["computed_fraction"].get<double>());
  EXPECT_NEAR(m["oracle"]["computed_fraction"].get<double>(), IndependentOracleComputedFraction(300),
              1e-9);
  EXPECT_GE(m["kvtier"]["computed_fraction"].get<double>() + 1e-9,
            m["oracle"]["computed_fraction"].get<double>());
}

// The same job with the PyTorch reference engine: real forward passes, real
// KV blocks through the store, every loaded one verified by its checksum.
TEST(Replay, TheTorchEngineServesTheTraceWithRealComputeAndLoadsVerifiedBlocks) {
  if (std::ifstream(KVTIER_TORCH_ENGINE).fail()) {
    GTEST_SKIP() << "no Python package in this build (sanitizer / fuzz builds have none)";
  }
  int rc = 0;
  auto j = Replay(std::string("--trace ") + kTrace +
                      " --engine torch --limit 150 --workers 2 --pages 2048 --speed 0"
                      " --trace-block-tokens 16 --concurrency 4 --modes round-robin,kvtier",
                  &rc);
  ASSERT_EQ(rc, 0) << "the replay failed or found mismatched bytes";
  const auto& m = j["modes"];
  for (const char* mode : {"round-robin", "kvtier"}) {
    EXPECT_EQ(m[mode]["requests"].get<uint64_t>(), 150u) << mode;
    EXPECT_GT(m[mode]["ttft_mean_ms"].get<double>(), 0.0) << mode;
  }
  EXPECT_EQ(j["mismatched_blocks"].get<uint64_t>(), 0u);
  EXPECT_GT(m["kvtier"]["verified_blocks"].get<uint64_t>(), 0u);
  EXPECT_LT(m["kvtier"]["computed_fraction"].get<double>(),
            m["round-robin"]["computed_fraction"].get<double>());
}

}  // namespace
