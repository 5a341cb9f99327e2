// kvtier-sim-worker: a simulated inference engine over the worker library.
// Its "model" writes KV bytes that are a pure function of (namespace, block
// hash, layer); prefill time is simulated at --prefill-tokens-per-s. It
// onboards from the store, verifies every onboarded byte, offloads by policy,
// and publishes KV events and heartbeats to routers. See --help.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/router_client.h"
#include "client/router_fanout.h"
#include "common/config.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"
#include "common/rpc/tls.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "worker/connector.h"
#include "worker/model.h"

#include "worker/sim_engine.h"

int main(int argc, char** argv) {
  // First, before gRPC (TLS credentials, channels) starts any thread.
  kvtier::BlockShutdownSignals();
  kvtier::PrepareGrpcProcess();
  using namespace kvtier;
  std::string listen = "127.0.0.1:7600", stores, routers, worker_id, endpoint, port_file;
  std::string model = "sim-model", dtype = "fp16", offload = "write-back", kv_wire = "none";
  int64_t layers = 4, kv_heads = 2, head_dim = 64, block_tokens = 16, pages = 1024, staging = 64;
  worker::SimOptions sim;
  uint64_t heartbeat_ms = 500, deadline_ms = 10000, router_refresh_ms = 5000;
  TlsFlags tls;
  FlagSet flags(
      "kvtier-sim-worker",
      "A simulated inference engine over kvtier's worker library: serves Submit\n"
      "(kvtier.v1.SimWorker) with a fake model whose KV bytes are known, onboarding from\n"
      "and offloading to kvtier-store and publishing KV events to kvtier-router.\n"
      "Example: kvtier-sim-worker --listen 127.0.0.1:7601 --store 127.0.0.1:7400 "
      "--router 127.0.0.1:7500 --worker-id w1");
  flags.HostPort("listen", &listen, "gRPC address HOST:PORT (port 0 picks a free port)");
  flags.String("store", &stores, "Comma-separated kvtier-store addresses (empty: no store tier)");
  flags.String("router", &routers, "Comma-separated kvtier-router addresses (empty: none)");
  flags.String("worker-id", &worker_id, "Id towards routers [default: sim-worker@LISTEN]");
  flags.String("endpoint", &endpoint, "Where routers send requests [default: the listen address]");
  flags.String("model", &model, "Model name of the namespace");
  flags.Choice("dtype", &dtype, {"fp16", "bf16", "fp8"}, "KV element type");
  flags.Choice("kv-wire", &kv_wire, {"none", "int8"},
               "Block encoding in the store: the dtype's bytes, or int8 (half the bytes of a "
               "16-bit cache; lossy, see docs/dataplane.md)");
  flags.Int("layers", &layers, 1, 1024, "Layers");
  flags.Int("kv-heads", &kv_heads, 1, 1024, "KV heads");
  flags.Int("head-dim", &head_dim, 1, 4096, "Head dimension");
  flags.Int("block-tokens", &block_tokens, limits::kMinBlockTokens, limits::kMaxBlockTokens,
            "Tokens per block (page)");
  flags.Int("pages", &pages, 1, int64_t{1} << 24, "GPU pages in the pool");
  flags.Choice("offload", &offload, {"write-back", "write-through", "none"},
               "When blocks go to the store: on eviction, on save, or never");
  flags.Int("staging-blocks", &staging, 1, 1 << 20, "Staging buffer bound, in blocks");
  flags.Double("prefill-tokens-per-s", &sim.prefill_tokens_per_s, 1, 1e9,
               "Simulated prefill speed");
  flags.Double("decode-ms-per-token", &sim.decode_ms_per_token, 0, 1e6, "Simulated decode time");
  flags.Double("time-scale", &sim.time_scale, 0, 1000,
               "Real seconds the engine sleeps per simulated second of prefill (0: none)");
  uint64_t reorder_ms = 10;
  flags.DurationMs("reorder-window", &reorder_ms,
                   "With --time-scale: how long a request waits (real time) for requests ready "
                   "before it in simulated time to reach the engine, so that host scheduling does "
                   "not reorder the simulated engine's queue");
  flags.DurationMs("heartbeat", &heartbeat_ms, "Heartbeat period towards routers");
  flags.DurationMs("router-refresh", &router_refresh_ms,
                   "How often --router names are resolved again (one publisher per address: every "
                   "replica behind a headless Service; 0: once)");
  flags.DurationMs("deadline", &deadline_ms, "Deadline of each store operation");
  flags.String("port-file", &port_file, "Write the bound gRPC port to this file once serving");
  bool drain = true;
  uint64_t drain_ms = 20000, drain_bytes = uint64_t{4} << 30;
  flags.Bool("drain", &drain,
             "On SIGTERM, leave without losing the cache: announce draining (routers send "
             "nothing new), finish the requests in flight, save the most valuable blocks the "
             "store lacks, then stop (false: stop at once; what only this worker held is lost)");
  flags.DurationMs("drain-timeout", &drain_ms,
                   "The whole drain's budget, requests in flight and saving together (keep it "
                   "under the pod's terminationGracePeriodSeconds)");
  flags.Bytes("drain-bytes", &drain_bytes, "At most this many block bytes saved by a drain");
  AddTlsFlags(flags, &tls, /*serves=*/true, /*dials=*/true);
  ParseFlagsOrExit(flags, argc, argv);
  sim.reorder_window = std::chrono::microseconds(sim.time_scale > 0 ? reorder_ms * 1000 : 0);
  sim.arrivals_listed_for = std::chrono::milliseconds(std::max<uint64_t>(250, 3 * heartbeat_ms));
  auto client_security = ClientSecurity(tls);
  if (!client_security.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n",
                 std::string(client_security.status().message()).c_str());
    return 2;
  }

  worker::ConnectorOptions co;
  co.spec = NamespaceSpec{model,
                          dtype,
                          static_cast<uint32_t>(layers),
                          static_cast<uint32_t>(kv_heads),
                          static_cast<uint32_t>(head_dim),
                          static_cast<uint32_t>(block_tokens),
                          0,
                          1,
                          "",
                          "",
                          ""};
  if (kv_wire == "int8") co.spec.kv_wire = kKvWireInt8;
  sim.packed = kv_wire == "int8";
  co.num_pages = static_cast<uint64_t>(pages);
  for (absl::string_view s : absl::StrSplit(stores, ',', absl::SkipEmpty()))
    co.stores.emplace_back(s);
  co.offload = offload;
  co.staging_blocks = static_cast<uint64_t>(staging);
  co.data.deadline_ms = static_cast<int>(deadline_ms);
  co.data.security = *client_security;
  if (auto s = ValidateNamespace(co.spec); !s.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(s.message()).c_str());
    return 2;
  }

  auto c = worker::KvConnector::Create(co);
  if (!c.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(c.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<worker::KvConnector> connector = std::move(*c);
  auto engine = std::make_unique<worker::SimWorkerService>(connector.get(), sim);
  // The server and its publishers: the path Python's WorkerServer takes too.
  worker::WorkerServerOptions wo;
  wo.binary = "kvtier-sim-worker";
  wo.id_prefix = "sim-worker";
  wo.listen = listen;
  wo.tls = tls;
  for (absl::string_view r : absl::StrSplit(routers, ',', absl::SkipEmpty()))
    wo.routers.emplace_back(r);
  wo.worker_id = worker_id;
  wo.endpoint = endpoint;
  wo.namespace_id = connector->namespace_id();
  wo.block_tokens = static_cast<uint32_t>(block_tokens);
  wo.heartbeat_ms = heartbeat_ms;
  wo.router_refresh_ms = router_refresh_ms;
  auto server = worker::WorkerServer::Start(engine.get(), wo);
  if (!server.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(server.status().message()).c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  worker_id = (*server)->worker_id();
  engine->SetWorkerId(worker_id);
  const std::string bound = (*server)->address();
  std::vector<BlockEventSink*> pubs;
  if ((*server)->events()) pubs.push_back((*server)->events());
  connector->SetPublishers(pubs);
  Log("sim-worker", worker_id, " listening on ", bound, " (namespace ",
      NamespaceName(connector->namespace_id()), ", ", pages, " pages of ", connector->block_bytes(),
      " bytes, offload ", offload, ", ", co.stores.size(), " store(s), ", pubs.size(),
      " router(s))");
  kvtier::AnnounceListening("kvtier-sim-worker", (*server)->started(), "", port_file);
  auto leave = [&](int) {
    if (!drain) return;
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + std::chrono::milliseconds(drain_ms);
    engine->StartDraining();
    Log("sim-worker", worker_id, " draining: no new requests; ", drain_ms, " ms budget");
    const int64_t left = engine->WaitIdle(deadline);
    const double idle_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (left > 0) Log("sim-worker", left, " requests still running at the drain's deadline");
    auto saved = connector->SaveHot(drain_bytes, deadline);
    if (!saved.ok()) {
      Log("sim-worker", "drain: ", saved.status().ToString());
      return;
    }
    Log("sim-worker", "drained in ", static_cast<int64_t>(idle_ms + saved->ms), " ms (",
        static_cast<int64_t>(idle_ms), " ms for requests in flight): ", saved->cached,
        " blocks cached, ", saved->known, " known stored, ", saved->queued, " saved (",
        saved->bytes, " bytes), ", saved->saved, " now in the store",
        saved->stopped.empty() ? std::string() : ", stopped by " + saved->stopped);
  };
  kvtier::ServeUntilSignalled((*server)->started().server.get(), "sim-worker", leave);
  // The server and its publishers first (heartbeats read the engine's
  // load); then the engine, which uses the connector.
  (*server)->Stop();
  connector->SetPublishers({});  // the fanout goes with the server
  server->reset();
  engine.reset();
  connector.reset();
  Log("sim-worker", "stopped");
  return 0;
}
