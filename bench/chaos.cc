// kvtier-bench chaos: a multi-host cluster in network namespaces, faults
// injected while a trace replays through it (docs/reliability.md,
// "Several hosts").
//
// The harness creates its own namespaces: a hub holding a bridge, and one
// namespace per host (three store shards, a router, four workers, the
// client), each joined to the bridge by a veth pair and given an address
// of 10.213.0.0/24 inside it. Nothing is added to the namespace it was
// started in. It removes them on exit, after a failure too, and at start
// removes those a killed run left behind. Needs root and iproute2; packet
// loss needs nft (nftables), shaping tc.
//
// Per scenario, requests run before the fault, during it and after it is
// healed; each phase reports requests done and failed, loads that failed
// and were recomputed, onboarded blocks verified and mismatched (wrong
// bytes), and TTFT p50/p99, and the scenario the time from healing to the
// last failed request and to every source being back at the router.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/chaos_report.h"
#include "bench/trace.h"
#include "common/config.h"
#include "common/log.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "testing/netns.h"
#include "testing/process.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kTag[] = "kvc";
constexpr int kStores = 3, kWorkers = 4;
using Host = NetnsLab::Host;

ShellResult Sh(const std::string& cmd) { return RunShell(cmd + " 2>&1"); }

// SIGINT or SIGTERM: stop after the current phase and clean up.
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

struct Scenario {
  std::string name, what;
  std::function<absl::Status()> inject, heal;
};

class Chaos {
 public:
  Chaos(const std::vector<TraceRequest>& trace, double phase_s, int concurrency)
      : trace_(trace), phase_s_(phase_s), concurrency_(concurrency) {}

  absl::Status Setup(const std::string& scratch) {
    NetnsLab::RemoveStale(kTag);
    std::vector<std::string> names;
    for (int s = 0; s < kStores; ++s) names.push_back(absl::StrCat("store", s));
    names.push_back("router");
    for (int w = 0; w < kWorkers; ++w) names.push_back(absl::StrCat("worker", w));
    names.push_back("client");
    if (std::string error; !net_.Create(names, &error)) return absl::InternalError(error);
    const std::string ip_path = NetnsLab::IpPath();
    setenv("UCX_TLS", "tcp", 1);  // hosts apart: no shared memory between them
    std::string stores;
    for (int s = 0; s < kStores; ++s) {
      const Host& h = net_.at(absl::StrCat("store", s));
      stores += (s ? "," : "") + h.ip + ":7400";
      store_.push_back(std::make_unique<NetnsServer>(
          ip_path, h, DefaultBinary("cachestore", "kvtier-store"),
          std::vector<std::string>{"--listen=" + h.ip + ":7400", "--data-listen=" + h.ip + ":7401",
                                   absl::StrCat("--data-dir=", scratch, "/db", s),
                                   "--ram-bytes=64MiB", "--disk-bytes=1GiB", "--hugepages=false",
                                   "--router=" + net_.at("router").ip + ":7500",
                                   absl::StrCat("--store-id=store", s)},
          absl::StrCat(scratch, "/store", s, ".log")));
    }
    const Host& rh = net_.at("router");
    router_ = std::make_unique<NetnsServer>(
        ip_path, rh, DefaultBinary("router", "kvtier-router"),
        std::vector<std::string>{"--listen=" + rh.ip + ":7500", "--heartbeat-deadline=2s"},
        scratch + "/router.log");
    for (int w = 0; w < kWorkers; ++w) {
      const Host& h = net_.at(absl::StrCat("worker", w));
      worker_.push_back(std::make_unique<NetnsServer>(
          ip_path, h, DefaultBinary("worker", "kvtier-sim-worker"),
          std::vector<std::string>{
              "--listen=" + h.ip + ":8000", absl::StrCat("--worker-id=worker", w),
              "--store=" + stores, "--router=" + rh.ip + ":7500", "--model=mooncake-trace",
              "--dtype=fp16", "--layers=1", "--kv-heads=1", "--head-dim=32", "--block-tokens=512",
              "--pages=512", "--prefill-tokens-per-s=20000", "--time-scale=0.05",
              "--heartbeat=100ms", "--offload=write-through", "--deadline=2s"},
          absl::StrCat(scratch, "/worker", w, ".log")));
      endpoints_.push_back(h.ip + ":8000");
    }
    // The client lives in its own namespace: every channel from here on.
    if (!net_.Enter("client")) return absl::InternalError("cannot enter the client's namespace");
    router_->Start();
    for (auto& s : store_) s->Start();
    for (auto& w : worker_) w->Start();
    for (const auto& e : endpoints_) {
      workers_.push_back(
          v1::SimWorker::NewStub(grpc::CreateChannel(e, grpc::InsecureChannelCredentials())));
    }
    router_stub_ = v1::Router::NewStub(
        grpc::CreateChannel(rh.ip + ":7500", grpc::InsecureChannelCredentials()));
    if (WaitAllSources(std::chrono::seconds(60)) < 0) {
      return absl::DeadlineExceededError("the cluster did not come up in 60 s; see the logs in " +
                                         scratch);
    }
    return absl::OkStatus();
  }

  // Seconds until the router lists every source connected (-1: timeout).
  double WaitAllSources(std::chrono::milliseconds timeout) {
    const auto start = Clock::now();
    while (!g_stop && Clock::now() - start < timeout) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      v1::ListWorkersResponse r;
      if (router_stub_->ListWorkers(&ctx, {}, &r).ok()) {
        int connected = 0;
        for (const auto& s : r.sources()) connected += s.connected() ? 1 : 0;
        if (connected == kStores + kWorkers) {
          return std::chrono::duration<double>(Clock::now() - start).count();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return -1;
  }

  // One request of the trace: routed (or round-robin if the router does
  // not answer), submitted, its outcome added to `f` (the caller's own).
  void Request(size_t i, PhaseFigures* f) {
    const TraceRequest& tr = trace_[i % trace_.size()];
    // Cycles of the trace use fresh ids for a cycle's new blocks... the
    // same trace again is a replay with everything cached: shift the ids
    // per cycle so each cycle computes, stores and reuses afresh.
    const uint64_t cycle = i / trace_.size();
    v1::SubmitRequest req;
    req.set_request_id(i + 1);
    req.set_prompt_tokens(tr.input_length);
    req.set_output_tokens(std::min<uint32_t>(tr.output_length, 16));
    v1::RouteRequest rr;
    rr.set_namespace_id(ns_);
    rr.set_prompt_tokens(tr.input_length);
    for (uint64_t id : tr.hash_ids) {
      BlockHash h = TraceHash(ns_, id + (cycle << 40));
      auto* p = req.mutable_hashes()->add_hashes();
      p->set_hi(h.hi);
      p->set_lo(h.lo);
      *rr.mutable_hashes()->add_hashes() = *p;
    }
    size_t w = i % workers_.size();
    bool routed = false;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      v1::RouteResponse route;
      if (router_stub_->Route(&ctx, rr, &route).ok()) {
        for (size_t k = 0; k < endpoints_.size(); ++k) {
          if (endpoints_[k] == route.endpoint()) {
            w = k;
            routed = true;
          }
        }
      }
    }
    const auto start = Clock::now();
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::SubmitResponse resp;
    grpc::Status s = workers_[w]->Submit(&ctx, req, &resp);
    const double wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    f->unrouted += routed ? 0 : 1;
    if (!s.ok()) {
      f->failed++;
      return;
    }
    f->done++;
    f->load_failed += resp.load_status().empty() ? 0 : 1;
    f->verified += resp.verified_blocks();
    f->mismatched += resp.mismatched_blocks();
    f->ttft.push_back(resp.ttft_ms());
    f->wall.push_back(wall_ms);
  }

  nlohmann::json Run(const Scenario& sc) {
    PhaseFigures phases[3];
    std::mutex mu;
    std::atomic<int> phase{0};
    std::atomic<bool> stop{false};
    std::atomic<double> last_bad_after{-1};
    std::atomic<Clock::rep> healed_at{0};  // Clock ticks, set before phase 2 begins
    std::vector<std::thread> threads;
    for (int t = 0; t < concurrency_; ++t) {
      threads.emplace_back([&] {
        while (!stop) {
          const size_t i = next_++;
          const int p = phase.load();
          PhaseFigures f;
          Request(i, &f);
          std::lock_guard lk(mu);
          PhaseFigures& into = phases[p];
          into.done += f.done;
          into.failed += f.failed;
          into.load_failed += f.load_failed;
          into.verified += f.verified;
          into.mismatched += f.mismatched;
          into.unrouted += f.unrouted;
          into.ttft.insert(into.ttft.end(), f.ttft.begin(), f.ttft.end());
          into.wall.insert(into.wall.end(), f.wall.begin(), f.wall.end());
          if (p == 2 && (f.failed + f.load_failed + f.unrouted) > 0) {
            const Clock::time_point healed{Clock::duration(healed_at.load())};
            last_bad_after = std::chrono::duration<double>(Clock::now() - healed).count();
          }
        }
      });
    }
    auto sleep = [](double s) {  // cut short by a signal
      const auto end = Clock::now() + std::chrono::duration<double>(s);
      while (!g_stop && Clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    };
    sleep(phase_s_);
    // Interrupted: no fault is injected (or healed) on the way out.
    absl::Status injected = g_stop ? absl::OkStatus() : sc.inject();
    phase = 1;
    sleep(phase_s_);
    absl::Status heal_status = g_stop ? absl::OkStatus() : sc.heal();
    const Clock::time_point healed = Clock::now();
    healed_at = healed.time_since_epoch().count();
    phase = 2;
    const double back = WaitAllSources(std::chrono::seconds(60));
    sleep(std::max(0.0, phase_s_ - std::chrono::duration<double>(Clock::now() - healed).count()));
    stop = true;
    for (auto& t : threads) t.join();
    nlohmann::json j = {
        {"scenario", sc.name},
        {"fault", sc.what},
        {"before", phases[0].Json()},
        {"during", phases[1].Json()},
        {"after", phases[2].Json()},
        {"sources_back_s", back},
        {"last_failure_after_heal_s", last_bad_after.load() < 0 ? 0.0 : last_bad_after.load()}};
    if (!injected.ok()) j["inject_error"] = std::string(injected.message());
    if (!heal_status.ok()) j["heal_error"] = std::string(heal_status.message());
    return j;
  }

  // The scenarios, by name.
  std::map<std::string, Scenario> Scenarios() {
    const Host& s0 = store_[0]->host();
    auto sh = [](const std::string& cmd) -> absl::Status {
      ShellResult r = Sh(cmd);
      return r.exit_code == 0 ? absl::OkStatus() : absl::InternalError(cmd + ": " + r.out);
    };
    auto loss = [&, sh](int pct) {
      return Scenario{
          absl::StrCat("loss", pct),
          absl::StrCat(pct, " % of store0's packets dropped (nft, both ways)"),
          [=, &s0] {
            return sh(absl::StrCat(
                "ip netns exec ", s0.ns, " nft -f - <<'EOF'\n",
                "table inet kvchaos {\n"
                " chain in { type filter hook input priority 0; numgen random mod 100 < ",
                pct,
                " drop; }\n chain out { type filter hook output priority 0; "
                "numgen random mod 100 < ",
                pct, " drop; }\n}\nEOF"));
          },
          [=, &s0] { return sh("ip netns exec " + s0.ns + " nft delete table inet kvchaos"); }};
    };
    std::map<std::string, Scenario> m;
    m["link-down"] = {"link-down", "store0's link down, then up",
                      [=, &s0] { return sh("ip -n " + s0.ns + " link set eth0 down"); },
                      [=, &s0] { return sh("ip -n " + s0.ns + " link set eth0 up"); }};
    m["kill9"] = {"kill9", "kill -9 of store0, restarted on the same data",
                  [this] {
                    store_[0]->Kill9();
                    return absl::OkStatus();
                  },
                  [this] {
                    store_[0]->Start();
                    return absl::OkStatus();
                  }};
    m["loss1"] = loss(1);
    m["loss10"] = loss(10);
    m["shaped"] = {
        "shaped", "store0's link shaped to 100 Mbit/s (tc tbf)",
        [=, &s0] {
          return sh("ip netns exec " + s0.ns +
                    " tc qdisc add dev eth0 root tbf rate 100mbit burst 64kb latency 100ms");
        },
        [=, &s0] { return sh("ip netns exec " + s0.ns + " tc qdisc del dev eth0 root"); }};
    m["router-down"] = {"router-down", "kill -9 of the router, restarted (workers keep serving)",
                        [this] {
                          router_->Kill9();
                          return absl::OkStatus();
                        },
                        [this] {
                          router_->Start();
                          return absl::OkStatus();
                        }};
    return m;
  }

  // The client's channels go first: an idle gRPC client reads a server's
  // GOAWAY only when its backup poller runs (every 5 s), and a server's
  // graceful shutdown waits for that connection to close (up to its 2 s
  // grace). Then every server is sent SIGTERM at once and reaped.
  void Stop() {
    workers_.clear();
    router_stub_.reset();
    for (auto& w : worker_) w->Terminate();
    for (auto& s : store_) s->Terminate();
    if (router_) router_->Terminate();
    for (auto& w : worker_) w->Stop();
    for (auto& s : store_) s->Stop();
    if (router_) router_->Stop();
  }
  void set_namespace(uint64_t ns) { ns_ = ns; }

 private:
  const std::vector<TraceRequest>& trace_;
  const double phase_s_;
  const int concurrency_;
  NetnsLab net_{kTag};
  std::vector<std::unique_ptr<NetnsServer>> store_, worker_;
  std::unique_ptr<NetnsServer> router_;
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<v1::SimWorker::Stub>> workers_;
  std::unique_ptr<v1::Router::Stub> router_stub_;
  uint64_t ns_ = 0;
  std::atomic<size_t> next_{0};
};

}  // namespace

int RunChaos(int argc, const char* const* argv) {
  std::string trace_path = KVTIER_SOURCE_DIR "/bench/traces/conversation_trace.jsonl";
  std::string scenarios = "link-down,kill9,loss1,loss10,shaped,router-down";
  double phase_s = 5;
  int64_t concurrency = 4;
  bool quick = false, json = false;
  FlagSet flags("kvtier-bench chaos",
                "A cluster of 3 store shards, a router and 4 workers, each host in a network\n"
                "namespace of its own on a bridge, a trace replayed through it while faults are\n"
                "injected: per scenario the requests done, loads recomputed, wrong bytes and TTFT\n"
                "before, during and after, and the time to recover. Needs root and iproute2.");
  flags.String("trace", &trace_path, "Trace to replay (Mooncake JSONL)");
  flags.String("scenarios", &scenarios,
               "Comma-separated: link-down, kill9, loss1, loss10, shaped, router-down");
  flags.Double("phase-s", &phase_s, 0.5, 600, "Seconds before, during and after each fault");
  flags.Int("concurrency", &concurrency, 1, 64, "Requests in flight");
  flags.Bool("quick", &quick, "The short run: link-down, kill9 and router-down, 3 s phases");
  flags.Bool("json", &json, "Print JSON");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  if (quick) {
    scenarios = "link-down,kill9,router-down";
    phase_s = 3;
  }
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  if (geteuid() != 0 || !HaveCommand("ip")) {
    std::printf(
        "kvtier-bench chaos: skipped: it needs root and iproute2 (ip) to create network "
        "namespaces\n");
    return 77;
  }
  auto trace = ReadTrace(trace_path);
  if (!trace.ok() || trace->empty()) {
    std::fprintf(stderr, "kvtier-bench chaos: %s\n",
                 trace.ok() ? "the trace is empty" : std::string(trace.status().message()).c_str());
    return 2;
  }
  TempDir dir;
  Chaos chaos(*trace, phase_s, static_cast<int>(concurrency));
  chaos.set_namespace(
      NamespaceId(NamespaceSpec{"mooncake-trace", "fp16", 1, 1, 32, 512, 0, 1, "", "", ""}));
  if (auto s = chaos.Setup(dir.path()); !s.ok()) {
    chaos.Stop();
    if (g_stop) {
      std::fprintf(stderr, "kvtier-bench chaos: interrupted; namespaces removed\n");
      return 130;
    }
    std::fprintf(stderr, "kvtier-bench chaos: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  auto all = chaos.Scenarios();
  nlohmann::json out = nlohmann::json::array();
  for (absl::string_view name : absl::StrSplit(scenarios, ',', absl::SkipEmpty())) {
    auto it = all.find(std::string(name));
    if (it == all.end()) {
      std::fprintf(stderr, "kvtier-bench chaos: unknown scenario \"%s\"\n",
                   std::string(name).c_str());
      chaos.Stop();
      return 2;
    }
    if (name.rfind("loss", 0) == 0 && !HaveCommand("nft")) {
      out.push_back(
          {{"scenario", it->second.name}, {"skipped", "nft (nftables) is not installed"}});
      continue;
    }
    if (g_stop) break;
    if (!json) std::fprintf(stderr, "  scenario %s...\n", std::string(name).c_str());
    out.push_back(chaos.Run(it->second));
  }
  chaos.Stop();
  if (g_stop) {
    std::fprintf(stderr, "kvtier-bench chaos: interrupted; namespaces removed\n");
    return 130;
  }
  if (json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  PrintChaosReport(out, phase_s, concurrency);
  return 0;
}

}  // namespace kvtier::bench
