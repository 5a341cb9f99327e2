// kvtier-bench replay: the main job. Starts a whole kvtier cluster on
// loopback -- one kvtier-store (RAM + RocksDB NVMe tier), a router (inside
// this process, where requests enter, or a kvtier-router process: --router),
// N kvtier-sim-workers with small GPU page pools -- and replays a Mooncake
// trace through it in several modes, each on a fresh cluster:
//   round-robin        round-robin routing, no store (per-engine prefix caching)
//   round-robin+store  round-robin routing, workers onboard/offload via the store
//   kv-aware           kvtier's cost-based routing, no store
//   kvtier             kvtier's routing + the store
//   oracle             an infinite cache shared by all engines, from the trace
// Every onboarded block is verified byte for byte by the workers.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <latch>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/replay_cluster.h"
#include "bench/replay_result.h"
#include "bench/trace.h"
#include "common/config.h"
#include "common/log.h"
#include "router/wire.h"

namespace kvtier::bench {
namespace {

std::atomic<bool> g_interrupted{false};
void OnSignal(int) { g_interrupted = true; }

// A trace request's prompt as real tokens for the torch engine: each
// 512-token trace block becomes trace_block_tokens tokens that are a pure
// function of its hash id, so requests sharing trace blocks share prefixes;
// the prompt keeps the trace's length at that scale.
std::vector<uint32_t> TraceTokens(const TraceRequest& tr, int64_t per_block) {
  const uint64_t n =
      std::min<uint64_t>(tr.hash_ids.size() * per_block, (tr.input_length * per_block + 511) / 512);
  std::vector<uint32_t> out;
  out.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t x = tr.hash_ids[i / per_block] * 0x9E3779B97F4A7C15ull + (i % per_block) + 1;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    out.push_back(static_cast<uint32_t>((x ^ (x >> 31)) % kTorchVocab));
  }
  return out;
}

void Progress(const std::string& mode, size_t done, size_t total) {
  int width = 30;
  int filled = static_cast<int>(width * done / std::max<size_t>(total, 1));
  std::fprintf(stderr, "\r  %-18s [%s%s] %zu/%zu", mode.c_str(), std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
}

absl::StatusOr<ModeResult> RunMode(const Options& o, const std::string& mode,
                                   const std::vector<TraceRequest>& trace, const TempDir& dir) {
  // MODE@down / MODE@drain: MODE's cluster, scaled down mid-replay.
  const size_t at_sign = mode.find('@');
  const std::string base = mode.substr(0, at_sign);
  const std::string scenario = at_sign == std::string::npos ? "" : mode.substr(at_sign + 1);
  Options co = o;
  co.worker_drain = scenario == "drain";
  auto started = StartCluster(co, mode, dir);
  if (!started.ok()) return started.status();
  Cluster& cluster = *started;
  const bool torch = o.engine == "torch";
  // Only kvtier is a router and a store together.
  const bool hint = o.store_hint && base == "kvtier";
  const uint32_t block_tokens = torch ? kTorchBlockTokens : 512;
  const NamespaceSpec& spec = cluster.spec;
  const uint64_t ns = cluster.ns;
  auto& stubs = cluster.stubs;
  auto& workers = cluster.workers;
  auto& by_endpoint = cluster.by_endpoint;
  auto& rstub = cluster.rstub;
  auto& router = cluster.router;
  ModeResult res;
  res.name = mode;
  res.wire_block_bytes = BlockBytes(spec);
  res.work.assign(o.workers, 0);
  res.per_request.assign(trace.size(), {0, 0});
  std::mutex mu;
  std::vector<Timed> timed(trace.size());
  std::atomic<size_t> next{0}, done{0};
  absl::Status failure = absl::OkStatus();
  // Workers told to leave (a scale-down): a request one of them refused,
  // or lost as it stopped, is sent again to another, as a frontend fails
  // over. leaving_ids guarded by mu.
  std::vector<std::atomic<bool>> leaving(static_cast<size_t>(o.workers));
  std::vector<std::string> leaving_ids;
  uint64_t retried = 0;  // guarded by mu
  // The trace's clock starts once every client thread exists: starting
  // 256 threads takes real milliseconds that no request should be charged.
  Clock::time_point start;
  std::latch clock_started(1);
  // One dispatcher takes the requests in the trace's order, as a frontend
  // does: each when due, routed, then handed to one of `concurrency`
  // senders, which submit it and wait for its answer. (With a thread per
  // request in flight, at speed 50 a burst's requests 0.1 ms apart in real
  // time woke their threads out of order, and the router decided later
  // arrivals before earlier ones, on loads the engines, serving in arrival
  // order, never had.)
  struct Dispatched {
    size_t i = 0, w = 0;
    v1::SubmitRequest req;
    v1::RouteRequest rr;  // to route it again if its worker leaves
    double window_ms = 0, route_ms = 0;
  };
  std::mutex dmu;
  std::condition_variable work_cv, sender_cv;  // senders wait for work; the dispatcher for a sender
  std::deque<Dispatched> ready;
  int64_t free_senders = o.concurrency;
  bool dispatched_all = false;
  auto dispatch = [&] {
    clock_started.wait();
    for (size_t i = 0; i < trace.size() && !g_interrupted; ++i) {
      {
        std::lock_guard lk(mu);
        if (!failure.ok()) break;
      }
      const TraceRequest& tr = trace[i];
      // A request is due at its trace time / speed; the dispatcher sleeps
      // until then (how late the sleep wakes is host noise, not the
      // request's). One that then finds every sender busy waits for the
      // client's window: that wait is part of its TTFT.
      double window_ms = 0;
      const auto due = start + std::chrono::microseconds(static_cast<int64_t>(
                                   o.speed > 0 ? tr.timestamp_ms * 1000.0 / o.speed : 0));
      if (o.speed > 0 && Clock::now() < due) std::this_thread::sleep_until(due);
      {
        std::unique_lock lk(dmu);
        if (free_senders == 0) {
          sender_cv.wait(lk, [&] { return free_senders > 0; });
          const auto got = Clock::now();
          if (o.speed > 0 && got > due) {
            window_ms = std::chrono::duration<double, std::milli>(got - due).count() *
                        (torch ? 1.0 : o.speed);
          }
        }
        free_senders--;
      }
      v1::SubmitRequest req;
      req.set_request_id(i + 1);
      req.set_prompt_tokens(tr.input_length);
      req.set_output_tokens(tr.output_length);
      v1::RouteRequest rr;
      rr.set_namespace_id(ns);
      rr.set_prompt_tokens(tr.input_length);
      rr.set_request_id(req.request_id());  // the worker lists it once it has it
      if (torch) {
        const std::vector<uint32_t> tokens = TraceTokens(tr, o.trace_block_tokens);
        req.clear_prompt_tokens();
        rr.clear_prompt_tokens();
        req.mutable_tokens()->mutable_ids()->Add(tokens.begin(), tokens.end());
        *rr.mutable_tokens() = req.tokens();
      }
      for (uint64_t id : torch ? std::vector<uint64_t>{} : tr.hash_ids) {
        BlockHash h = TraceHash(ns, id);
        auto* p = req.mutable_hashes()->add_hashes();
        p->set_hi(h.hi);
        p->set_lo(h.lo);
        *rr.mutable_hashes()->add_hashes() = *p;
      }
      size_t w = i % o.workers;
      // A Service's endpoints drop a pod that leaves: round-robin goes on
      // over the workers that stay.
      if (!cluster.embedded && !rstub && leaving[w]) w = i % o.scale_down_to;
      double route_ms = 0;  // real: the router's cost, as measured
      if (cluster.embedded) {
        // The router in this process: the decision, no round trip.
        const auto asked = Clock::now();
        auto route = cluster.embedded->Route(kvtier::router::FromWire(rr));
        if (route.ok() && by_endpoint.count(route->endpoint)) {
          w = by_endpoint[route->endpoint];
          if (hint && route->store_end) req.set_store_hint_blocks(*route->store_end);
        }
        route_ms = std::chrono::duration<double, std::milli>(Clock::now() - asked).count();
      } else if (rstub) {
        const auto asked = Clock::now();
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        v1::RouteResponse route;
        grpc::Status s = rstub->Route(&ctx, rr, &route);
        if (s.ok() && by_endpoint.count(route.endpoint())) {
          w = by_endpoint[route.endpoint()];
          if (hint && route.has_store_end_blocks()) {
            req.set_store_hint_blocks(route.store_end_blocks());
          }
        }
        route_ms = std::chrono::duration<double, std::milli>(Clock::now() - asked).count();
      }
      // The sim engine's clock starts at the trace's: the request reaches
      // the worker after its window wait and its routing.
      if (!torch) req.set_arrival_ms(tr.timestamp_ms + window_ms + route_ms);
      {
        std::lock_guard lk(dmu);
        ready.push_back({i, w, std::move(req), std::move(rr), window_ms, route_ms});
      }
      next = i + 1;
      work_cv.notify_one();
    }
    std::lock_guard lk(dmu);
    dispatched_all = true;
    work_cv.notify_all();
  };
  auto submit = [&](const Dispatched& d) {
    const size_t i = d.i;
    size_t w = d.w;
    const double window_ms = d.window_ms, route_ms = d.route_ms;
    const v1::SubmitRequest& req = d.req;
    v1::SubmitResponse resp;
    grpc::Status s;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      s = stubs[w]->Submit(&ctx, req, &resp);
    }
    if (!s.ok() && leaving[w]) {
      // Its worker is leaving: the next best of those that stay.
      size_t again = i % static_cast<size_t>(o.scale_down_to);
      if (cluster.embedded) {
        std::vector<std::string> exclude;
        {
          std::lock_guard lk(mu);
          exclude = leaving_ids;
        }
        kvtier::router::RouteQuery q = kvtier::router::FromWire(d.rr);
        q.exclude = exclude;
        auto route = cluster.embedded->Route(q);
        if (route.ok()) {
          if (auto it = by_endpoint.find(route->endpoint); it != by_endpoint.end()) {
            again = it->second;
          }
        }
      }
      w = again;
      resp.Clear();
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      s = stubs[w]->Submit(&ctx, req, &resp);
      std::lock_guard lk(mu);
      retried++;
    }
    std::lock_guard lk(mu);
    if (!s.ok()) {
      if (failure.ok()) {
        failure = absl::InternalError(absl::StrCat("request ", i, " on worker ", w, ": ",
                                                   s.error_message(), "; the worker's log ends:\n",
                                                   workers[w]->LogTail()));
      }
      return;
    }
    res.requests++;
    res.prompt_tokens += resp.prompt_tokens();
    res.computed += resp.prefill_tokens();
    res.gpu_hit += resp.gpu_hit_tokens();
    // Onboarded tokens split by the tier the blocks came from.
    uint64_t disk_tokens = std::min<uint64_t>(uint64_t{resp.onboarded_from_disk()} * block_tokens,
                                              resp.onboarded_tokens());
    res.store_disk += disk_tokens;
    res.store_ram += resp.onboarded_tokens() - disk_tokens;
    res.verified += resp.verified_blocks();
    res.mismatched += resp.mismatched_blocks();
    res.load_failures += !resp.load_status().empty();
    res.lookups_skipped += resp.store_lookup_skipped();
    Timed t;
    t.worker = w;
    t.prompt = resp.prompt_tokens();
    t.computed = resp.prefill_tokens();
    t.gpu_hit = resp.gpu_hit_tokens();
    t.onboarded = resp.onboarded_tokens();
    t.late_ms = resp.late_ms();
    t.part[kWindow] = window_ms;
    t.part[kRoute] = route_ms;
    t.part[kOnboard] = resp.onboard_ms();
    if (torch) {
      // Real time throughout: the engine's own TTFT, less what kvtier added.
      t.part[kOther] = std::max(0.0, resp.ttft_ms() - resp.onboard_ms());
    } else {
      t.part[kQueue] = resp.queue_ms();
      t.part[kPrefill] = resp.prefill_ms();
    }
    timed[i] = t;
    res.work[w] += resp.prefill_tokens();
    res.per_request[i] = {resp.gpu_hit_tokens(), resp.prompt_tokens()};
    res.onboard_ms += resp.onboard_ms();
    if (resp.has_onboard_breakdown()) res.onboard.Add(resp.onboard_breakdown());
    res.onboarded_bytes +=
        uint64_t{resp.verified_blocks()} * (torch ? res.wire_block_bytes : o.block_bytes);
    res.onboarded_blocks += resp.verified_blocks();
    const size_t n = ++done;
    if (o.progress && isatty(2) && (n % 20 == 0 || n == trace.size()))
      Progress(mode, n, trace.size());
  };
  auto send = [&] {
    for (;;) {
      Dispatched d;
      {
        std::unique_lock lk(dmu);
        work_cv.wait(lk, [&] { return !ready.empty() || dispatched_all; });
        if (ready.empty()) return;
        d = std::move(ready.front());
        ready.pop_front();
      }
      submit(d);
      {
        std::lock_guard lk(dmu);
        free_senders++;
      }
      sender_cv.notify_one();
    }
  };
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < o.concurrency; ++t) threads.emplace_back(send);
  threads.emplace_back(dispatch);
  start = Clock::now();
  clock_started.count_down();
  auto schedule = [&] {
    std::ofstream out;
    if (!o.per_request.empty()) out.open(o.per_request, std::ios::app);
    for (size_t i = 0; i < timed.size(); ++i) {
      const Timed& t = timed[i];
      if (t.worker < 0) continue;
      double ttft = 0;
      nlohmann::json line = {{"mode", mode},
                             {"run", o.run},
                             {"request", i},
                             {"worker", t.worker},
                             {"arrival_ms", trace[i].timestamp_ms},
                             {"prompt_tokens", t.prompt},
                             {"computed_tokens", t.computed},
                             {"gpu_hit_tokens", t.gpu_hit},
                             {"onboarded_tokens", t.onboarded},
                             {"late_ms", t.late_ms}};
      res.late_deliveries += t.late_ms > 0;
      res.late_ms_max = std::max(res.late_ms_max, t.late_ms);
      for (int p = 0; p < kParts; ++p) {
        res.parts[p].push_back(t.part[p]);
        ttft += t.part[p];
        line[std::string(kPartNames[p]) + "_ms"] = t.part[p];
      }
      res.ttft.push_back(ttft);
      line["ttft_ms"] = ttft;
      if (out.is_open()) out << line.dump() << "\n";
    }
  };
  std::vector<std::pair<double, uint64_t>> drains;
  int64_t scaled_at = -1;
  if (!scenario.empty() && o.scale_down_at > 0 &&
      static_cast<size_t>(o.scale_down_at) < trace.size()) {
    while (next < static_cast<size_t>(o.scale_down_at) && !g_interrupted) {
      {
        std::lock_guard lk(mu);
        if (!failure.ok()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    scaled_at = static_cast<int64_t>(next.load());
    const size_t from = static_cast<size_t>(o.scale_down_to);
    {
      std::lock_guard lk(mu);
      for (size_t w = from; w < workers.size(); ++w) leaving_ids.push_back(cluster.worker_ids[w]);
    }
    for (size_t w = from; w < workers.size(); ++w) leaving[w] = true;
    // As Kubernetes does: every leaving pod gets SIGTERM at once.
    const auto signalled = Clock::now();
    for (size_t w = from; w < workers.size(); ++w) workers[w]->Signal(SIGTERM);
    for (size_t w = from; w < workers.size(); ++w) {
      workers[w]->WaitExit(std::chrono::milliseconds(o.drain_timeout_ms + 15000));
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - signalled).count();
      // "... N saved (B bytes) ..." in the worker's drain line.
      uint64_t bytes = 0;
      const std::string log = workers[w]->LogTail(4000);
      if (size_t at = log.find(" saved ("); at != std::string::npos) {
        absl::SimpleAtoi(log.substr(at + 8, log.find(' ', at + 8) - at - 8), &bytes);
      }
      drains.emplace_back(ms, bytes);
    }
  }
  if (router && o.restart_router_at > 0 &&
      static_cast<size_t>(o.restart_router_at) < trace.size()) {
    // The router dies and comes back on the same port mid-replay; workers
    // reconnect by themselves and answer its snapshot requests.
    while (done < static_cast<size_t>(o.restart_router_at) && !g_interrupted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    res.restarted_at = static_cast<int64_t>(next.load());
    if (o.restart_control) {
      // Control run: the same windows, no restart.
    } else if (auto s = router->Restart(); !s.ok()) {
      std::lock_guard lk(mu);
      failure = s;
    }
  }
  for (auto& t : threads) t.join();
  res.seconds = Seconds(start);
  schedule();
  if (o.scale_down_at > 0) {
    ScaleFigures f;
    f.scaled = scaled_at >= 0;
    f.at = f.scaled ? scaled_at : o.scale_down_at;
    uint64_t computed = 0, prompt = 0;
    std::vector<double> ttft;
    for (size_t i = static_cast<size_t>(f.at); i < timed.size(); ++i) {
      const Timed& t = timed[i];
      if (t.worker < 0) continue;
      computed += t.computed;
      prompt += t.prompt;
      double sum = 0;
      for (double part : t.part) sum += part;
      ttft.push_back(sum);
    }
    f.computed_pct = prompt ? 100.0 * static_cast<double>(computed) / prompt : 0;
    f.ttft_mean_ms = Mean(ttft);
    f.ttft_p99_ms = Percentile(ttft, 0.99);
    f.retried = retried;
    f.drains = drains;
    res.scale = {f};
  }
  if (!failure.ok()) return failure;
  if (g_interrupted) return absl::CancelledError("interrupted");
  ReadCounters(cluster, &res);
  return res;
}

}  // namespace

int RunReplay(int argc, const char* const* argv) {
  Options o;
  FlagSet flags("kvtier-bench replay",
                "The main job: a kvtier cluster on loopback (store, router, simulated workers)\n"
                "replaying a Mooncake trace in several routing/caching modes, each on a fresh\n"
                "cluster, with every onboarded byte verified. Prints a comparison table.");
  flags.String("trace", &o.trace, "Trace file (Mooncake JSONL format)");
  flags.Int("limit", &o.limit, 0, 1 << 30, "Replay only the first N requests (0: all)");
  flags.Double("speed", &o.speed, 0, 1e6,
               "Replay at trace time / speed; workers sleep simulated prefill time / speed "
               "(0: as fast as the cluster serves, no sleeping)");
  flags.Int("workers", &o.workers, 1, 64, "Simulated workers");
  flags.Int("pages", &o.pages, 16, 1 << 22, "GPU pages per worker (blocks of 512 tokens)");
  flags.Bytes("block-bytes", &o.block_bytes, "KV bytes per 512-token block (multiple of 2KiB)");
  flags.Bytes("ram-bytes", &o.ram_bytes, "Store RAM tier");
  flags.Bytes("disk-bytes", &o.disk_bytes, "Store NVMe tier quota");
  flags.Int("concurrency", &o.concurrency, 1, 256, "Requests in flight");
  flags.Double("prefill-tokens-per-s", &o.prefill_tps, 1, 1e9, "Simulated prefill speed");
  flags.Double("fetch-cost", &o.fetch_cost, 0, 10, "Router: fetch cost per token");
  flags.Double("load-weight", &o.load_weight, 0, 1000, "Router: cost per queued token");
  flags.Double("occupancy-weight", &o.occupancy_weight, 0, 1000,
               "Router: cost in fetches per token placed in new pages of a full worker");
  flags.DurationMs("reorder-window", &o.reorder_window_ms,
                   "Simulated workers: how long a request waits (real time) for requests before "
                   "it in simulated time to reach the engine");
  flags.Int("balance-threshold-tokens", &o.balance, 0, int64_t{1} << 40, "Router: balance guard");
  flags.String("modes", &o.modes,
               "Modes to run, comma-separated; MODE@down and MODE@drain scale MODE's cluster "
               "down mid-replay (--scale-down-at)");
  flags.Int("restart-router-at", &o.restart_router_at, 0, 1 << 30,
            "Kill -9 the router after this many requests and restart it (KV-aware modes); "
            "reports the GPU-hit ratio of the 1,000 requests before and after");
  flags.Choice("router", &o.router, {"frontend", "process"},
               "KV-aware modes route in this process (a router in the frontend, as Dynamo's "
               "KV router runs: no round trip per request) or through a kvtier-router process "
               "over gRPC");
  flags.Choice("kvtier-offload", &o.kvtier_offload, {"write-through", "write-back"},
               "The kvtier mode's offload: every computed block as it is computed, or a "
               "block when the GPU pages evict it (round-robin+store writes through)");
  flags.Bool("store-hint", &o.store_hint,
             "The kvtier mode's workers skip a store lookup when the router knows the store "
             "holds nothing past their GPU pages (false: they always look up)");
  flags.Int("scale-down-at", &o.scale_down_at, 0, 1 << 30,
            "Scale down after this many requests were dispatched, in the modes named "
            "MODE@down (the leaving workers stop at once, as pods go today) and MODE@drain "
            "(they drain first); every mode reports its requests from here on");
  flags.Int("scale-down-to", &o.scale_down_to, 0, 64,
            "With --scale-down-at: the workers that stay (the others get SIGTERM)");
  flags.DurationMs("drain-timeout", &o.drain_timeout_ms,
                   "MODE@drain: each leaving worker's drain budget (kvtier-sim-worker "
                   "--drain-timeout)");
  flags.Bool("restart-control", &o.restart_control,
             "With --restart-router-at: measure the same windows without restarting (control)");
  std::string kv_wire = "none";
  flags.Choice("kv-wire", &kv_wire, {"none", "int8"},
               "Block encoding in the store and on the wire: the dtype's bytes, or int8 (half "
               "the bytes; lossy: workers verify against the model's packed-then-unpacked KV)");
  flags.Choice("engine", &o.engine, {"sim", "torch"},
               "Workers: kvtier-sim-worker (simulated prefill) or kvtier-torch-engine (the "
               "PyTorch reference engine: real forward passes, real KV; build/python)");
  flags.Int("trace-block-tokens", &o.trace_block_tokens, 1, 512,
            "Torch engine: real tokens per 512-token trace block (prompts scaled to fit a CPU)");
  flags.Int("torch-max-step-tokens", &o.torch_max_step_tokens, 16, 1 << 20,
            "Torch engine: prefill + decode tokens per forward step");
  flags.String("plot", &o.plot, "Write an SVG chart of the comparison to this file");
  flags.String("per-request", &o.per_request,
               "Append every request's TTFT and its parts to this file, one JSON object per line "
               "per mode (mode, run, request, worker, arrival_ms, window_ms, route_ms, onboard_ms, "
               "queue_ms, prefill_ms, other_ms, ttft_ms, token counts)");
  flags.Int("repeat", &o.repeat, 1, 100,
            "Run every mode this many times, each on a fresh cluster, the modes interleaved "
            "(run r starts at mode r mod modes); TTFT and counts pool every run's requests, and "
            "each run's mean and p99 are listed (a p99 within host noise of another mode's "
            "reads off the pooled figure, not one run)");
  flags.Bool("json", &o.json, "Print JSON");
  flags.Bool("progress", &o.progress, "Progress bars on stderr");
  ParseFlagsOrExit(flags, argc, argv);
  o.kv_wire = kv_wire == "none" ? "" : kv_wire;
  if (o.restart_router_at > 0 && o.repeat > 1) {
    std::fprintf(stderr,
                 "kvtier-bench replay: flag --repeat: a router restart's windows are one run's; "
                 "use --repeat=1 with --restart-router-at\n");
    return 2;
  }
  if (o.restart_router_at > 0 && o.router != "process") {
    std::fprintf(stderr,
                 "kvtier-bench replay: flag --restart-router-at kills the kvtier-router "
                 "process: add --router=process\n");
    return 2;
  }
  SetLogQuiet(true);
  if (o.block_bytes % 2048 != 0 || o.block_bytes / 2048 == 0 || o.block_bytes / 2048 > 4096) {
    std::fprintf(stderr,
                 "kvtier-bench replay: flag --block-bytes: %s is not a multiple of 2KiB "
                 "between 2KiB and 8MiB\n",
                 FormatBytes(o.block_bytes).c_str());
    return 2;
  }
  std::vector<std::string> modes;
  for (absl::string_view m : absl::StrSplit(o.modes, ',', absl::SkipEmpty())) {
    const absl::string_view base = m.substr(0, m.find('@'));
    const absl::string_view scenario =
        m.find('@') == absl::string_view::npos ? "" : m.substr(m.find('@') + 1);
    if ((base != "round-robin" && base != "round-robin+store" && base != "kv-aware" &&
         base != "kvtier") ||
        (scenario != "" && scenario != "down" && scenario != "drain")) {
      std::fprintf(stderr,
                   "kvtier-bench replay: flag --modes: unknown mode \"%s\" (round-robin, "
                   "round-robin+store, kv-aware or kvtier, each optionally @down or @drain)\n",
                   std::string(m).c_str());
      return 2;
    }
    if (!scenario.empty() && (o.scale_down_at == 0 || o.scale_down_to == 0 ||
                              o.scale_down_to >= o.workers || o.engine != "sim")) {
      std::fprintf(stderr,
                   "kvtier-bench replay: flag --modes: %s scales down: give --scale-down-at > 0 "
                   "and --scale-down-to between 1 and --workers - 1 (sim engine only)\n",
                   std::string(m).c_str());
      return 2;
    }
    modes.emplace_back(m);
  }
  auto trace = ReadTrace(o.trace, static_cast<size_t>(o.limit));
  if (!trace.ok()) {
    std::fprintf(stderr, "kvtier-bench replay: %s\n",
                 std::string(trace.status().message()).c_str());
    return 1;
  }
  // Ctrl-C: stop dispatching, let destructors stop every process and remove
  // the scratch directory, then exit 130.
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);

  TempDir dir;
  std::vector<ModeResult> results;
  if (!o.json) {
    std::fprintf(stderr,
                 "kvtier replay: %zu requests, %ld workers x %ld pages, %s per 512-token block\n",
                 trace->size(), o.workers, o.pages, FormatBytes(o.block_bytes).c_str());
  }
  results.resize(modes.size());  // in the order asked for, whichever mode a run starts with
  const size_t runs = static_cast<size_t>(o.repeat);
  for (size_t k = 0; k < runs * modes.size(); ++k) {
    const size_t run = k / modes.size();
    const size_t i = (k + run) % modes.size();
    const std::string& m = modes[i];
    // Progress, one line as each mode starts and ends (a mode takes tens of
    // seconds): on stderr, so --json's stdout stays one document.
    std::fprintf(stderr, "kvtier replay: mode %zu/%zu %s%s: starting a fresh cluster\n", i + 1,
                 modes.size(), m.c_str(),
                 runs > 1 ? absl::StrCat(" (run ", run + 1, "/", runs, ")").c_str() : "");
    Options run_o = o;
    run_o.run = static_cast<int64_t>(run);
    auto r = RunMode(run_o, m, *trace, dir);
    if (r.ok()) {
      std::fprintf(stderr,
                   "kvtier replay: mode %zu/%zu %s: done in %.0f s (%.2f%% of prompt tokens "
                   "computed, TTFT mean %.0f ms)\n",
                   i + 1, modes.size(), m.c_str(), r->seconds,
                   100.0 * r->computed / std::max<uint64_t>(r->prompt_tokens, 1), r->TtftMean());
    }
    if (!r.ok()) {
      if (g_interrupted) {
        std::fprintf(stderr, "\nkvtier-bench replay: interrupted; cluster stopped\n");
        return 130;
      }
      std::fprintf(stderr, "\nkvtier-bench replay: mode %s: %s\n", m.c_str(),
                   std::string(r.status().message()).c_str());
      return 1;
    }
    r->runs = {RunFigures{r->TtftMean(), r->TtftP99(), r->late_deliveries}};
    if (results[i].runs.empty()) {
      results[i] = std::move(*r);
    } else {
      results[i].Pool(*r);
    }
  }
  PrefixCacheFigures oracle = SharedPrefixCache(*trace, 0);
  uint64_t verified = 0, mismatched = 0;
  for (const auto& r : results) {
    verified += r.verified;
    mismatched += r.mismatched;
  }
  if (!o.plot.empty()) WritePlot(o.plot, results, oracle.token_hit_ratio());
  if (o.json) {
    nlohmann::json j;
    for (const auto& r : results) j["modes"][r.name] = ToJson(r);
    j["modes"]["oracle"] = {{"computed_fraction", 1 - oracle.token_hit_ratio()},
                            {"block_hit_ratio", oracle.block_hit_ratio()},
                            {"token_hit_ratio", oracle.token_hit_ratio()}};
    j["requests"] = trace->size();
    j["verified_blocks"] = verified;
    j["mismatched_blocks"] = mismatched;
    std::printf("%s\n", j.dump(2).c_str());
    return mismatched == 0 ? 0 : 1;
  }
  ReportHeader h;
  h.requests = trace->size();
  h.trace_name = o.trace.substr(o.trace.rfind('/') + 1);
  h.workers = o.workers;
  h.pages = o.pages;
  h.block_bytes = o.block_bytes;
  h.real_clock = o.engine == "torch";
  h.packed = !o.kv_wire.empty();
  h.restart_control = o.restart_control;
  PrintReport(h, results, oracle.token_hit_ratio(), verified, mismatched);
  if (!o.plot.empty()) std::printf("chart: %s\n", o.plot.c_str());
  return mismatched == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
