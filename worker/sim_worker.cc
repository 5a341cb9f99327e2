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
  // How long (real time) the engine waits for requests ready before the
  // one it would take next that may still be on their way.
  std::chrono::microseconds reorder_window{0};
};

// The simulated engine. A request is looked up in the store as it arrives,
// and what the store holds is loaded while it waits (on its own thread).
// One thread runs the engine, as an engine's scheduler loop: first come
// first served among the requests ready (arrived, and loaded), it matches
// the prompt against the GPU pages again when it runs it (as vLLM's
// scheduler does, so a request queued behind another with its prefix finds
// that prefix computed) and computes its uncached tokens, one prefill at a
// time.
//
// Time is simulated: the engine keeps its own clock in simulated
// milliseconds. A request is ready at its arrival (SubmitRequest.arrival_ms,
// on the caller's clock); a prefill takes prompt tokens / prefill rate; the
// tier's real costs (the store lookup and a load, which the request waits
// for while the engine serves others) enter it as measured. Real time only paces the
// engine (it sleeps time_scale x each prefill, so the load routers see and
// the pages it holds last as long, scaled, as in simulation): how the host
// schedules threads never enters a request's times.
class SimWorkerService final : public v1::SimWorker::Service {
 public:
  SimWorkerService(KvConnector* c, SimOptions o) : c_(c), o_(std::move(o)) {
    engine_ = std::thread([this] { EngineLoop(); });
  }
  ~SimWorkerService() override {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    engine_.join();
  }

  // Load for heartbeats.
  v1::Heartbeat Load() const {
    v1::Heartbeat h;
    h.set_running_requests(static_cast<uint32_t>(running_.load()));
    h.set_queued_prefill_tokens(o_.time_scale > 0 ? SimulatedBacklog() : queued_tokens_.load());
    h.set_free_gpu_pages(c_->stats().pool.free);
    // Its prefill rate in the clock the tier's costs are counted in: the
    // simulated engine takes a load's real milliseconds as simulated ones,
    // so the router weighs a fetch against simulated compute.
    h.set_prefill_tokens_per_s(o_.prefill_tokens_per_s);
    return h;
  }

  grpc::Status Submit(grpc::ServerContext*, const v1::SubmitRequest* req,
                      v1::SubmitResponse* resp) override {
    auto done = fence_.Enter();
    auto parsed = PromptFromRequest(*req, c_->namespace_id(), c_->block_tokens(), "submit");
    if (!parsed.ok()) return ToGrpc(parsed.status());
    auto job = std::make_shared<Job>();
    job->id = req->request_id() ? req->request_id() : next_id_++;
    job->chain = std::move(parsed->chain);
    job->prompt = parsed->prompt_tokens;
    job->arrival = req->has_arrival_ms() ? req->arrival_ms() : SimNow();
    job->ready = job->arrival;
    job->output_tokens = req->output_tokens();
    job->resp = resp;
    running_++;
    // Until its lookup says how much it computes, the whole prompt counts
    // in the load routers see.
    queued_tokens_ += job->prompt;
    job->queued_tokens = job->prompt;
    {
      // Where simulated time 0 lies in real time: the earliest any request's
      // arrival maps to (the least delayed delivery tells it best).
      std::lock_guard lk(mu_);
      const auto origin = Clock::now() - std::chrono::microseconds(
                                             static_cast<int64_t>(job->arrival * 1000 * Scale()));
      if (!have_origin_ || origin < origin_) origin_ = origin;
      have_origin_ = true;
    }
    if (c_->has_store()) {
      // Looked up, and what the store holds loaded, as it arrives, on this
      // thread while it waits for the engine (the engine meanwhile serves
      // the requests before it, and waits only for a lookup or load of a
      // request that came before the one it would take).
      {
        std::lock_guard lk(mu_);
        job->load_from = job->arrival;
        loading_jobs_.insert(job.get());
      }
      const absl::Status onboarded = Onboard(*job);
      {
        std::lock_guard lk(mu_);
        loading_jobs_.erase(job.get());
      }
      cv_.notify_all();
      if (!onboarded.ok()) {
        queued_tokens_ -= job->queued_tokens;
        running_--;
        return ToGrpc(onboarded);
      }
      job->looked_up = true;
    }
    Enqueue(job);
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return job->state == Job::kDone; });
    }
    queued_tokens_ -= job->queued_tokens;
    running_--;
    return job->status;
  }

  // After the server stopped (see HandlerFence).
  void Quiesce() const { fence_.Quiesce(); }
  // Its id towards routers, known once it serves (it may name the port).
  void SetWorkerId(std::string id) {
    std::lock_guard lk(id_mu_);
    worker_id_ = std::move(id);
  }

  grpc::Status GetWorkerStats(grpc::ServerContext*, const v1::GetWorkerStatsRequest*,
                              v1::GetWorkerStatsResponse* resp) override {
    auto done = fence_.Enter();
    ConnectorStats s = c_->stats();
    {
      std::lock_guard lk(id_mu_);
      resp->set_worker_id(worker_id_);
    }
    resp->set_requests(requests_);
    resp->set_pages(c_->pool().layout().num_pages);
    resp->set_free_pages(s.pool.free);
    resp->set_cached_pages(s.pool.cached);
    resp->set_loaded_blocks(s.loaded_blocks);
    resp->set_load_failures(s.load_failures);
    resp->set_offloaded_blocks(s.offloaded_blocks);
    resp->set_offload_dropped(s.offload_dropped_full);
    resp->set_offload_batches(s.offload_batches);
    resp->set_offload_round_trips(s.offload_round_trips);
    resp->set_offloaded_bytes(s.offloaded_bytes);
    resp->set_computed_blocks(s.computed_blocks);
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
  struct Job {
    enum State { kWaiting, kDone } state = kWaiting;
    uint64_t id = 0, prompt = 0, queued_tokens = 0;
    uint32_t output_tokens = 0;
    std::vector<BlockHash> chain;
    double arrival = 0;          // simulated ms
    double ready = 0;            // when it can next be scheduled, simulated ms
    Clock::time_point received;  // real: when it joined the waiting queue
    bool looked_up = false;
    KvConnector::Match match;
    uint32_t loaded = 0;
    double onboard_ms = 0;  // real: lookup and load
    double load_from = 0;   // simulated ms: when its load started
    v1::SubmitResponse* resp = nullptr;
    grpc::Status status;
  };

  // Tokens a request is expected to compute: its prompt after what the GPU
  // pages hold now.
  uint64_t EstimatedPrefill(const Job& job) const {
    const uint64_t cached = uint64_t{c_->pool().Match(job.chain)} * c_->block_tokens();
    return job.prompt - std::min(job.prompt, cached);
  }

  // The engine's backlog in prefill tokens at the present moment of
  // simulated time: the rest of what it booked, and what the requests
  // waiting for it (or loading) are expected to compute, first come first
  // served from their ready times. The requests the real process holds
  // (queued_tokens_) are not it: a request waits in real time for the
  // reorder window, and the process may lag its simulation.
  uint64_t SimulatedBacklog() const {
    std::lock_guard lk(mu_);
    if (!have_origin_) return 0;
    const double now =
        std::chrono::duration<double, std::milli>(Clock::now() - origin_).count() / Scale();
    double busy = busy_until_.load();
    double left_ms = std::max(0.0, busy - now);
    auto add = [&](double ready, uint64_t tokens) {
      const double start = std::max(busy, ready);
      busy = start + 1000.0 * static_cast<double>(tokens) / o_.prefill_tokens_per_s;
      left_ms += std::max(0.0, busy - std::max(start, now));
    };
    // In ready order: the waiting and the loading (ready at the earliest
    // when their load started).
    std::vector<std::pair<double, uint64_t>> ahead;
    for (const auto& [key, j] : waiting_) ahead.emplace_back(j->ready, EstimatedPrefill(*j));
    for (const Job* j : loading_jobs_) ahead.emplace_back(j->load_from, EstimatedPrefill(*j));
    std::sort(ahead.begin(), ahead.end());
    for (const auto& [ready, tokens] : ahead) add(ready, tokens);
    return static_cast<uint64_t>(left_ms * o_.prefill_tokens_per_s / 1000.0);
  }

  // Real seconds per simulated one (1 when the engine does not sleep).
  double Scale() const { return o_.time_scale > 0 ? o_.time_scale : 1.0; }
  // When simulated time `ms` comes in real time. REQUIRES: mu_ held, a
  // request seen.
  Clock::time_point RealAt(double ms) const {
    return origin_ + std::chrono::microseconds(static_cast<int64_t>(ms * 1000 * Scale()));
  }

  // The worker's own simulated clock, for requests that do not say when
  // they arrived: milliseconds since it started, in simulated time.
  double SimNow() const {
    return Ms(Clock::now() - started_) / (o_.time_scale > 0 ? o_.time_scale : 1.0);
  }

  void Enqueue(const std::shared_ptr<Job>& job) {
    std::lock_guard lk(mu_);
    // Requests that arrived at the same moment go in the caller's order
    // (its request ids), not in the order the host happened to deliver them.
    job->received = Clock::now();
    waiting_.emplace(std::make_pair(job->arrival, job->id), job);
    cv_.notify_all();
  }

  // Ends a job: its answer is in job.resp (or job.status).
  void Finish(Job& job, grpc::Status status) {
    std::lock_guard lk(mu_);
    job.status = std::move(status);
    job.state = Job::kDone;
    cv_.notify_all();
  }

  // On the request's own thread, as it arrives: looks it up (the GPU pages
  // and the store: one round trip) and loads what the store holds, while
  // the engine goes on with other requests. It is ready that much after
  // its arrival (real time, as measured); the blocks other requests compute
  // on the GPU meanwhile it still gets when the engine runs it
  // (KvConnector::MatchMore). An error is the lookup's: the request fails
  // with it.
  absl::Status Onboard(Job& job) {
    const auto t = Clock::now();
    // The lookup may take as long as computing the whole prompt would (real
    // milliseconds count as simulated ones); a store slower than that, or
    // stalled, is given up on and the prompt computed.
    const auto budget = std::chrono::milliseconds(static_cast<int64_t>(
        std::ceil(1000.0 * static_cast<double>(job.prompt) / o_.prefill_tokens_per_s)));
    auto m = c_->Begin(job.id, job.chain, budget);
    if (!m.ok()) return m.status();
    job.match = *m;
    if (!m->store_status.ok()) {
      job.resp->set_load_status(
          absl::StrCat("store lookup failed, computing instead: ", m->store_status.message()));
    }
    if (m->store_blocks > 0) {
      const absl::Status started = c_->StartLoad(job.id);
      auto l = started.ok() ? c_->WaitForLoad(job.id) : absl::StatusOr<uint32_t>(started);
      if (l.ok()) {
        job.loaded = *l;
        job.resp->set_onboarded_from_disk(c_->LoadedFromDisk(job.id));
      } else {
        job.resp->set_load_status(std::string(l.status().message()));
      }
      ToProto(c_->LoadTimesOf(job.id), job.resp->mutable_onboard_breakdown());
    }
    const double ms = Ms(Clock::now() - t);
    job.onboard_ms += ms;
    job.ready += ms;
    return absl::OkStatus();
  }

  void EngineLoop() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !waiting_.empty(); });
      if (stop_) {
        for (auto& [key, job] : waiting_) {
          job->status = grpc::Status(grpc::UNAVAILABLE, "the worker is stopping");
          job->state = Job::kDone;
        }
        waiting_.clear();
        cv_.notify_all();
        return;
      }
      // First come first served among the requests ready when the engine
      // is next free (or, idle, when the first becomes ready): the earliest
      // arrival among them. A request back from its lookup or load keeps
      // its place by arrival.
      double earliest = std::numeric_limits<double>::max();
      for (const auto& [key, j] : waiting_) earliest = std::min(earliest, j->ready);
      const double at = std::max(clock_ms_, earliest);
      auto first = waiting_.begin();
      while (first->second->ready > at) ++first;
      // Taken once the reorder window past its ready time has passed in real
      // time (one that arrived before it may still be on its way); an engine
      // behind real time takes it at once.
      const auto due = o_.time_scale > 0 ? RealAt(first->second->ready) + o_.reorder_window
                                         : first->second->received + o_.reorder_window;
      if (Clock::now() < due) {
        cv_.wait_until(lk, due);
        continue;
      }
      // A request that arrived before it and is looking up or loading may
      // be ready by then: until its lookup ends (real milliseconds) nobody
      // knows, so the engine waits.
      const std::pair<double, uint64_t> key = first->first;
      if (std::any_of(loading_jobs_.begin(), loading_jobs_.end(), [&](const Job* j) {
            return j->load_from <= at && std::make_pair(j->arrival, j->id) < key;
          })) {
        cv_.wait(lk);
        continue;
      }
      std::shared_ptr<Job> job = first->second;
      waiting_.erase(first);
      lk.unlock();
      Schedule(*job);
      lk.lock();
    }
  }

  // The engine takes the job: looks it up (the first time), sends it to
  // load, or computes it.
  void Schedule(Job& job) {
    const uint32_t bt = c_->block_tokens();
    double now = std::max(clock_ms_, job.ready);
    if (!job.looked_up) {
      job.looked_up = true;
      // No store: matching the GPU pages is the engine's own bookkeeping.
      auto m = c_->Begin(job.id, job.chain);
      if (!m.ok()) return Finish(job, ToGrpc(m.status()));
      job.match = *m;
    }
    // Every onboarded byte against the model.
    uint32_t verified = 0, mismatched = 0;
    {
      auto pages = c_->pool().MatchAndRef(job.chain);
      const uint32_t gpu = job.match.gpu_blocks;
      for (uint32_t i = gpu; i < gpu + job.loaded && i < pages.size(); ++i) {
        bool same = PageMatchesModel(c_->pool().layout(), c_->pool().layer_bases(), pages[i],
                                     c_->namespace_id(), job.chain[i], o_.packed);
        ++verified;
        mismatched += !same;
      }
      for (auto it = pages.rbegin(); it != pages.rend(); ++it) c_->pool().Unref(*it);  // tail first
    }
    // What other requests computed since its lookup, as a scheduler matches
    // a request when it runs it.
    const uint32_t more = c_->MatchMore(job.id);
    const uint64_t cached =
        std::min<uint64_t>(uint64_t{job.match.gpu_blocks + job.loaded + more} * bt, job.prompt);
    const uint64_t prefill = job.prompt - cached;
    // Pages for the computed blocks; with every page held by requests
    // loading, the prompt is computed without caching its blocks.
    auto pages = c_->AllocateForCompute(job.id);
    if (!pages.ok() && pages.status().code() != absl::StatusCode::kResourceExhausted) {
      c_->Finished(job.id);
      return Finish(job, ToGrpc(pages.status()));
    }
    if (!pages.ok()) pages = std::vector<uint32_t>();
    const size_t first = job.match.gpu_blocks + job.loaded + more;
    for (size_t i = 0; i < pages->size(); ++i) {
      ComputeIntoPage(c_->pool().layout(), c_->pool().layer_bases(), (*pages)[i],
                      c_->namespace_id(), job.chain[first + i]);
    }
    const double prefill_ms = 1000.0 * static_cast<double>(prefill) / o_.prefill_tokens_per_s;
    queued_tokens_ -= job.queued_tokens - prefill;
    job.queued_tokens = prefill;
    clock_ms_ = now + prefill_ms;
    busy_until_ = clock_ms_;
    if (o_.time_scale > 0) {
      // Pace: the prefill ends when its simulated end comes in real time (an
      // engine behind real time, held up by the host, catches up instead).
      Clock::time_point end;
      {
        std::lock_guard lk(mu_);
        end = RealAt(clock_ms_);
      }
      std::this_thread::sleep_until(end);
    }
    // Saves are staged (copied out) and written in the background: neither
    // the first token nor the request's end waits for the store.
    absl::Status saved = c_->Save(job.id);
    c_->Finished(job.id);
    if (!saved.ok()) return Finish(job, ToGrpc(saved));
    requests_++;
    verified_ += verified;
    mismatched_ += mismatched;
    v1::SubmitResponse* resp = job.resp;
    resp->set_prompt_tokens(job.prompt);
    resp->set_prefill_tokens(prefill);
    resp->set_gpu_hit_tokens(
        std::min<uint64_t>(uint64_t{job.match.gpu_blocks + more} * bt, job.prompt));
    resp->set_onboarded_tokens(
        std::min<uint64_t>(uint64_t{job.loaded} * bt, job.prompt - resp->gpu_hit_tokens()));
    resp->set_verified_blocks(verified);
    resp->set_mismatched_blocks(mismatched);
    resp->set_onboard_ms(job.onboard_ms);
    resp->set_decode_ms(o_.decode_ms_per_token * job.output_tokens);
    // TTFT in simulated time, from arrival to the prefill's end: onboarding
    // (real, as measured), the prefill, and the rest waiting for the engine.
    const double ttft = clock_ms_ - job.arrival;
    resp->set_ttft_ms(ttft);
    resp->set_prefill_ms(prefill_ms);
    resp->set_queue_ms(std::max(0.0, ttft - prefill_ms - job.onboard_ms));
    Finish(job, grpc::Status::OK);
  }

  KvConnector* c_;
  SimOptions o_;
  HandlerFence fence_;
  std::mutex id_mu_;
  std::string worker_id_;  // guarded by id_mu_
  const Clock::time_point started_ = Clock::now();
  std::atomic<uint64_t> next_id_{1ull << 62}, requests_{0}, verified_{0}, mismatched_{0};
  std::atomic<int64_t> running_{0};
  std::atomic<uint64_t> queued_tokens_{0};
  // The engine: waiting jobs by (arrival, request id), guarded by mu_; its
  // clock (simulated ms), touched by its thread only.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<double, uint64_t>, std::shared_ptr<Job>> waiting_;
  // Loads under way: when each started (simulated ms), and the tokens its
  // request is expected to compute.
  // Requests being looked up or loaded (Job::load_from: since when).
  std::set<const Job*> loading_jobs_;
  // The engine's clock after its last prefill (clock_ms_, for heartbeats).
  std::atomic<double> busy_until_{std::numeric_limits<double>::lowest()};
  Clock::time_point origin_;  // simulated time 0 in real time
  bool have_origin_ = false;
  bool stop_ = false;
  double clock_ms_ = std::numeric_limits<double>::lowest();
  std::thread engine_;
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
  AddTlsFlags(flags, &tls, /*serves=*/true, /*dials=*/true);
  ParseFlagsOrExit(flags, argc, argv);
  sim.reorder_window = std::chrono::microseconds(sim.time_scale > 0 ? reorder_ms * 1000 : 0);
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
    std::fprintf(stderr, "kvtier-sim-worker: %s\n",
                 std::string(started.status().message()).c_str());
    return 1;
  }
  grpc::Server* server = started->server.get();
  const std::string bound = started->address();
  if (worker_id.empty()) worker_id = "sim-worker@" + bound;
  service->SetWorkerId(worker_id);
  if (endpoint.empty()) endpoint = bound;
  std::vector<std::string> router_list;
  for (absl::string_view r : absl::StrSplit(routers, ',', absl::SkipEmpty()))
    router_list.emplace_back(r);
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
    fanout = std::make_unique<RouterFanout>(
        router_list, po, [svc] { return svc->Load(); }, router_refresh_ms);
  }
  std::vector<BlockEventSink*> pubs;
  if (fanout) pubs.push_back(fanout.get());
  connector->SetPublishers(pubs);
  Log("sim-worker", worker_id, " listening on ", bound, " (namespace ",
      NamespaceName(connector->namespace_id()), ", ", pages, " pages of ", connector->block_bytes(),
      " bytes, offload ", offload, ", ", co.stores.size(), " store(s), ", pubs.size(),
      " router(s))");
  kvtier::AnnounceListening("kvtier-sim-worker", *started, "", port_file);
  kvtier::ServeUntilSignalled(server, "sim-worker");
  service->Quiesce();
  // Publishers first: their heartbeats read the service's load; then the
  // engine, which uses the connector.
  if (fanout) fanout->Stop();
  service.reset();
  connector.reset();
  Log("sim-worker", "stopped");
  return 0;
}
