// The simulated engine of kvtier-sim-worker, served as kvtier.v1.SimWorker
// (see the class comment). Its options are kvtier-sim-worker's flags.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "common/rpc/grpc_server.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "worker/connector.h"
#include "worker/worker_server.h"

namespace kvtier::worker {

using Clock = std::chrono::steady_clock;
inline double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct SimOptions {
  bool packed = false;  // kv_wire int8: onboarded bytes are the model's after pack + unpack
  double prefill_tokens_per_s = 10000;
  double decode_ms_per_token = 20;
  double time_scale = 0;  // real seconds slept per simulated second of prefill
  // How long (real time) the engine waits for requests ready before the
  // one it would take next that may still be on their way.
  std::chrono::microseconds reorder_window{0};
  // How long a heartbeat lists a request that arrived: at least three of
  // its periods, so every heartbeat stream sees it (docs/router.md, "In flight").
  std::chrono::milliseconds arrivals_listed_for{250};
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
// schedules threads never enters a request's times. A request delivered
// later than its arrival plus the reorder window (the caller's threads or
// the RPC held up by the host) is run as soon as it arrives and is not
// charged the simulated time that passed meanwhile.
class SimWorkerService final : public WorkerEngine {
 public:
  SimWorkerService(KvConnector* c, SimOptions o);
  ~SimWorkerService() override;

  // Load for heartbeats.
  v1::Heartbeat Load() override;

  absl::Status Submit(const SubmitPrompt& p, v1::SubmitResponse* resp) override;

  // Its id towards routers, known once it serves (it may name the port).
  void SetWorkerId(std::string id) {
    std::lock_guard lk(id_mu_);
    worker_id_ = std::move(id);
  }

  absl::Status Stats(v1::GetWorkerStatsResponse* resp) override;

  // Leaving (SIGTERM): from now on heartbeats say draining (routers send
  // nothing new) and Submit answers UNAVAILABLE, so a caller tries
  // another engine; requests already taken run to their end.
  void StartDraining() { draining_ = true; }
  // Waits until no request is in flight, at most until `deadline`; the
  // requests still in flight then (0: none).
  int64_t WaitIdle(Clock::time_point deadline) const;

 private:
  struct Job {
    enum State { kWaiting, kDone } state = kWaiting;
    uint64_t id = 0, prompt = 0, queued_tokens = 0;
    uint64_t caller_id = 0;  // the request id its caller gave (0: none)
    uint32_t output_tokens = 0;
    std::optional<uint32_t> store_hint;  // SubmitRequest.store_hint_blocks
    std::vector<BlockHash> chain;
    double arrival = 0;          // simulated ms
    double ready = 0;            // when it can next be scheduled, simulated ms
    Clock::time_point received;  // real: when it joined the waiting queue
    // Simulated ms by which it reached the engine after its arrival came in
    // real time, past the reorder window: the caller's delivery, charged to
    // no request (at time_scale 1/s a real ms would count s simulated ones).
    double late_ms = 0;
    bool looked_up = false;
    KvConnector::Match match;
    uint32_t loaded = 0;
    double onboard_ms = 0;  // real: lookup and load
    double load_from = 0;   // simulated ms: when its load started
    // Guarded by mu_: the blocks its lookup found (GPU and store) while
    // they load, which it will not compute.
    uint32_t found_blocks = 0;
    v1::SubmitResponse* resp = nullptr;
    absl::Status status;
  };

  // Tokens a request is expected to compute: its prompt after what the GPU
  // pages hold now (or it is loading) and the blocks of `earlier`, the requests the engine
  // runs before it (it matches the pages again when it runs a request, so
  // a request queued behind another with the same prefix computes only
  // what follows that prefix).
  uint64_t ExpectedPrefill(const Job& job,
                           const absl::flat_hash_set<BlockHash, BlockHashHasher>& earlier) const {
    size_t held = std::max<size_t>(c_->pool().Match(job.chain), job.found_blocks);
    while (held < job.chain.size() && earlier.contains(job.chain[held])) ++held;
    const uint64_t cached = uint64_t{held} * c_->block_tokens();
    return job.prompt - std::min(job.prompt, cached);
  }

  // The engine's backlog in prefill tokens at the present moment of
  // simulated time: the rest of what it booked, and what the requests
  // waiting for it (or loading) are expected to compute (ExpectedPrefill),
  // first come first served from their ready times. The requests the real process holds
  // (queued_tokens_) are not it: a request waits in real time for the
  // reorder window, and the process may lag its simulation.
  uint64_t SimulatedBacklog() const;

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
    if (job->looked_up) {
      loading_jobs_.erase(job.get());  // (heartbeats never see it in neither)
    } else {
      NoteArrivalLocked(job->caller_id);
    }
    waiting_.emplace(std::make_pair(job->arrival, job->id), job);
    cv_.notify_all();
  }

  // A request joined the backlog (mu_ held, in the same hold that makes
  // it part of the backlog): heartbeats list its id for a while.
  void NoteArrivalLocked(uint64_t id) {
    if (id == 0) return;
    arrivals_.emplace_back(Clock::now(), id);
    if (arrivals_.size() > kArrivalsListed) arrivals_.pop_front();
  }
  // The ids of the requests that joined the backlog in the last
  // SimOptions::arrivals_listed_for (at most kArrivalsListed).
  std::vector<uint64_t> RecentArrivals();
  static constexpr size_t kArrivalsListed = 4096;

  // Ends a job: its answer is in job.resp (or job.status).
  void Finish(Job& job, absl::Status status) {
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
  absl::Status Onboard(Job& job);

  void EngineLoop();

  // Simulated milliseconds the engine takes to prefill `tokens`.
  double ComputeMs(uint64_t tokens) const {
    return 1000.0 * static_cast<double>(tokens) / o_.prefill_tokens_per_s;
  }

  // The engine takes the job: looks it up (the first time), sends it to
  // load, or computes it.
  void Schedule(Job& job);

  KvConnector* c_;
  SimOptions o_;
  std::mutex id_mu_;
  std::string worker_id_;  // guarded by id_mu_
  const Clock::time_point started_ = Clock::now();
  std::atomic<uint64_t> next_id_{1ull << 62}, requests_{0}, verified_{0}, mismatched_{0};
  std::atomic<int64_t> running_{0};
  std::atomic<bool> draining_{false};
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
  std::deque<std::pair<Clock::time_point, uint64_t>> arrivals_;  // guarded by mu_
  // Guarded by mu_: the request the engine took and has not booked yet
  // (out of waiting_, its prefill not in busy_until_): the backlog counts it.
  const Job* scheduling_ = nullptr;
  bool stop_ = false;
  double clock_ms_ = std::numeric_limits<double>::lowest();
  std::thread engine_;
};

}  // namespace kvtier::worker
