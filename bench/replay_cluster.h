// kvtier-bench replay's cluster on loopback: its options, the store,
// router and workers of one mode started and warmed up, and the counters
// read from them once the mode has run.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/bench_util.h"
#include "bench/replay_result.h"
#include "common/block_key.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "router/embedded_router.h"

namespace kvtier::bench {

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
  double fetch_cost = 0.1, load_weight = 1.0, occupancy_weight = 4.0;
  int64_t balance = 32768;
  // Simulated workers: how long (real ms) a request waits for ones before
  // it in simulated time to reach the engine (kvtier-sim-worker
  // --reorder-window).
  uint64_t reorder_window_ms = 10;
  std::string modes = "round-robin,round-robin+store,kv-aware,kvtier";
  std::string plot;
  std::string per_request;  // --per-request: JSONL of every request's parts, per mode
  int64_t repeat = 1;       // --repeat: runs of every mode, pooled
  int64_t run = 0;          // which run this is (0-based; per-request lines carry it)
  bool json = false, progress = true;
  int64_t restart_router_at = 0;  // kill -9 and restart the router after this many requests
  bool restart_control = false;   // measure the same windows without restarting
  std::string bin_dir;
  std::string kv_wire;              // "" or "int8" (--kv-wire)
  std::string engine = "sim";       // "sim" (kvtier-sim-worker) or "torch" (kvtier-torch-engine)
  int64_t trace_block_tokens = 32;  // torch: real tokens per 512-token trace block
  int64_t torch_max_step_tokens = 512;
  // Where KV-aware modes route: "frontend" (a router inside the replay's
  // client, the way Dynamo's KV router runs in its frontend: no round trip
  // on a request's path) or "process" (a kvtier-router process, asked over
  // gRPC; --restart-router-at needs it).
  std::string router = "frontend";
  // How the kvtier mode's workers offload ("write-through" or
  // "write-back"); round-robin+store always writes through.
  std::string kvtier_offload = "write-through";
  // Scaling down mid-replay (modes MODE@down and MODE@drain): after this
  // many requests were dispatched the workers from scale_down_to on get
  // SIGTERM; @drain's workers drain first (kvtier-sim-worker --drain),
  // @down's stop at once. 0: no scale-down; every mode's second half
  // (from scale_down_at) is still reported, the reference.
  int64_t scale_down_at = 0, scale_down_to = 0;
  bool worker_drain = false;  // this run's workers drain on SIGTERM
  uint64_t drain_timeout_ms = 8000;
  // The kvtier mode passes the router's store_end_blocks to its workers
  // (SubmitRequest.store_hint_blocks), which skip a store lookup that can
  // find nothing the router knows of.
  bool store_hint = true;
};

// The torch engine's geometry (kvtier.engine defaults: 2 layers, 2 KV heads
// of 32, fp16) with vLLM's 16-token pages, and its vocabulary.
inline constexpr uint32_t kTorchBlockTokens = 16;
inline constexpr uint32_t kTorchVocab = 4096;
inline NamespaceSpec TorchGeometry() {
  return NamespaceSpec{"kvtier-reference", "fp16", 2, 2, 32, kTorchBlockTokens, 0, 1, "", "", ""};
}

// One mode's cluster: the store and router (each only where the mode uses
// it), the workers and their stubs, and the namespace requests are in.
struct Cluster {
  // The router is a process (`router`) or in this one (`embedded`), or none.
  std::unique_ptr<router::EmbeddedRouter> embedded;
  std::unique_ptr<LocalServer> store, router;
  std::vector<std::unique_ptr<LocalServer>> workers;
  std::vector<std::unique_ptr<v1::SimWorker::Stub>> stubs;
  std::map<std::string, size_t> by_endpoint;  // worker address -> index
  std::vector<std::string> worker_ids;        // by index
  std::unique_ptr<v1::Router::Stub> rstub;    // either router's gRPC service
  std::string router_address;
  NamespaceSpec spec;
  uint64_t ns = 0;
};

// Starts `mode`'s cluster under `dir`, waits until every worker registered
// with the router, and warms each worker up with one request no trace
// request shares.
absl::StatusOr<Cluster> StartCluster(const Options& o, const std::string& mode, const TempDir& dir);

// The store's put and pin counts and the workers' offload figures, into `res`.
void ReadCounters(Cluster& c, ModeResult* res);

}  // namespace kvtier::bench
