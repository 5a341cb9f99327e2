// kvtier-sim-worker: a simulated inference engine over the worker library.
// Its "model" writes KV bytes that are a pure function of (namespace, block
// hash, layer); prefill time is simulated at --prefill-tokens-per-s. It
// onboards from the store, verifies every onboarded byte, offloads by policy,
// and publishes KV events and heartbeats to routers. See --help.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/config.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/grpc_status.h"
#include "common/log.h"
#include "common/rpc/proto_convert.h"
#include "client/router_client.h"
#include "client/router_fanout.h"
#include "common/rpc/tls.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "worker/connector.h"
#include "worker/model.h"
#include "common/limits.h"

namespace kvtier::worker {
namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void ToProto(const TransferTimes& t, v1::TimeBreakdown* out) {
  out->set_control_ms(t.control_ms);
  out->set_queue_ms(t.queue_ms);
  out->set_rma_ms(t.rma_ms);
  out->set_checksum_ms(t.checksum_ms);
}

void ToProto(const LoadTimes& t, v1::TimeBreakdown* out) {
  ToProto(t.transfer, out);
  out->set_staging_ms(t.staging_ms);
  out->set_scatter_ms(t.scatter_ms);
}

struct SimOptions {
  bool packed = false;  // kv_wire int8: onboarded bytes are the model's after pack + unpack
  double prefill_tokens_per_s = 10000;
  double decode_ms_per_token = 20;
  double time_scale = 0;  // real seconds slept per simulated second of prefill
  std::string worker_id;
};

class SimWorkerService final : public v1::SimWorker::Service {
 public:
  SimWorkerService(KvConnector* c, SimOptions o) : c_(c), o_(std::move(o)) {}

  // Load for heartbeats.
  v1::Heartbeat Load() const {
    v1::Heartbeat h;
    h.set_running_requests(static_cast<uint32_t>(running_.load()));
    h.set_queued_prefill_tokens(queued_tokens_.load());
    h.set_free_gpu_pages(c_->stats().pool.free);
    // Its prefill rate in real time (simulated seconds take time_scale real
    // ones; with no sleeping the rate is unknown).
    if (o_.time_scale > 0) h.set_prefill_tokens_per_s(o_.prefill_tokens_per_s / o_.time_scale);
    return h;
  }

  grpc::Status Submit(grpc::ServerContext*, const v1::SubmitRequest* req,
                      v1::SubmitResponse* resp) override {
    auto done = fence_.Enter();
    auto t0 = Clock::now();
    const uint32_t bt = c_->block_tokens();
    auto parsed = PromptFromRequest(*req, c_->namespace_id(), bt, "submit");
    if (!parsed.ok()) return ToGrpc(parsed.status());
    const std::vector<BlockHash>& chain = parsed->chain;
    const uint64_t prompt = parsed->prompt_tokens;
    // A trailing partial block is computed but not cached.
    running_++;
    uint64_t id = req->request_id() ? req->request_id() : next_id_++;
    // Onboarding starts here: Begin pins the store's blocks (its one round trip).
    auto t_load = Clock::now();
    auto m = c_->Begin(id, chain);
    if (!m.ok()) {
      running_--;
      return ToGrpc(m.status());
    }
    uint32_t loaded = 0;
    if (!m->store_status.ok()) {
      resp->set_load_status(absl::StrCat("store lookup failed, computing instead: ",
                                         m->store_status.message()));
    }
    double onboard_ms = 0;
    if (m->store_blocks > 0) {
      const absl::Status started = c_->StartLoad(id);
      auto l = started.ok() ? c_->WaitForLoad(id) : absl::StatusOr<uint32_t>(started);
      if (l.ok()) {
        loaded = *l;
        resp->set_onboarded_from_disk(c_->LoadedFromDisk(id));
      } else {
        resp->set_load_status(std::string(l.status().message()));
      }
      onboard_ms = Ms(Clock::now() - t_load);
      ToProto(c_->LoadTimesOf(id), resp->mutable_onboard_breakdown());
    }
    // Every onboarded byte against the model.
    uint32_t verified = 0, mismatched = 0;
    {
      auto pages = c_->pool().MatchAndRef(chain);
      for (uint32_t i = m->gpu_blocks; i < m->gpu_blocks + loaded && i < pages.size(); ++i) {
        bool same = PageMatchesModel(c_->pool().layout(), c_->pool().layer_bases(), pages[i],
                                     c_->namespace_id(), chain[i], o_.packed);
        ++verified;
        mismatched += !same;
      }
      for (auto it = pages.rbegin(); it != pages.rend(); ++it) c_->pool().Unref(*it);  // tail first
    }
    uint64_t cached_tokens = std::min<uint64_t>(uint64_t{m->gpu_blocks + loaded} * bt, prompt);
    uint64_t prefill = prompt - cached_tokens;
    // Pages for the computed blocks. When other requests hold the pool, wait
    // for them like an engine's scheduler would; a prompt larger than the
    // whole pool is computed without caching its blocks.
    auto pages = c_->AllocateForCompute(id);
    for (auto until = Clock::now() + std::chrono::seconds(30);
         !pages.ok() && pages.status().code() == absl::StatusCode::kResourceExhausted &&
         running_.load() > 1 && Clock::now() < until;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      pages = c_->AllocateForCompute(id);
    }
    if (!pages.ok() && pages.status().code() != absl::StatusCode::kResourceExhausted) {
      c_->Finished(id);
      running_--;
      return ToGrpc(pages.status());
    }
    if (!pages.ok()) pages = std::vector<uint32_t>();  // computed, not cached
    const size_t first = m->gpu_blocks + loaded;
    for (size_t i = 0; i < pages->size(); ++i) {
      ComputeIntoPage(c_->pool().layout(), c_->pool().layer_bases(), (*pages)[i],
                      c_->namespace_id(), chain[first + i]);
    }
    double prefill_ms = 1000.0 * static_cast<double>(prefill) / o_.prefill_tokens_per_s;
    double queue_ms = 0;
    {
      queued_tokens_ += prefill;
      auto tq = Clock::now();
      std::lock_guard engine(engine_mu_);  // one prefill at a time
      queue_ms = Ms(Clock::now() - tq);
      if (o_.time_scale > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(
            static_cast<int64_t>(prefill_ms * 1000 * o_.time_scale)));
      }
      queued_tokens_ -= prefill;
    }
    if (auto s = c_->Save(id); !s.ok()) {
      c_->Finished(id);
      running_--;
      return ToGrpc(s);
    }
    c_->Finished(id);  // waits for write-through offloads of this request
    running_--;
    requests_++;
    verified_ += verified;
    mismatched_ += mismatched;
    resp->set_prompt_tokens(prompt);
    resp->set_prefill_tokens(prefill);
    resp->set_gpu_hit_tokens(std::min<uint64_t>(uint64_t{m->gpu_blocks} * bt, prompt));
    resp->set_onboarded_tokens(cached_tokens - resp->gpu_hit_tokens());
    resp->set_verified_blocks(verified);
    resp->set_mismatched_blocks(mismatched);
    resp->set_onboard_ms(onboard_ms);
    resp->set_decode_ms(o_.decode_ms_per_token * req->output_tokens());
    // TTFT: queueing behind other prefills (the engine sleeps scaled
    // simulated time, so scale it back), onboarding (real transfers, taken
    // as measured) and the simulated prefill.
    double scale = o_.time_scale > 0 ? o_.time_scale : 1.0;
    resp->set_ttft_ms(queue_ms / scale + onboard_ms + prefill_ms);
    (void)t0;
    return grpc::Status::OK;
  }

  // After the server stopped (see HandlerFence).
  void Quiesce() const { fence_.Quiesce(); }

  grpc::Status GetWorkerStats(grpc::ServerContext*, const v1::GetWorkerStatsRequest*,
                              v1::GetWorkerStatsResponse* resp) override {
    auto done = fence_.Enter();
    ConnectorStats s = c_->stats();
    resp->set_worker_id(o_.worker_id);
    resp->set_requests(requests_);
    resp->set_pages(c_->pool().layout().num_pages);
    resp->set_free_pages(s.pool.free);
    resp->set_cached_pages(s.pool.cached);
    resp->set_loaded_blocks(s.loaded_blocks);
    resp->set_load_failures(s.load_failures);
    resp->set_offloaded_blocks(s.offloaded_blocks);
    resp->set_offload_dropped(s.offload_dropped_full);
    resp->set_offload_failures(s.offload_failures);
    resp->set_staging_peak_blocks(s.staging_peak);
    resp->set_staging_blocks(s.staging_blocks);
    resp->set_verified_blocks(verified_);
    resp->set_mismatched_blocks(mismatched_);
    resp->set_page_evictions(s.pool.evictions);
    ToProto(s.offload_times, resp->mutable_offload_breakdown());
    resp->mutable_offload_breakdown()->set_gather_ms(s.offload_gather_ms);
    ToProto(s.load_times, resp->mutable_onboard_breakdown());
    return grpc::Status::OK;
  }

 private:
  KvConnector* c_;
  SimOptions o_;
  HandlerFence fence_;
  std::mutex engine_mu_;
  std::atomic<uint64_t> next_id_{1ull << 62}, requests_{0}, verified_{0}, mismatched_{0};
  std::atomic<int64_t> running_{0};
  std::atomic<uint64_t> queued_tokens_{0};
};

}  // namespace
}  // namespace kvtier::worker

int main(int argc, char** argv) {
  // First, before gRPC (TLS credentials, channels) starts any thread.
  kvtier::BlockShutdownSignals();
  using namespace kvtier;
  std::string listen = "127.0.0.1:7600", stores, routers, worker_id, endpoint, port_file;
  std::string model = "sim-model", dtype = "fp16", offload = "write-back", kv_wire = "none";
  int64_t layers = 4, kv_heads = 2, head_dim = 64, block_tokens = 16, pages = 1024, staging = 64;
  worker::SimOptions sim;
  uint64_t heartbeat_ms = 500, deadline_ms = 10000, router_refresh_ms = 5000;
  TlsFlags tls;
  FlagSet flags("kvtier-sim-worker",
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
  flags.DurationMs("heartbeat", &heartbeat_ms, "Heartbeat period towards routers");
  flags.DurationMs("router-refresh", &router_refresh_ms,
                   "How often --router names are resolved again (one publisher per address: every "
                   "replica behind a headless Service; 0: once)");
  flags.DurationMs("deadline", &deadline_ms, "Deadline of each store operation");
  flags.String("port-file", &port_file, "Write the bound gRPC port to this file once serving");
  AddTlsFlags(flags, &tls, /*serves=*/true, /*dials=*/true);
  ParseFlagsOrExit(flags, argc, argv);
  auto client_security = ClientSecurity(tls);
  auto server_credentials = ServerCredentials(tls);
  for (const absl::Status& s : {client_security.status(), server_credentials.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(s.message()).c_str());
      return 2;
    }
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
  for (absl::string_view s : absl::StrSplit(stores, ',', absl::SkipEmpty())) co.stores.emplace_back(s);
  co.offload = offload;
  co.staging_blocks = static_cast<uint64_t>(staging);
  co.data.deadline_ms = static_cast<int>(deadline_ms);
  co.data.security = *client_security;
  if (auto s = ValidateNamespace(co.spec); !s.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(s.message()).c_str());
    return 2;
  }

  // Publishers need the bound port (the endpoint names it): they are
  // attached to the connector once the server is up.
  std::unique_ptr<RouterFanout> fanout;  // every router replica each --router name has
  std::unique_ptr<worker::KvConnector> connector;
  std::unique_ptr<worker::SimWorkerService> service;

  auto c = worker::KvConnector::Create(co);
  if (!c.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(c.status().message()).c_str());
    return 1;
  }
  connector = std::move(*c);
  service = std::make_unique<worker::SimWorkerService>(connector.get(), sim);
  auto started = kvtier::StartGrpcServer(
      {"kvtier-sim-worker", listen, *server_credentials, {service.get()}, 64 << 20});
  if (!started.ok()) {
    std::fprintf(stderr, "kvtier-sim-worker: %s\n", std::string(started.status().message()).c_str());
    return 1;
  }
  grpc::Server* server = started->server.get();
  const std::string bound = started->address();
  if (worker_id.empty()) worker_id = "sim-worker@" + bound;
  if (endpoint.empty()) endpoint = bound;
  std::vector<std::string> router_list;
  for (absl::string_view r : absl::StrSplit(routers, ',', absl::SkipEmpty())) router_list.emplace_back(r);
  if (!router_list.empty()) {
    PublisherOptions po;
    po.hello.set_source_id(worker_id);
    po.hello.set_kind(v1::SOURCE_WORKER);
    po.hello.set_endpoint(endpoint);
    po.hello.set_namespace_id(connector->namespace_id());
    po.hello.set_block_tokens(static_cast<uint32_t>(block_tokens));
    po.heartbeat_ms = heartbeat_ms;
    po.security = *client_security;
    auto* svc = service.get();
    fanout = std::make_unique<RouterFanout>(router_list, po, [svc] { return svc->Load(); },
                                            router_refresh_ms);
  }
  std::vector<BlockEventSink*> pubs;
  if (fanout) pubs.push_back(fanout.get());
  connector->SetPublishers(pubs);
  Log("sim-worker", worker_id, " listening on ", bound, " (namespace ", connector->namespace_id(),
      ", ", pages, " pages of ", connector->block_bytes(), " bytes, offload ", offload, ", ",
      co.stores.size(), " store(s), ", pubs.size(), " router(s))");
  kvtier::AnnounceListening("kvtier-sim-worker", *started, "", port_file);
  kvtier::ServeUntilSignalled(server, "sim-worker");
  service->Quiesce();
  // Publishers first: their heartbeats read the connector's load.
  if (fanout) fanout->Stop();
  connector.reset();
  Log("sim-worker", "stopped");
  return 0;
}
