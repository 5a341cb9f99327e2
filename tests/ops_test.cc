// Operating kvtier: kvctl against real servers on loopback (output, JSON
// shape, exit codes) and the Prometheus endpoints scraped for real.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <regex>
#include <set>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_format.h"
#include "common/block_key.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::HttpGet;
using testing::ServerProcess;
using testing::WaitFor;

struct CliRun {
  int code;
  std::string out;
};

CliRun Kvctl(const std::string& args, const std::string& env = "") {
  std::string cmd = env + " " + KVTIER_KVCTL_BIN + " " + args + " 2>&1 </dev/null";
  ShellResult r = RunShell(cmd);
  return {r.exit_code, std::move(r.out)};
}

class Ops : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    router_ = testing::StartOnFreePorts(KVTIER_ROUTER_BIN, dir_.sub("router"), [&] {
      router_metrics_ = testing::FreePort();
      return std::vector<std::string>{
          "--listen=127.0.0.1:0", "--heartbeat-deadline=2s",
          "--metrics-listen=127.0.0.1:" + std::to_string(router_metrics_)};
    });
    ASSERT_GT(router_->port(), 0) << router_->Log();
    metrics_ports_.resize(2);
    for (int s = 0; s < 2; ++s) {
      stores_.push_back(
          testing::StartOnFreePorts(KVTIER_STORE_BIN, dir_.sub("store" + std::to_string(s)), [&] {
            metrics_ports_[s] = testing::FreePort();
            std::vector<std::string> flags = {
                "--listen=127.0.0.1:0",
                "--data-listen=127.0.0.1:0",
                "--data-dir=" + dir_.sub("db" + std::to_string(s)),
                "--hugepages=false",
                "--ram-bytes=16MiB",
                "--metrics-listen=127.0.0.1:" + std::to_string(metrics_ports_[s])};
            if (s == 0) {
              flags.push_back("--router=" + router_->address());  // its fetch figures, for routes
              // A port of its own, so the address it advertises to the router is known.
              flags[0] = "--listen=127.0.0.1:" + std::to_string(testing::FreePort());
            }
            return flags;
          }));
      ASSERT_GT(stores_.back()->port(), 0) << stores_.back()->Log();
    }
    worker_ = std::make_unique<ServerProcess>(
        KVTIER_SIM_WORKER_BIN, dir_.sub("w1"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--store=" + stores_[0]->address(),
                                 "--router=" + router_->address(), "--worker-id=w1", "--pages=128",
                                 "--offload=write-through", "--heartbeat=100ms"});
    ASSERT_GT(worker_->port(), 0) << worker_->Log();
    // One request through the worker: blocks land in store 0 and the router.
    auto stub = v1::SimWorker::NewStub(
        grpc::CreateChannel(worker_->address(), grpc::InsecureChannelCredentials()));
    v1::SubmitRequest req;
    std::ofstream tokens(dir_.sub("tokens.txt"));
    for (int i = 0; i < 100; ++i) {
      req.mutable_tokens()->add_ids(i);
      tokens << i << (i % 10 == 9 ? "\n" : " ");
    }
    tokens.close();
    grpc::ClientContext ctx;
    v1::SubmitResponse resp;
    ASSERT_TRUE(stub->Submit(&ctx, req, &resp).ok());
    // Its 6 blocks reach the store after it answered (offloads never hold a
    // request): the tests start once they have. The offload thread runs at
    // nice 10, behind every busy thread of a loaded host (seen: past 10 s
    // while ctest -j2 ran the vLLM engine test beside it), so it is given a
    // minute; a failed offload ends the wait at once.
    v1::GetWorkerStatsResponse st;
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          grpc::ClientContext sctx;
          return stub->GetWorkerStats(&sctx, {}, &st).ok() &&
                 (st.offloaded_blocks() == 6 || st.offload_failures() > 0);
        },
        std::chrono::seconds(60)));
    ASSERT_EQ(st.offloaded_blocks(), 6u) << st.DebugString() << "worker log:\n"
                                         << worker_->Log() << "store log:\n"
                                         << stores_[0]->Log();
    stores_env_ = "KVTIER_STORE=" + stores_[0]->address() + "," + stores_[1]->address() +
                  " KVTIER_ROUTER=" + router_->address();
    ns_ = absl::StrFormat(
        "%016x", NamespaceId(NamespaceSpec{"sim-model", "fp16", 4, 2, 64, 16, 0, 1, "", "", ""}));
  }
  testing::TempDir dir_;
  std::vector<std::unique_ptr<ServerProcess>> stores_;
  std::vector<int> metrics_ports_;
  int router_metrics_ = 0;
  std::unique_ptr<ServerProcess> router_, worker_;
  std::string stores_env_, ns_;
};

TEST_F(Ops, StatsPerShardAndSummedAsTableAndJson) {
  CliRun r = Kvctl("stats", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("total"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("s3fifo"), std::string::npos);
  r = Kvctl("stats --json", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["shards"].size(), 2u);
  EXPECT_EQ(j["total"]["tiers"]["ram"]["items"].get<uint64_t>(), 6u);  // 100 tokens: 6 blocks
  for (const char* k : {"capacity_bytes", "used_bytes", "hit_ratio", "evictions", "promotions",
                        "demotions", "bytes_in", "bytes_out", "policy"}) {
    // Keyed by address, as every kvctl --json.
    EXPECT_TRUE(j["shards"][stores_[0]->address()]["tiers"]["ram"].contains(k)) << k << r.out;
  }
  // Global flags may also come before the subcommand.
  r = Kvctl("--store " + stores_[0]->address() + "," + stores_[1]->address() + " --json stats");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["shards"].size(), 2u);
  r = Kvctl("--watch stats", stores_env_);
  EXPECT_EQ(r.code, 2) << r.out;
}

TEST_F(Ops, PolicyGetAndSet) {
  CliRun r = Kvctl("policy set --tier disk sieve --json", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  r = Kvctl("policy get", stores_env_);
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("disk  sieve"), std::string::npos) << r.out;
  r = Kvctl("policy set --tier ram s3fifo --param small_fraction=0.2", stores_env_);
  EXPECT_EQ(r.code, 0) << r.out;
  // --json carries every parameter.
  r = Kvctl("policy get --json", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j[stores_[0]->address()]["ram"]["policy"], "s3fifo") << r.out;
  EXPECT_DOUBLE_EQ(j[stores_[0]->address()]["ram"]["params"]["small_fraction"].get<double>(), 0.2)
      << r.out;
  EXPECT_EQ(j[stores_[0]->address()]["disk"]["policy"], "sieve") << r.out;
  r = Kvctl("policy set --tier ram mru", stores_env_);
  EXPECT_EQ(r.code, 1) << r.out;  // refused by the store, with its reason
  EXPECT_NE(r.out.find("mru"), std::string::npos) << r.out;
  r = Kvctl("policy set --tier cpu lru", stores_env_);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--tier"), std::string::npos);
}

TEST_F(Ops, EvictAsksUnlessYes) {
  CliRun r = Kvctl("evict --namespace " + ns_, stores_env_);
  EXPECT_EQ(r.code, 4) << r.out;  // stdin is not a terminal: nothing done without --yes
  EXPECT_NE(r.out.find("--yes"), std::string::npos);
  r = Kvctl("stats --json", stores_env_);
  EXPECT_EQ(nlohmann::json::parse(r.out)["total"]["tiers"]["ram"]["items"].get<uint64_t>(), 6u);
  r = Kvctl("evict --namespace " + ns_ + " --yes --json", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j[stores_[0]->address()]["ram_blocks"].get<uint64_t>(), 6u);
  r = Kvctl("evict --all --namespace " + ns_ + " --yes", stores_env_);
  EXPECT_EQ(r.code, 2);
}

TEST_F(Ops, LookupWorkersAndRoute) {
  CliRun r = Kvctl("lookup --namespace " + ns_ + " --tokens " + dir_.sub("tokens.txt") + " --json",
                   "KVTIER_STORE=" + stores_[0]->address());
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j[stores_[0]->address()]["present_prefix"].get<uint64_t>(), 6u);
  ASSERT_TRUE(WaitFor([&] {
    CliRun w = Kvctl("workers --json", stores_env_);
    if (w.code != 0) return false;
    auto wj = nlohmann::json::parse(w.out);
    // w1 and store 0 (which publishes to the router too).
    for (const auto& src : wj["sources"]) {
      if (src["id"] == "w1") return src["indexed_blocks"].get<uint64_t>() == 6;
    }
    return false;
  }));
  r = Kvctl("workers", stores_env_);
  EXPECT_NE(r.out.find("w1"), std::string::npos);
  // A store shard shows the address it serves on (it had no endpoint).
  r = Kvctl("workers --json", stores_env_);
  bool store_shown = false;
  const auto sources = nlohmann::json::parse(r.out)["sources"];
  for (const auto& src : sources) {
    if (src["kind"] == "store") {
      store_shown = src["endpoint"] == "127.0.0.1:" + std::to_string(stores_[0]->port());
    }
  }
  EXPECT_TRUE(store_shown) << r.out;
  r = Kvctl("route --namespace " + ns_ + " --tokens " + dir_.sub("tokens.txt") + " --json",
            stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["worker"], "w1");
  EXPECT_EQ(j["gpu_hit_blocks"].get<uint64_t>(), 6u);
  EXPECT_TRUE(j.contains("store_end_blocks")) << r.out;  // a number, or null while unknown
  EXPECT_EQ(j["candidates"].size(), 1u);
  r = Kvctl("route --namespace " + ns_ + " --tokens " + dir_.sub("tokens.txt"), stores_env_);
  EXPECT_NE(r.out.find("candidate"), std::string::npos) << r.out;
}

// Every binary and kvctl print the build's version; kvctl version asks each
// server for its own, and says which could not be reached (exit 3).
TEST_F(Ops, VersionsEverywhere) {
  for (const std::string bin :
       {KVTIER_STORE_BIN, KVTIER_ROUTER_BIN, KVTIER_SIM_WORKER_BIN, KVTIER_BENCH_BIN}) {
    ShellResult r = RunShell(bin + " --version 2>&1");
    EXPECT_EQ(r.exit_code, 0) << bin << r.out;
    EXPECT_NE(r.out.find(std::string(" ") + KVTIER_VERSION + "\n"), std::string::npos) << r.out;
  }
  CliRun r = Kvctl("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, std::string("kvctl ") + KVTIER_VERSION + "\n");
  r = Kvctl("version --json", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kvctl"], KVTIER_VERSION);
  EXPECT_EQ(j["servers"]["store " + stores_[0]->address()], KVTIER_VERSION) << r.out;
  EXPECT_EQ(j["servers"]["store " + stores_[1]->address()], KVTIER_VERSION) << r.out;
  EXPECT_EQ(j["servers"]["router " + router_->address()], KVTIER_VERSION) << r.out;
  r = Kvctl("version --router 127.0.0.1:1 --timeout 1s", stores_env_);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("router 127.0.0.1:1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::string("store ") + stores_[0]->address()), std::string::npos);
}

// Start-up errors name the cause and the fix.
TEST_F(Ops, StartUpErrorsNameTheCause) {
  // A second store on a data directory in use: said so, the directory named.
  ShellResult r = RunShell(std::string(KVTIER_STORE_BIN) +
                           " --listen=127.0.0.1:0 --hugepages=false --ram-bytes=16MiB --data-dir=" +
                           dir_.sub("db0") + " 2>&1 </dev/null");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("is in use by another kvtier-store"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(dir_.sub("db0")), std::string::npos) << r.out;
  // --ram-bytes 0 is blamed on --ram-bytes.
  r = RunShell(std::string(KVTIER_STORE_BIN) + " --ram-bytes=0 --data-dir=" + dir_.sub("x") +
               " 2>&1 </dev/null");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--ram-bytes must be above 0"), std::string::npos) << r.out;
  // A port in use: one line that says so, not gRPC's own log.
  r = RunShell(std::string(KVTIER_STORE_BIN) + " --listen=" + router_->address() +
               " --hugepages=false --ram-bytes=16MiB --data-dir=" + dir_.sub("busy") +
               " 2>&1 </dev/null");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("the address is in use"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Failed to add"), std::string::npos) << r.out;
}

TEST_F(Ops, NamespacesHaveAHeaderAndSayWhenThereAreNone) {
  CliRun r = Kvctl("namespaces", stores_env_);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("SHARD", 0), 0u) << r.out;
  EXPECT_NE(r.out.find(ns_), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("RAM BLOCKS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("HIT%"), std::string::npos) << r.out;
  r = Kvctl("namespaces --json", stores_env_);
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j[stores_[0]->address()][0]["id"], ns_) << r.out;
  // What the namespace holds: the request's 6 blocks, in RAM.
  const auto& n = j[stores_[0]->address()][0];
  EXPECT_EQ(n["ram_blocks"], 6u) << r.out;
  EXPECT_EQ(n["nvme_blocks"], 0u) << r.out;
  EXPECT_EQ(n["ram_bytes"], 6 * n["block_bytes"].get<uint64_t>()) << r.out;
  EXPECT_LE(n["blocks_served"].get<uint64_t>(), n["blocks_asked"].get<uint64_t>()) << r.out;
  EXPECT_TRUE(j[stores_[1]->address()].is_array()) << r.out;  // [] when none, never null
  auto empty = testing::StartLoopbackStore(dir_.sub("empty"));
  ASSERT_GT(empty->port(), 0) << empty->Log();
  r = Kvctl("namespaces --store " + empty->address());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("no namespaces on 1 shard"), std::string::npos) << r.out;
  r = Kvctl("namespaces --json --store " + empty->address());
  EXPECT_EQ(nlohmann::json::parse(r.out)[empty->address()], nlohmann::json::array()) << r.out;
}

// kvctl route explains without adding load; --count makes the assignment.
TEST_F(Ops, RouteIsADryRunUnlessCounted) {
  auto routed = [&] {
    CliRun w = Kvctl("workers --json", stores_env_);
    auto j = nlohmann::json::parse(w.out);
    for (const auto& x : j["sources"]) {
      if (x["id"] == "w1") return x["routed_tokens_since_heartbeat"].get<uint64_t>();
    }
    return uint64_t{0};
  };
  const std::string route =
      "route --namespace " + ns_ + " --tokens " + dir_.sub("tokens.txt") + " --json";
  // Heartbeats (every 100 ms) reset the count: compare within one period
  // by routing many times.
  for (int i = 0; i < 20; ++i) ASSERT_EQ(Kvctl(route, stores_env_).code, 0);
  const uint64_t after_dry = routed();
  EXPECT_EQ(after_dry, 0u);
  bool counted = false;
  for (int attempt = 0; attempt < 20 && !counted; ++attempt) {
    ASSERT_EQ(Kvctl(route + " --count", stores_env_).code, 0);
    counted = routed() > 0;
  }
  EXPECT_TRUE(counted);
}

// The router answered "no live worker serves namespace ...": a refusal
// (exit 1) with its message, not "is it running?" (exit 3).
TEST_F(Ops, ARouterThatAnsweredIsNotUnreachable) {
  CliRun r =
      Kvctl("route --namespace 00000000000000ab --tokens " + dir_.sub("tokens.txt"), stores_env_);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("no live worker serves namespace"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("is it running"), std::string::npos) << r.out;
  r = Kvctl("route --namespace 00000000000000ab --tokens " + dir_.sub("tokens.txt") +
            " --router 127.0.0.1:1 --timeout 1s");
  EXPECT_EQ(r.code, 3) << r.out;
}

TEST_F(Ops, WatchRefusesAnIntervalBelowItsMinimum) {
  CliRun r = Kvctl("stats --watch --interval 0s", stores_env_);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("below the minimum of 100ms"), std::string::npos) << r.out;
  EXPECT_EQ(Kvctl("stats --watch --interval 50ms", stores_env_).code, 2);
}

TEST_F(Ops, UnreachableAndBadUsageHaveTheirExitCodes) {
  CliRun r = Kvctl("stats --store 127.0.0.1:1 --timeout 1s");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("127.0.0.1:1"), std::string::npos);
  r = Kvctl("workers --router 127.0.0.1:1 --timeout 1s");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_EQ(Kvctl("frobnicate").code, 2);
  EXPECT_EQ(Kvctl("stats --bogus").code, 2);
  EXPECT_EQ(Kvctl("lookup --namespace zz --tokens x", stores_env_).code, 2);
  for (const char* c :
       {"stats", "policy get", "evict", "lookup", "workers", "route", "namespaces"}) {
    CliRun h = Kvctl(std::string(c) + " --help");
    EXPECT_EQ(h.code, 0) << c;
    EXPECT_NE(h.out.find("Usage: kvctl"), std::string::npos) << c << h.out;
  }
}

TEST_F(Ops, PrometheusEndpointsServeTheDocumentedMetrics) {
  std::string store = HttpGet(metrics_ports_[0], "/metrics");
  for (const char* name :
       {"kvtier_store_tier_used_bytes{tier=\"ram\"}", "kvtier_store_tier_items{tier=\"ram\"} 6",
        "kvtier_store_tier_hits_total", "kvtier_store_tier_evictions_total",
        "kvtier_store_tier_promotions_total", "kvtier_store_tier_demotions_total",
        "kvtier_store_rpc_duration_seconds_bucket{rpc=\"BeginPut\"",
        "kvtier_store_fetch_duration_seconds_bucket{tier=\"ram\"",
        "kvtier_store_fetch_duration_seconds_bucket{tier=\"disk\"",
        "kvtier_store_dataplane_bytes_total{direction=\"put\"}",
        "kvtier_store_leases{kind=\"put\"} 0",
        "kvtier_build_info{component=\"store\",version=\"" KVTIER_VERSION "\"} 1",
        "\nprocess_cpu_seconds_total ", "\nprocess_resident_memory_bytes ",
        "\nprocess_start_time_seconds ", "\nprocess_open_fds "}) {
    EXPECT_NE(store.find(name), std::string::npos) << name << "\n" << store.substr(0, 2000);
  }
  std::string router;
  ASSERT_TRUE(WaitFor([&] {
    router = HttpGet(router_metrics_, "/metrics");
    return router.find("kvtier_router_indexed_blocks 6") != std::string::npos;
  })) << router.substr(0, 2000);
  for (const char* name :
       {"kvtier_router_events_total{outcome=\"applied\"}",
        "kvtier_router_decisions_total{outcome=\"lowest_cost\"}",
        "kvtier_build_info{component=\"router\",version=\"" KVTIER_VERSION "\"} 1",
        "kvtier_router_source_up{kind=\"worker\",source=\"w1\"} 1",
        "kvtier_router_route_duration_seconds_count", "kvtier_router_index_bytes_per_block"}) {
    EXPECT_NE(router.find(name), std::string::npos) << name;
  }
}

// Every metric the Grafana dashboard (helm/kvtier/dashboards/kvtier.json)
// queries is exported by a live store or router, once a request has gone
// through them.
TEST_F(Ops, EveryDashboardQueryNamesAMetricALiveProcessExports) {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/helm/kvtier/dashboards/kvtier.json");
  nlohmann::json dash = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(dash.is_object());
  std::set<std::string> queried;
  const std::regex name("kvtier_[a-z0-9_]+");
  for (const auto& panel : dash["panels"]) {
    // A row has no queries; the front door's panels are checked against a
    // live kvtier-frontend by tests/python/test_frontend_fleet.py.
    for (const auto& target : panel.value("targets", nlohmann::json::array())) {
      const std::string expr = target["expr"];
      for (auto it = std::sregex_iterator(expr.begin(), expr.end(), name);
           it != std::sregex_iterator(); ++it) {
        if (it->str().rfind("kvtier_frontend_", 0) != 0) queried.insert(it->str());
      }
    }
  }
  ASSERT_GE(queried.size(), 10u);
  // A second worker onboards the fixture's prompt from store 0 (a fetch).
  // Its prefill is slow enough (100 tokens: 1 s) that the first load, data
  // plane connection and all, always lands before computing would end: the
  // engine does not wait for a load slower than computing.
  ServerProcess w2(KVTIER_SIM_WORKER_BIN, dir_.sub("w2"),
                   {"--listen=127.0.0.1:0", "--store=" + stores_[0]->address(),
                    "--router=" + router_->address(), "--worker-id=w2", "--pages=128",
                    "--offload=write-through", "--heartbeat=100ms", "--prefill-tokens-per-s=100"});
  ASSERT_GT(w2.port(), 0) << w2.Log();
  auto stub =
      v1::SimWorker::NewStub(grpc::CreateChannel(w2.address(), grpc::InsecureChannelCredentials()));
  v1::SubmitRequest req;
  for (int i = 0; i < 100; ++i) req.mutable_tokens()->add_ids(i);
  grpc::ClientContext ctx;
  v1::SubmitResponse resp;
  ASSERT_TRUE(stub->Submit(&ctx, req, &resp).ok());
  EXPECT_GT(resp.onboarded_tokens(), 0u) << resp.load_status();
  // The store's fetch figures reach the router with its heartbeats.
  std::string exported;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        exported = HttpGet(metrics_ports_[0], "/metrics") + HttpGet(metrics_ports_[1], "/metrics") +
                   HttpGet(router_metrics_, "/metrics");
        return exported.find("\nkvtier_router_store_fetch_seconds_per_block{") != std::string::npos;
      },
      std::chrono::seconds(10)))
      << "the store's fetch figures did not reach the router";
  // That fetch is in store 0's end-to-end fetch latency once its pin is
  // released (releases never hold the worker: they arrive soon after).
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        std::string s0 = HttpGet(metrics_ports_[0], "/metrics");
        const std::string line = "\nkvtier_store_fetch_duration_seconds_count{tier=\"ram\"} ";
        auto at = s0.find(line);
        return at != std::string::npos && s0.compare(at + line.size(), 2, "0\n") != 0;
      },
      std::chrono::seconds(10)))
      << "the fetch is not in kvtier_store_fetch_duration_seconds";
  for (const std::string& metric : queried) {
    EXPECT_TRUE(exported.find("\n" + metric + "{") != std::string::npos ||
                exported.find("\n" + metric + " ") != std::string::npos)
        << metric << " is queried by the dashboard but no live process exports it";
  }
}

}  // namespace
}  // namespace kvtier
