#include "bench/replay_cluster.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/trace.h"
#include "client/store_client.h"

namespace kvtier::bench {

namespace {
constexpr uint32_t kWarmUpBlocks = 64;

int64_t HeartbeatMs(double speed) {
  if (!(speed > 0)) return 20;
  return std::clamp<int64_t>(std::llround(100.0 / speed), 1, 20);
}
}  // namespace

absl::StatusOr<Cluster> StartCluster(const Options& o, const std::string& mode,
                                     const TempDir& dir) {
  // MODE@down / MODE@drain run MODE's cluster.
  const std::string full = mode;
  const std::string base = mode.substr(0, mode.find('@'));
  const bool with_store = base == "round-robin+store" || base == "kvtier";
  const bool kv_aware = base == "kv-aware" || base == "kvtier";
  // Each run of each mode in a directory of its own: a store's NVMe tier
  // outlives its process, and a later run must not start with an earlier
  // one's blocks on disk.
  const std::string scratch = dir.sub(absl::StrCat(full, "-run", o.run));
  Cluster c;
  std::unique_ptr<LocalServer>& store = c.store;
  std::string tag = base == "round-robin+store" ? "rr-store" : base;
  if (kv_aware && o.router == "frontend") {
    router::RouterOptions ro;
    ro.heartbeat_deadline_ms = 3000;
    ro.knobs.fetch_cost = o.fetch_cost;
    ro.knobs.load_weight = o.load_weight;
    ro.knobs.occupancy_weight = o.occupancy_weight;
    ro.knobs.balance_threshold_tokens = static_cast<uint64_t>(o.balance);
    auto r = router::EmbeddedRouter::Start(ro, "127.0.0.1:0");
    if (!r.ok()) return r.status();
    c.embedded = std::move(*r);
    c.router_address = c.embedded->address();
  } else if (kv_aware) {
    auto r =
        LocalServer::Start(DefaultBinary("router", "kvtier-router"), scratch + "-router",
                           {"--heartbeat-deadline=3s", absl::StrCat("--fetch-cost=", o.fetch_cost),
                            absl::StrCat("--load-weight=", o.load_weight),
                            absl::StrCat("--occupancy-weight=", o.occupancy_weight),
                            absl::StrCat("--balance-threshold-tokens=", o.balance)});
    if (!r.ok()) return r.status();
    c.router = std::move(*r);
    c.router_address = c.router->address();
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
    if (kv_aware) flags.push_back("--router=" + c.router_address);
    auto s =
        LocalServer::Start(DefaultBinary("cachestore", "kvtier-store"), scratch + "-store", flags);
    if (!s.ok()) return s.status();
    store = std::move(*s);
  }
  // Sim: 512-token blocks of fp16, 1 layer, 1 head: head_dim sets the bytes.
  // Torch: the reference engine's own geometry, real forward passes.
  const bool torch = o.engine == "torch";
  const uint64_t head_dim = o.block_bytes / 2048;
  auto& workers = c.workers;
  auto& stubs = c.stubs;
  auto& by_endpoint = c.by_endpoint;
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
               "--threads=1",
               o.worker_drain ? "--drain" : "--no-drain",
               absl::StrCat("--drain-timeout=", static_cast<double>(o.drain_timeout_ms) / 1000.0)};
    } else {
      flags = {absl::StrCat("--worker-id=", tag, "-w", w), "--model=mooncake-trace", "--dtype=fp16",
               "--layers=1", "--kv-heads=1", absl::StrCat("--head-dim=", head_dim),
               "--block-tokens=512", absl::StrCat("--pages=", o.pages),
               absl::StrCat("--prefill-tokens-per-s=", o.prefill_tps),
               // Load reaches the router every 100 ms of simulated time
               // (1..20 ms real), the same staleness at every speed.
               absl::StrCat("--heartbeat=", HeartbeatMs(o.speed), "ms"),
               absl::StrCat("--staging-blocks=", 256),
               absl::StrCat("--reorder-window=", o.reorder_window_ms, "ms"),
               // Engines sleep their simulated prefill time compressed like the trace.
               absl::StrCat("--time-scale=", o.speed > 0 ? 1.0 / o.speed : 0.0),
               !with_store        ? std::string("--offload=none")
               : base == "kvtier" ? "--offload=" + o.kvtier_offload
                                  : std::string("--offload=write-through"),
               absl::StrCat("--kv-wire=", o.kv_wire.empty() ? "none" : o.kv_wire),
               absl::StrCat("--drain=", o.worker_drain ? "true" : "false"),
               absl::StrCat("--drain-timeout=", o.drain_timeout_ms, "ms")};
    }
    if (store) flags.push_back("--store=" + store->address());
    if (kv_aware) flags.push_back("--router=" + c.router_address);
    auto s = LocalServer::Start(torch ? DefaultBinary("python", "kvtier-torch-engine")
                                      : DefaultBinary("worker", "kvtier-sim-worker"),
                                absl::StrCat(scratch, "-w", w), flags);
    if (!s.ok()) return s.status();
    by_endpoint[(*s)->address()] = workers.size();
    c.worker_ids.push_back(absl::StrCat(tag, "-w", w));
    stubs.push_back(v1::SimWorker::NewStub(
        grpc::CreateChannel((*s)->address(), grpc::InsecureChannelCredentials())));
    workers.push_back(std::move(*s));
  }
  c.spec = torch
               ? TorchGeometry()
               : NamespaceSpec{
                     "mooncake-trace", "fp16", 1, 1, static_cast<uint32_t>(head_dim), 512, 0, 1, "",
                     o.kv_wire,        ""};
  uint64_t& ns = c.ns;
  ns = NamespaceId(c.spec);
  std::unique_ptr<v1::Router::Stub>& rstub = c.rstub;
  if (kv_aware) {
    rstub = v1::Router::NewStub(
        grpc::CreateChannel(c.router_address, grpc::InsecureChannelCredentials()));
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
  // Its simulated time lies far before the trace's. 64 blocks, not one:
  // with one, something on the first large request's path (which part was
  // not found) fell inside the trace and held one worker's deliveries up
  // to 210 ms (real) in 3 of 9 runs of mix at speed 50 with
  // round-robin+store; none in 4 runs with 64.
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
      for (uint32_t b = 0; b < kWarmUpBlocks; ++b) {
        BlockHash h = TraceHash(ns, (uint64_t{1} << 60) + w * kWarmUpBlocks + b);
        auto* p = req.mutable_hashes()->add_hashes();
        p->set_hi(h.hi);
        p->set_lo(h.lo);
      }
      req.set_prompt_tokens(512 * kWarmUpBlocks);
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
  // Then a second for the processes to finish starting (threads, first
  // touches of their memory): without it, at speed 50 requests in the
  // replay's first 300 ms reached their workers up to 240 ms late, and the
  // simulated engines could not place them by their arrival.
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  return c;
}

void ReadCounters(Cluster& c, ModeResult* res) {
  if (c.store) {
    // How much of a pin is the store's own work (the rest is the round trip).
    StoreClient control(c.store->address());
    if (auto st = control.GetStats(); st.ok()) {
      // Pins come over gRPC (BeginGet) or on the data plane (DataPlaneBeginGet).
      uint64_t calls = 0, us = 0;
      for (const auto& h : st->rpc_latency()) {
        if (h.rpc() == "BeginGet" || h.rpc() == "DataPlaneBeginGet") {
          calls += h.count();
          us += h.sum_us();
        }
        if (h.rpc() == "BeginPut" || h.rpc() == "DataPlaneBeginPut")
          res->store_begin_puts += h.count();
        if (h.rpc() == "CommitPut") res->store_grpc_commits += h.count();
        if (h.rpc() == "DataPlaneCommitPut") res->store_pipelined_commits += h.count();
      }
      if (calls > 0) res->store_pin_handler_ms = static_cast<double>(us) / calls / 1000;
    }
  }
  for (auto& s : c.stubs) {
    grpc::ClientContext ctx;
    v1::GetWorkerStatsResponse st;
    if (s->GetWorkerStats(&ctx, {}, &st).ok()) {
      res->offloaded_blocks += st.offloaded_blocks();
      res->offload.Add(st.offload_breakdown());
      res->offload_batches += st.offload_batches();
      res->offload_round_trips += st.offload_round_trips();
      res->offloaded_bytes += st.offloaded_bytes();
      res->computed_blocks += st.computed_blocks();
      res->offload_dropped += st.offload_dropped();
    }
  }
}

}  // namespace kvtier::bench
