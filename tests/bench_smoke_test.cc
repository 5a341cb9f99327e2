// Short runs of kvtier-bench (the full benchmarks stay out of the test run):
// they must finish, verify every byte, and print the JSON scripts rely on.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/match.h"
#include "testing/process.h"

namespace {

using kvtier::RunShell;
using kvtier::ShellResult;

nlohmann::json RunJson(const std::string& args) {
  std::string cmd = std::string(KVTIER_BENCH_BIN) + " " + args + " 2>/dev/null";
  ShellResult r = RunShell(cmd);
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.out;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

TEST(BenchSmoke, StoreBenchReportsEveryCaseWithARatio) {
  auto j = RunJson("store --blocks 64 --block-bytes 64KiB --clients 2 --batch 8 --json");
  ASSERT_TRUE(j.contains("cases"));
  // Redis SET/GET, fio and Redis for NVMe hits, Mooncake Store put/get.
  ASSERT_EQ(j["cases"].size(), 6u);
  for (const auto& c : j["cases"]) {
    EXPECT_GT(c["gb_per_s"].get<double>(), 0) << c.dump();
    EXPECT_TRUE(c.contains("ratio")) << c.dump();
    // Mooncake measured, or the note says why not (no Python environment).
    if (absl::StartsWith(c["reference"].get<std::string>(), "mooncake")) {
      EXPECT_TRUE(c["reference_gb_per_s"].get<double>() > 0 || c.contains("note")) << c.dump();
    }
  }
}

TEST(BenchSmoke, TraceReplayVerifiesEveryByteAndStaysUnderTheBound) {
  auto j =
      RunJson("trace --limit 300 --block-bytes 16KiB --ram-bytes 16MiB --disk-bytes 64MiB --json");
  EXPECT_EQ(j["mismatched_blocks"].get<uint64_t>(), 0u);
  EXPECT_GT(j["verified_blocks"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["verified_blocks"].get<uint64_t>(),
            j["hit_ram_blocks"].get<uint64_t>() + j["hit_disk_blocks"].get<uint64_t>());
  double hit = j["store_hit_ratio"].get<double>();
  EXPECT_GT(hit, 0.0);
  EXPECT_LE(hit, j["infinite_cache_hit_ratio"].get<double>() + 1e-9);
}

}  // namespace

namespace {

TEST(BenchSmoke, RouterBenchReportsLatencyIngestionAndMemory) {
  auto j = RunJson("router --blocks 20000 --requests 50 --prompt-blocks 200 --workers 8,64 --json");
  ASSERT_EQ(j["cases"].size(), 2u);
  for (const auto& c : j["cases"]) {
    EXPECT_GE(c["indexed_blocks"].get<uint64_t>(), 19000u) << c.dump();
    EXPECT_GT(c["route_inproc_p99_us"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["route_grpc_p99_us"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["ratio_grpc_p99_vs_round_robin"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["block_events_per_s"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["index_bytes_per_block"].get<double>(), 20) << c.dump();
  }
}

}  // namespace

namespace {

// --transports tls: the socket data plane under --data-tls moves every
// block (the bench checks the bytes read back), beside the plaintext socket
// row of the same case and nginx over HTTPS.
TEST(BenchSmoke, DataPlaneBenchMeasuresTlsBesidePlaintextAndNginx) {
  auto j = RunJson(
      "dataplane --transports tcp,tls --sizes 64KiB --batches 32 --working-set 4MiB "
      "--inline=false --repeats 1 --json");
  ASSERT_TRUE(j.contains("cases"));
  int tls_rows = 0;
  for (const auto& c : j["cases"]) {
    if (c["path"] != "socket-tls") continue;
    tls_rows++;
    EXPECT_GT(c["gb_per_s"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["ratio_vs_plain_socket"].get<double>(), 0) << c.dump();
    if (c["op"] == "get") {
      EXPECT_GT(c["ratio_vs_nginx_https"].get<double>(), 0) << c.dump();
    }
  }
  EXPECT_EQ(tls_rows, 2);  // a put and a get
  ASSERT_TRUE(j.contains("nginx"));
  EXPECT_GT(j["nginx"][0]["http_gb_per_s"].get<double>(), 0);
  EXPECT_GT(j["nginx"][0]["https_gb_per_s"].get<double>(), 0);
}

TEST(BenchSmoke, DataPlaneBenchCarriesRatiosForEveryCase) {
  auto j = RunJson("dataplane --sizes 256KiB --batches 1,32 --working-set 8MiB --json");
  ASSERT_TRUE(j.contains("cases"));
  // 4 paths (socket, UCX TCP, shared memory, inline gRPC) x 2 batches x put/get.
  ASSERT_EQ(j["cases"].size(), 16u);
  for (const auto& c : j["cases"]) {
    EXPECT_GT(c["gb_per_s"].get<double>(), 0) << c.dump();
    // Every case beside the data plane's own ceiling and Redis at its best.
    EXPECT_GT(c["ratio_vs_raw_rma"].get<double>(), 0) << c.dump();
    EXPECT_GT(c["ratio_vs_redis_best"].get<double>(), 0) << c.dump();
    // Per transport: ucx_perftest for TCP, memcpy of distinct buffers for
    // shared memory (perftest there reuses one cache-resident buffer).
    const std::string path = c["path"];
    if (path == "shm") {
      EXPECT_TRUE(c.contains("ratio_vs_memcpy")) << c.dump();
      EXPECT_FALSE(c.contains("ratio_vs_perftest")) << c.dump();
    } else {
      EXPECT_TRUE(c.contains("ratio_vs_perftest")) << c.dump();
    }
    // The socket data plane beside the UCX one, same case.
    if (path == "socket") {
      EXPECT_GT(c["ratio_vs_ucx_data_plane"].get<double>(), 0) << c.dump();
    }
  }
  ASSERT_TRUE(j.contains("redis_best"));
  EXPECT_GT(j["redis_best"][0]["set_clients"].get<int>(), 0);
  // Mooncake Store beside every TCP case, unless the project's Python
  // environment could not be made (then the output says why).
  if (!j.contains("mooncake_not_measured")) {
    for (const auto& c : j["cases"]) {
      if (c["path"] != "shm") {
        EXPECT_GT(c["ratio_vs_mooncake"].get<double>(), 0) << c.dump();
      }
    }
  } else {
    EXPECT_FALSE(j["mooncake_not_measured"].get<std::string>().empty());
  }
}

}  // namespace

namespace {

TEST(BenchSmoke, WorkerBenchComparesWithTheDataPlaneAndMemcpy) {
  auto j = RunJson(
      "worker --working-set 16MiB --sizes 1MiB --latency-sizes 64KiB --latency-blocks 4,16 "
      "--reps 5 --layerwise-layers 8 --json");
  ASSERT_EQ(j["cases"].size(), 1u);
  const auto& c = j["cases"][0];
  for (const char* k : {"offload_gb_per_s", "onboard_gb_per_s", "dataplane_put_gb_per_s",
                        "dataplane_get_gb_per_s", "gather_gb_per_s", "memcpy_gb_per_s"}) {
    EXPECT_GT(c[k].get<double>(), 0) << k;
  }
  EXPECT_TRUE(c.contains("gather_ratio_vs_memcpy"));
  // The load-latency cases, each beside raw RMA and a round trip.
  ASSERT_EQ(j["latency"].size(), 2u);
  for (const auto& l : j["latency"]) {
    for (const char* k : {"load_p50_ms", "raw_rma_p50_ms", "rtt_p50_ms", "ratio_vs_target"}) {
      EXPECT_GT(l[k].get<double>(), 0) << k << " " << l.dump();
    }
  }
  // The layer-wise case: the first layer lands before the whole load.
  EXPECT_LT(j["layerwise"]["first_over_all"].get<double>(), 1.0) << j["layerwise"].dump();
}

TEST(BenchSmoke, BadListFlagsAreRefusedNamingTheFlag) {
  struct Case {
    const char* args;
    const char* expect;
  };
  for (const Case& c : {Case{"dataplane --sizes 64KiB,bogus", "--sizes: \"bogus\""},
                        Case{"dataplane --sizes ,", "--sizes lists nothing"},
                        Case{"dataplane --batches 0", "--batches: \"0\""},
                        Case{"worker --sizes 1000", "multiple of 32768"},
                        Case{"router --workers 8,x", "--workers: \"x\""}}) {
    ShellResult r = RunShell(std::string(KVTIER_BENCH_BIN) + " " + c.args + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
}

}  // namespace
