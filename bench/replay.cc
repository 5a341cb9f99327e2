// kvtier-bench replay: the main job. Starts a whole kvtier cluster on
// loopback -- one kvtier-store (RAM + RocksDB NVMe tier), one kvtier-router,
// N kvtier-sim-workers with small GPU page pools -- and replays a Mooncake
// trace through it in several modes, each on a fresh cluster:
//   round-robin        round-robin routing, no store (per-engine prefix caching)
//   round-robin+store  round-robin routing, workers onboard/offload via the store
//   kv-aware           kvtier-router's cost-based routing, no store
//   kvtier             kvtier-router + the store
//   oracle             an infinite cache shared by all engines, from the trace
// Every onboarded block is verified byte for byte by the workers.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/trace.h"
#include "client/store_client.h"
#include "common/config.h"
#include "common/log.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "kvtier/v1/worker.grpc.pb.h"

namespace kvtier::bench {
namespace {

std::atomic<bool> g_interrupted{false};
void OnSignal(int) { g_interrupted = true; }

struct Options {
  std::string trace = KVTIER_SOURCE_DIR "/bench/traces/conversation_trace.jsonl";
  int64_t limit = 2000;
  double speed = 20;  // trace time / speed; 0: as fast as the cluster serves
  int64_t workers = 4;
  int64_t pages = 1024;
  uint64_t block_bytes = 64 << 10;
  uint64_t ram_bytes = 2ull << 30;
  uint64_t disk_bytes = 16ull << 30;
  int64_t concurrency = 256;
  double prefill_tps = 50000;
  double fetch_cost = 0.1, load_weight = 1.0;
  int64_t balance = 32768;
  std::string modes = "round-robin,round-robin+store,kv-aware,kvtier";
  std::string plot;
  std::string per_request;  // --per-request: JSONL of every request's parts, per mode
  bool json = false, progress = true;
  int64_t restart_router_at = 0;  // kill -9 and restart the router after this many requests
  bool restart_control = false;   // measure the same windows without restarting
  std::string bin_dir;
  std::string kv_wire;              // "" or "int8" (--kv-wire)
  std::string engine = "sim";       // "sim" (kvtier-sim-worker) or "torch" (kvtier-torch-engine)
  int64_t trace_block_tokens = 32;  // torch: real tokens per 512-token trace block
  int64_t torch_max_step_tokens = 512;
};

// The torch engine's geometry (kvtier.engine defaults: 2 layers, 2 KV heads
// of 32, fp16) with vLLM's 16-token pages, and its vocabulary.
constexpr uint32_t kTorchBlockTokens = 16;
constexpr uint32_t kTorchVocab = 4096;
NamespaceSpec TorchGeometry() {
  return NamespaceSpec{"kvtier-reference", "fp16", 2, 2, 32, kTorchBlockTokens, 0, 1, "", "", ""};
}

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

// The parts of a request's TTFT, in the replay's clock: simulated
// milliseconds for the sim engine (real costs of the tier enter as
// measured), real ones for the torch engine.
//   window   waiting for a free slot in the client's window (--concurrency)
//   route    the router's answer (KV-aware modes)
//   onboard  the store lookup and the load of its blocks
//   queue    the sim engine: waiting for it, behind other requests
//   prefill  the sim engine: computing the prompt's uncached tokens
//   other    the torch engine: everything else (its own queue and compute,
//            real; it does not tell them apart)
enum Part { kWindow, kRoute, kOnboard, kQueue, kPrefill, kOther, kParts };
constexpr const char* kPartNames[kParts] = {"window", "route",   "onboard",
                                            "queue",  "prefill", "other"};

// One request's TTFT parts, and where it ran.
struct Timed {
  int64_t worker = -1;  // -1: not served
  std::array<double, kParts> part{};
  uint64_t prompt = 0, computed = 0, gpu_hit = 0, onboarded = 0;
};

// Milliseconds per step, summed (the SubmitResponse / worker stats breakdown).
struct Breakdown {
  double control = 0, queue = 0, rma = 0, checksum = 0, staging = 0, scatter = 0, gather = 0;
  uint64_t count = 0;                // operations (loads) added
  std::vector<double> control_each;  // per load, for the median
  void Add(const v1::TimeBreakdown& b) {
    ++count;
    control_each.push_back(b.control_ms());
    control += b.control_ms();
    queue += b.queue_ms();
    rma += b.rma_ms();
    checksum += b.checksum_ms();
    staging += b.staging_ms();
    scatter += b.scatter_ms();
    gather += b.gather_ms();
  }
  nlohmann::json Json() const {
    return {{"control_ms", control},   {"lane_wait_ms", queue},      {"rma_ms", rma},
            {"checksum_ms", checksum}, {"staging_wait_ms", staging}, {"scatter_ms", scatter},
            {"gather_ms", gather}};
  }
};

struct ModeResult {
  std::string name;
  uint64_t requests = 0, prompt_tokens = 0, computed = 0, gpu_hit = 0, store_ram = 0,
           store_disk = 0, verified = 0, mismatched = 0, load_failures = 0, offloaded_blocks = 0;
  std::vector<double> ttft;
  // Where each request's TTFT went, in the replay's clock (see Part).
  std::array<std::vector<double>, kParts> parts;
  std::vector<uint64_t> work;  // prefill tokens per worker
  std::vector<std::pair<uint64_t, uint64_t>>
      per_request;  // (gpu hit tokens, prompt tokens) by index
  int64_t restarted_at = -1;
  double seconds = 0, onboard_ms = 0;
  uint64_t onboarded_bytes = 0;  // KV bytes delivered into pages
  uint64_t onboarded_blocks = 0;
  uint64_t wire_block_bytes = 0;  // bytes a block takes in the store and on the wire
  Breakdown onboard, offload;
  double store_pin_handler_ms = 0;  // the store's own time in BeginGet, mean per call
  // The offload path, from the workers' stats.
  uint64_t offload_batches = 0, offload_round_trips = 0, offloaded_bytes = 0, computed_blocks = 0,
           offload_dropped = 0;
  // The store's count of put calls: reservations, and commits over gRPC (a
  // round trip of their own, after a flush) or behind the bytes on the data
  // plane (none of their own).
  uint64_t store_begin_puts = 0, store_grpc_commits = 0, store_pipelined_commits = 0;
  // Waits on the store per block written, counted by the store: a
  // reservation's, and for a gRPC commit the flush's and the commit's; a
  // pipelined commit's is the bytes' own.
  double StoreWaitsPerOffloadedBlock() const {
    return offloaded_blocks
               ? double(store_begin_puts + 2 * store_grpc_commits + store_pipelined_commits) /
                     offloaded_blocks
               : 0;
  }
  double RoundTripsPerOffloadedBlock() const {
    return offloaded_blocks ? double(offload_round_trips) / offloaded_blocks : 0;
  }
  double BytesPerComputedBlock() const {
    return computed_blocks ? double(offloaded_bytes) / computed_blocks : 0;
  }
  uint64_t BytesMoved() const { return (onboarded_blocks + offloaded_blocks) * wire_block_bytes; }
  double Frac(uint64_t x) const { return prompt_tokens ? double(x) / prompt_tokens : 0; }
  double TtftMean() const {
    double s = 0;
    for (double t : ttft) s += t;
    return ttft.empty() ? 0 : s / ttft.size();
  }
  double TtftP99() const { return Percentile(ttft, 0.99); }
  double Balance() const {
    if (work.empty()) return 0;
    double sum = 0, mx = 0;
    for (auto w : work) {
      sum += w;
      mx = std::max<double>(mx, w);
    }
    return sum > 0 ? mx / (sum / work.size()) : 1.0;
  }
};

void Progress(const std::string& mode, size_t done, size_t total) {
  int width = 30;
  int filled = static_cast<int>(width * done / std::max<size_t>(total, 1));
  std::fprintf(stderr, "\r  %-18s [%s%s] %zu/%zu", mode.c_str(), std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
}

absl::StatusOr<ModeResult> RunMode(const Options& o, const std::string& mode,
                                   const std::vector<TraceRequest>& trace, const TempDir& dir) {
  const bool with_store = mode == "round-robin+store" || mode == "kvtier";
  const bool kv_aware = mode == "kv-aware" || mode == "kvtier";
  const std::string scratch = dir.sub(mode);
  std::unique_ptr<LocalServer> store, router;
  std::string tag = mode == "round-robin+store" ? "rr-store" : mode;
  if (kv_aware) {
    auto r =
        LocalServer::Start(DefaultBinary("router", "kvtier-router"), scratch + "-router",
                           {"--heartbeat-deadline=3s", absl::StrCat("--fetch-cost=", o.fetch_cost),
                            absl::StrCat("--load-weight=", o.load_weight),
                            absl::StrCat("--balance-threshold-tokens=", o.balance)});
    if (!r.ok()) return r.status();
    router = std::move(*r);
  }
  if (with_store) {
    std::vector<std::string> flags = {"--data-dir=" + scratch + "-db",
                                      absl::StrCat("--ram-bytes=", o.ram_bytes),
                                      absl::StrCat("--disk-bytes=", o.disk_bytes),
                                      "--data-listen=127.0.0.1:0",
                                      "--hugepages=false",
                                      absl::StrCat("--demote-queue-bytes=", 256 << 20)};
    // The store tells the router what it holds: a store hit is one every
    // worker can have, so the router need not send a prefix to its holder.
    if (router) flags.push_back("--router=" + router->address());
    auto s =
        LocalServer::Start(DefaultBinary("cachestore", "kvtier-store"), scratch + "-store", flags);
    if (!s.ok()) return s.status();
    store = std::move(*s);
  }
  // Sim: 512-token blocks of fp16, 1 layer, 1 head: head_dim sets the bytes.
  // Torch: the reference engine's own geometry, real forward passes.
  const bool torch = o.engine == "torch";
  const uint64_t head_dim = o.block_bytes / 2048;
  const uint32_t block_tokens = torch ? kTorchBlockTokens : 512;
  std::vector<std::unique_ptr<LocalServer>> workers;
  std::vector<std::unique_ptr<v1::SimWorker::Stub>> stubs;
  std::map<std::string, size_t> by_endpoint;
  for (int64_t w = 0; w < o.workers; ++w) {
    std::vector<std::string> flags;
    if (torch) {
      flags = {absl::StrCat("--worker-id=", tag, "-w", w),
               absl::StrCat("--page-tokens=", kTorchBlockTokens),
               absl::StrCat("--vocab-size=", kTorchVocab),
               absl::StrCat("--pages=", o.pages),
               absl::StrCat("--max-step-tokens=", o.torch_max_step_tokens),
               "--heartbeat-ms=100",
               "--max-decode-tokens=1",
               "--threads=1"};
    } else {
      flags = {absl::StrCat("--worker-id=", tag, "-w", w), "--model=mooncake-trace", "--dtype=fp16",
               "--layers=1", "--kv-heads=1", absl::StrCat("--head-dim=", head_dim),
               "--block-tokens=512", absl::StrCat("--pages=", o.pages),
               absl::StrCat("--prefill-tokens-per-s=", o.prefill_tps),
               // Load reaches the router often next to the compressed trace.
               absl::StrCat("--heartbeat=", o.speed > 20 ? 5 : 20, "ms"),
               absl::StrCat("--staging-blocks=", 256),
               // Engines sleep their simulated prefill time compressed like the trace.
               absl::StrCat("--time-scale=", o.speed > 0 ? 1.0 / o.speed : 0.0),
               with_store ? "--offload=write-through" : "--offload=none",
               absl::StrCat("--kv-wire=", o.kv_wire.empty() ? "none" : o.kv_wire)};
    }
    if (store) flags.push_back("--store=" + store->address());
    if (router) flags.push_back("--router=" + router->address());
    auto s = LocalServer::Start(torch ? DefaultBinary("python", "kvtier-torch-engine")
                                      : DefaultBinary("worker", "kvtier-sim-worker"),
                                absl::StrCat(scratch, "-w", w), flags);
    if (!s.ok()) return s.status();
    by_endpoint[(*s)->address()] = workers.size();
    stubs.push_back(v1::SimWorker::NewStub(
        grpc::CreateChannel((*s)->address(), grpc::InsecureChannelCredentials())));
    workers.push_back(std::move(*s));
  }
  const NamespaceSpec spec =
      torch ? TorchGeometry()
            : NamespaceSpec{
                  "mooncake-trace", "fp16", 1, 1, static_cast<uint32_t>(head_dim), 512, 0, 1, "",
                  o.kv_wire,        ""};
  uint64_t ns = NamespaceId(spec);
  std::unique_ptr<v1::Router::Stub> rstub;
  if (router) {
    rstub = v1::Router::NewStub(
        grpc::CreateChannel(router->address(), grpc::InsecureChannelCredentials()));
    // Wait until every worker has registered with the router.
    for (int i = 0; i < 300; ++i) {
      if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      grpc::ClientContext ctx;
      v1::ListWorkersResponse lw;
      if (!rstub->ListWorkers(&ctx, {}, &lw).ok()) continue;
      int64_t ready = 0;
      for (const auto& src : lw.sources()) {
        if (src.kind() != v1::SOURCE_WORKER) continue;
        ++ready;
        // The torch engine names its namespace after its model: route in it.
        if (torch) ns = src.namespace_id();
      }
      if (ready == o.workers) break;
    }
  }

  // Warm-up: one request of a prompt no trace request shares on each
  // worker, so connections to the store and the first allocations are made
  // before the clock starts, as a deployment warms up before taking load.
  // Its simulated time lies far before the trace's.
  for (size_t w = 0; w < stubs.size(); ++w) {
    v1::SubmitRequest req;
    req.set_request_id((uint64_t{1} << 62) + w);
    req.set_output_tokens(1);
    if (torch) {
      for (uint32_t t = 0; t < 2 * kTorchBlockTokens; ++t) {
        req.mutable_tokens()->add_ids((t * 7 + w * 13 + 1) % kTorchVocab);
      }
    } else {
      req.set_arrival_ms(-1e9);
      BlockHash h = TraceHash(ns, (uint64_t{1} << 60) + w);
      auto* p = req.mutable_hashes()->add_hashes();
      p->set_hi(h.hi);
      p->set_lo(h.lo);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::SubmitResponse resp;
    if (grpc::Status s = stubs[w]->Submit(&ctx, req, &resp); !s.ok()) {
      return absl::InternalError(absl::StrCat("warm-up request on worker ", w, ": ",
                                              s.error_message(), "; the worker's log ends:\n",
                                              workers[w]->LogTail()));
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));

  ModeResult res;
  res.name = mode;
  res.wire_block_bytes = BlockBytes(spec);
  res.work.assign(o.workers, 0);
  res.per_request.assign(trace.size(), {0, 0});
  std::mutex mu;
  std::vector<Timed> timed(trace.size());
  std::atomic<size_t> next{0}, done{0};
  absl::Status failure = absl::OkStatus();
  const auto start = Clock::now();
  auto run = [&] {
    for (;;) {
      size_t i = next++;
      if (i >= trace.size() || g_interrupted) return;
      {
        std::lock_guard lk(mu);
        if (!failure.ok()) return;
      }
      const TraceRequest& tr = trace[i];
      // A request is due at its trace time / speed. One picked after that
      // waited for the client's window (every slot busy): that wait is part
      // of its TTFT. One picked early sleeps until due; how late the sleep
      // wakes is host noise, not the request's.
      double window_ms = 0;
      if (o.speed > 0) {
        auto due = start + std::chrono::microseconds(
                               static_cast<int64_t>(tr.timestamp_ms * 1000.0 / o.speed));
        const auto picked = Clock::now();
        if (picked > due) {
          window_ms = std::chrono::duration<double, std::milli>(picked - due).count() *
                      (torch ? 1.0 : o.speed);
        } else {
          std::this_thread::sleep_until(due);
        }
      }
      v1::SubmitRequest req;
      req.set_request_id(i + 1);
      req.set_prompt_tokens(tr.input_length);
      req.set_output_tokens(tr.output_length);
      v1::RouteRequest rr;
      rr.set_namespace_id(ns);
      rr.set_prompt_tokens(tr.input_length);
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
      double route_ms = 0;  // real: the router's cost, as measured
      if (rstub) {
        const auto asked = Clock::now();
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        v1::RouteResponse route;
        grpc::Status s = rstub->Route(&ctx, rr, &route);
        if (s.ok() && by_endpoint.count(route.endpoint())) w = by_endpoint[route.endpoint()];
        route_ms = std::chrono::duration<double, std::milli>(Clock::now() - asked).count();
      }
      // The sim engine's clock starts at the trace's: the request reaches
      // the worker after its window wait and its routing.
      if (!torch) req.set_arrival_ms(tr.timestamp_ms + window_ms + route_ms);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      v1::SubmitResponse resp;
      grpc::Status s = stubs[w]->Submit(&ctx, req, &resp);
      std::lock_guard lk(mu);
      if (!s.ok()) {
        if (failure.ok()) {
          failure = absl::InternalError(
              absl::StrCat("request ", i, " on worker ", w, ": ", s.error_message(),
                           "; the worker's log ends:\n", workers[w]->LogTail()));
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
      Timed t;
      t.worker = w;
      t.prompt = resp.prompt_tokens();
      t.computed = resp.prefill_tokens();
      t.gpu_hit = resp.gpu_hit_tokens();
      t.onboarded = resp.onboarded_tokens();
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
      size_t d = ++done;
      if (o.progress && isatty(2) && (d % 20 == 0 || d == trace.size()))
        Progress(mode, d, trace.size());
    }
  };
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < o.concurrency; ++t) threads.emplace_back(run);
  auto schedule = [&] {
    std::ofstream out;
    if (!o.per_request.empty()) out.open(o.per_request, std::ios::app);
    for (size_t i = 0; i < timed.size(); ++i) {
      const Timed& t = timed[i];
      if (t.worker < 0) continue;
      double ttft = 0;
      nlohmann::json line = {{"mode", mode},
                             {"request", i},
                             {"worker", t.worker},
                             {"arrival_ms", trace[i].timestamp_ms},
                             {"prompt_tokens", t.prompt},
                             {"computed_tokens", t.computed},
                             {"gpu_hit_tokens", t.gpu_hit},
                             {"onboarded_tokens", t.onboarded}};
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
  if (!failure.ok()) return failure;
  if (g_interrupted) return absl::CancelledError("interrupted");
  if (store) {
    // How much of a pin is the store's own work (the rest is the round trip).
    StoreClient control(store->address());
    if (auto st = control.GetStats(); st.ok()) {
      // Pins come over gRPC (BeginGet) or on the data plane (DataPlaneBeginGet).
      uint64_t calls = 0, us = 0;
      for (const auto& h : st->rpc_latency()) {
        if (h.rpc() == "BeginGet" || h.rpc() == "DataPlaneBeginGet") {
          calls += h.count();
          us += h.sum_us();
        }
        if (h.rpc() == "BeginPut" || h.rpc() == "DataPlaneBeginPut")
          res.store_begin_puts += h.count();
        if (h.rpc() == "CommitPut") res.store_grpc_commits += h.count();
        if (h.rpc() == "DataPlaneCommitPut") res.store_pipelined_commits += h.count();
      }
      if (calls > 0) res.store_pin_handler_ms = static_cast<double>(us) / calls / 1000;
    }
  }
  for (auto& s : stubs) {
    grpc::ClientContext ctx;
    v1::GetWorkerStatsResponse st;
    if (s->GetWorkerStats(&ctx, {}, &st).ok()) {
      res.offloaded_blocks += st.offloaded_blocks();
      res.offload.Add(st.offload_breakdown());
      res.offload_batches += st.offload_batches();
      res.offload_round_trips += st.offload_round_trips();
      res.offloaded_bytes += st.offloaded_bytes();
      res.computed_blocks += st.computed_blocks();
      res.offload_dropped += st.offload_dropped();
    }
  }
  return res;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

nlohmann::json PartsJson(const ModeResult& r) {
  nlohmann::json j;
  for (int p = 0; p < kParts; ++p) {
    j[kPartNames[p]] = {{"mean_ms", Mean(r.parts[p])}, {"p99_ms", Percentile(r.parts[p], 0.99)}};
  }
  // The same parts over the slowest 1% of requests (by TTFT): what their
  // time went to.
  std::vector<size_t> order(r.ttft.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return r.ttft[a] > r.ttft[b]; });
  const size_t tail = std::max<size_t>(1, order.size() / 100);
  for (int p = 0; p < kParts && !order.empty(); ++p) {
    double s = 0;
    for (size_t k = 0; k < tail && k < order.size(); ++k) s += r.parts[p][order[k]];
    j[kPartNames[p]]["slowest_1pct_mean_ms"] = s / std::min(tail, order.size());
  }
  return j;
}

nlohmann::json ToJson(const ModeResult& r) {
  return {
      {"requests", r.requests},
      {"prompt_tokens", r.prompt_tokens},
      {"computed_fraction", r.Frac(r.computed)},
      {"gpu_hit_fraction", r.Frac(r.gpu_hit)},
      {"store_ram_fraction", r.Frac(r.store_ram)},
      {"store_disk_fraction", r.Frac(r.store_disk)},
      {"ttft_mean_ms", r.TtftMean()},
      {"ttft_p99_ms", r.TtftP99()},
      {"load_balance_max_over_mean", r.Balance()},
      {"verified_blocks", r.verified},
      {"mismatched_blocks", r.mismatched},
      {"load_fallbacks", r.load_failures},
      {"bytes_moved", r.BytesMoved()},
      {"wire_block_bytes", r.wire_block_bytes},
      {"onboard_gb_per_s", r.onboard_ms > 0 ? r.onboarded_bytes / (r.onboard_ms / 1000) / 1e9 : 0},
      {"onboard_ms", r.onboard_ms},
      {"onboard_load_only_gb_per_s",
       r.onboard_ms > r.onboard.control
           ? r.onboarded_bytes / ((r.onboard_ms - r.onboard.control) / 1000) / 1e9
           : 0},
      {"onboard_breakdown", r.onboard.Json()},
      {"offload_breakdown", r.offload.Json()},
      {"ttft_parts", PartsJson(r)},
      {"offload",
       {{"batches", r.offload_batches},
        {"round_trips", r.offload_round_trips},
        {"offloaded_blocks", r.offloaded_blocks},
        {"offloaded_bytes", r.offloaded_bytes},
        {"computed_blocks", r.computed_blocks},
        {"dropped", r.offload_dropped},
        {"round_trips_per_offloaded_block", r.RoundTripsPerOffloadedBlock()},
        {"store_begin_puts", r.store_begin_puts},
        {"store_grpc_commits", r.store_grpc_commits},
        {"store_pipelined_commits", r.store_pipelined_commits},
        {"store_waits_per_offloaded_block", r.StoreWaitsPerOffloadedBlock()},
        {"bytes_per_computed_block", r.BytesPerComputedBlock()}}},
      {"seconds", r.seconds}};
}

void WritePlot(const std::string& path, const std::vector<ModeResult>& modes, double oracle) {
  std::ofstream svg(path);
  const int w = 720, h = 360, left = 60, bottom = 300, bar = 70;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
      << "' font-family='sans-serif' font-size='12'>\n";
  svg << "<text x='" << left << "' y='20' font-size='14'>Prompt tokens computed (lower is better); "
      << "TTFT p99 above each bar</text>\n";
  svg << "<line x1='" << left << "' y1='" << bottom << "' x2='" << w - 20 << "' y2='" << bottom
      << "' stroke='black'/>\n";
  int x = left + 20;
  auto draw = [&](const std::string& name, double frac, const std::string& note,
                  const char* color) {
    int bh = static_cast<int>(frac * 250);
    svg << "<rect x='" << x << "' y='" << bottom - bh << "' width='" << bar << "' height='" << bh
        << "' fill='" << color << "'/>\n";
    svg << absl::StrFormat("<text x='%d' y='%d'>%.1f%%</text>\n", x + 10, bottom - bh - 18,
                           100 * frac);
    svg << "<text x='" << x << "' y='" << bottom - bh - 4 << "'>" << note << "</text>\n";
    svg << "<text x='" << x << "' y='" << bottom + 16 << "'>" << name << "</text>\n";
    x += bar + 50;
  };
  for (const auto& m : modes) {
    draw(m.name, m.Frac(m.computed), absl::StrFormat("%.0f ms", m.TtftP99()),
         m.name == "kvtier" ? "#2b7a2b" : "#7a8aa0");
  }
  draw("oracle", 1 - oracle, "bound", "#c9a227");
  svg << "</svg>\n";
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
  flags.Int("balance-threshold-tokens", &o.balance, 0, int64_t{1} << 40, "Router: balance guard");
  flags.String("modes", &o.modes, "Modes to run, comma-separated");
  flags.Int("restart-router-at", &o.restart_router_at, 0, 1 << 30,
            "Kill -9 the router after this many requests and restart it (KV-aware modes); "
            "reports the GPU-hit ratio of the 1,000 requests before and after");
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
               "per mode (mode, request, worker, arrival_ms, window_ms, route_ms, onboard_ms, "
               "queue_ms, prefill_ms, other_ms, ttft_ms, token counts)");
  flags.Bool("json", &o.json, "Print JSON");
  flags.Bool("progress", &o.progress, "Progress bars on stderr");
  ParseFlagsOrExit(flags, argc, argv);
  o.kv_wire = kv_wire == "none" ? "" : kv_wire;
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
    if (m != "round-robin" && m != "round-robin+store" && m != "kv-aware" && m != "kvtier") {
      std::fprintf(stderr, "kvtier-bench replay: flag --modes: unknown mode \"%s\"\n",
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
  for (size_t i = 0; i < modes.size(); ++i) {
    const std::string& m = modes[i];
    // Progress, one line as each mode starts and ends (a mode takes tens of
    // seconds): on stderr, so --json's stdout stays one document.
    std::fprintf(stderr, "kvtier replay: mode %zu/%zu %s: starting a fresh cluster\n", i + 1,
                 modes.size(), m.c_str());
    auto r = RunMode(o, m, *trace, dir);
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
    results.push_back(std::move(*r));
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
  std::printf("\nkvtier replay of %zu requests (%s), %ld workers x %ld GPU pages, %s per block\n\n",
              trace->size(), o.trace.substr(o.trace.rfind('/') + 1).c_str(), o.workers, o.pages,
              FormatBytes(o.block_bytes).c_str());
  std::printf("%-18s %9s %8s %9s %9s %11s %11s %8s %10s\n", "mode", "computed", "GPU hit",
              "store RAM", "store NVMe", "TTFT mean", "TTFT p99", "max/mean", "moved");
  for (const auto& r : results) {
    std::printf("%-18s %8.2f%% %7.2f%% %8.2f%% %9.2f%% %9.0f ms %9.0f ms %8.2f %10s\n",
                r.name.c_str(), 100 * r.Frac(r.computed), 100 * r.Frac(r.gpu_hit),
                100 * r.Frac(r.store_ram), 100 * r.Frac(r.store_disk), r.TtftMean(), r.TtftP99(),
                r.Balance(), FormatBytes(r.BytesMoved()).c_str());
  }
  std::printf("%-18s %8.2f%%   (infinite cache shared by all engines, from the trace)\n", "oracle",
              100 * (1 - oracle.token_hit_ratio()));
  std::printf("\nonboarded blocks verified byte for byte: %lu, mismatched: %lu\n", verified,
              mismatched);
  // Where each mode's TTFT went: mean over all requests, and mean over the
  // slowest 1% (what its p99 is made of).
  std::printf("\nwhere TTFT went, ms (%s clock): mean over all requests / over the slowest 1%%\n",
              o.engine == "torch" ? "real" : "simulated");
  std::printf("%-18s", "mode");
  for (int p = 0; p < kParts; ++p) std::printf(" %15s", kPartNames[p]);
  std::printf("\n");
  for (const auto& r : results) {
    nlohmann::json j = PartsJson(r);
    std::printf("%-18s", r.name.c_str());
    for (int p = 0; p < kParts; ++p) {
      std::printf(" %7.1f /%6.0f", j[kPartNames[p]]["mean_ms"].get<double>(),
                  j[kPartNames[p]].value("slowest_1pct_mean_ms", 0.0));
    }
    std::printf("\n");
  }
  for (const auto& r : results) {
    if (r.offloaded_blocks == 0) continue;
    std::printf(
        "  %s offload: %lu blocks written; waits on the store per block written %.3f "
        "(the store's count: %lu reservations, %lu commits over gRPC, %lu behind the "
        "bytes)",
        r.name.c_str(), r.offloaded_blocks, r.StoreWaitsPerOffloadedBlock(), r.store_begin_puts,
        r.store_grpc_commits, r.store_pipelined_commits);
    if (r.computed_blocks > 0) {
      std::printf(
          "; %.2f blocks' bytes sent per block computed (%lu computed, %lu dropped "
          "from a full queue)",
          r.BytesPerComputedBlock() / std::max<uint64_t>(r.wire_block_bytes, 1), r.computed_blocks,
          r.offload_dropped);
    }
    std::printf("\n");
  }
  for (const auto& r : results) {
    if (r.onboard_ms > 0) {
      const Breakdown& b = r.onboard;
      // The pin is the request's matching step too (the store's answer to
      // "how much do you hold?", a Lookup before this path existed): shown
      // with and without it.
      const double load_only_ms = r.onboard_ms - b.control;
      std::printf(
          "  %s: %s onboarded at %.2f GB/s of time inside onboarding with the pin, "
          "%.2f GB/s without it (StartLoad to WaitForLoad)\n",
          r.name.c_str(), FormatBytes(r.onboarded_bytes).c_str(),
          r.onboarded_bytes / (r.onboard_ms / 1000) / 1e9,
          load_only_ms > 0 ? r.onboarded_bytes / (load_only_ms / 1000) / 1e9 : 0.0);

      std::printf(
          "    onboarding %.0f ms in %lu loads (pin p50 %.2f ms, of which the store's "
          "handler %.3f ms mean): pin %.0f, lane "
          "wait %.0f, staging wait %.0f, RMA %.0f, checksum %.0f, unpack %.0f, other "
          "(lookups that found nothing, page allocation, hand-offs, release) %.0f\n",
          r.onboard_ms, b.count, Percentile(b.control_each, 0.5), r.store_pin_handler_ms, b.control,
          b.queue, b.staging, b.rma, b.checksum, b.scatter,
          std::max(0.0, r.onboard_ms - b.control - b.queue - b.staging - b.rma - b.checksum -
                            b.scatter));
      const Breakdown& f = r.offload;
      std::printf(
          "    offloading (background): gather%s %.0f ms, lane wait %.0f, BeginPut+CommitPut "
          "%.0f, RMA %.0f\n",
          o.kv_wire.empty() ? "" : "+pack", f.gather, f.queue, f.control, f.rma);
    }
  }
  for (const auto& r : results) {
    if (r.restarted_at < 0) continue;
    auto ratio = [&](int64_t from, int64_t to) {
      uint64_t hit = 0, all = 0;
      for (int64_t i = std::max<int64_t>(0, from); i < std::min<int64_t>(to, r.per_request.size());
           ++i) {
        hit += r.per_request[i].first;
        all += r.per_request[i].second;
      }
      return all ? 100.0 * hit / all : 0.0;
    };
    std::printf(
        "  %s: %s at request %ld; GPU-hit ratio of the 1,000 requests before %.2f%%, "
        "after %.2f%%\n",
        r.name.c_str(), o.restart_control ? "no restart (control)" : "router killed and restarted",
        r.restarted_at, ratio(r.restarted_at - 1000, r.restarted_at),
        ratio(r.restarted_at, r.restarted_at + 1000));
  }
  if (!o.plot.empty()) std::printf("chart: %s\n", o.plot.c_str());
  return mismatched == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
