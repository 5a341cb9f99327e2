#include "worker/sim_engine.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"
#include "worker/model.h"

namespace kvtier::worker {

namespace {

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

}  // namespace

SimWorkerService::SimWorkerService(KvConnector* c, SimOptions o) : c_(c), o_(std::move(o)) {
  engine_ = std::thread([this] { EngineLoop(); });
}

SimWorkerService::~SimWorkerService() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  engine_.join();
}

v1::Heartbeat SimWorkerService::Load() {
  v1::Heartbeat h;
  h.set_running_requests(static_cast<uint32_t>(running_.load()));
  // Listed before the backlog is read: every request listed is in it (or done).
  const std::vector<uint64_t> arrived = RecentArrivals();
  h.mutable_arrived_request_ids()->Add(arrived.begin(), arrived.end());
  h.set_queued_prefill_tokens(o_.time_scale > 0 ? SimulatedBacklog() : queued_tokens_.load());
  h.set_free_gpu_pages(c_->stats().pool.free);
  // Its prefill rate in the clock the tier's costs are counted in: the
  // simulated engine takes a load's real milliseconds as simulated ones,
  // so the router weighs a fetch against simulated compute.
  h.set_prefill_tokens_per_s(o_.prefill_tokens_per_s);
  h.set_draining(draining_.load());
  return h;
}

int64_t SimWorkerService::WaitIdle(Clock::time_point deadline) const {
  while (running_.load() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return running_.load();
}

absl::Status SimWorkerService::Submit(const SubmitPrompt& p, v1::SubmitResponse* resp) {
  const auto delivered = Clock::now();
  auto job = std::make_shared<Job>();
  job->id = p.request_id ? p.request_id : next_id_++;
  job->caller_id = p.request_id;
  job->chain = p.prompt.chain;
  job->prompt = p.prompt.prompt_tokens;
  job->arrival = p.arrival_ms ? *p.arrival_ms : SimNow();
  job->ready = job->arrival;
  job->output_tokens = p.output_tokens;
  job->store_hint = p.store_hint_blocks;
  job->resp = resp;
  // Counted before draining_ is read: a drain that sees no request running
  // has every later Submit refused.
  running_++;
  if (draining_.load()) {
    running_--;
    return absl::UnavailableError(
        "this worker is draining (it is leaving the fleet): send the request to another worker");
  }
  // Until its lookup says how much it computes, the whole prompt counts
  // in the load routers see.
  queued_tokens_ += job->prompt;
  job->queued_tokens = job->prompt;
  {
    // Where simulated time 0 lies in real time: the earliest any request's
    // arrival maps to (the least delayed delivery tells it best).
    std::lock_guard lk(mu_);
    const auto origin =
        delivered - std::chrono::microseconds(static_cast<int64_t>(job->arrival * 1000 * Scale()));
    if (!have_origin_ || origin < origin_) origin_ = origin;
    have_origin_ = true;
    if (o_.time_scale > 0) {
      const double late_real_ms =
          std::chrono::duration<double, std::milli>(origin - origin_ - o_.reorder_window).count();
      job->late_ms = std::max(0.0, late_real_ms) / o_.time_scale;
    }
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
      NoteArrivalLocked(job->caller_id);
    }
    const absl::Status onboarded = Onboard(*job);
    if (!onboarded.ok()) {
      {
        std::lock_guard lk(mu_);
        loading_jobs_.erase(job.get());
      }
      cv_.notify_all();
      queued_tokens_ -= job->queued_tokens;
      running_--;
      return onboarded;
    }
    job->looked_up = true;
  }
  Enqueue(job);  // out of loading_jobs_ and into waiting_ in one hold
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return job->state == Job::kDone; });
  }
  queued_tokens_ -= job->queued_tokens;
  running_--;
  return job->status;
}

absl::Status SimWorkerService::Stats(v1::GetWorkerStatsResponse* resp) {
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
  return absl::OkStatus();
}

std::vector<uint64_t> SimWorkerService::RecentArrivals() {
  std::lock_guard lk(mu_);
  const auto cutoff = Clock::now() - o_.arrivals_listed_for;
  while (!arrivals_.empty() && arrivals_.front().first < cutoff) arrivals_.pop_front();
  std::vector<uint64_t> ids;
  ids.reserve(arrivals_.size());
  for (const auto& [when, id] : arrivals_) ids.push_back(id);
  return ids;
}

uint64_t SimWorkerService::SimulatedBacklog() const {
  std::lock_guard lk(mu_);
  if (!have_origin_) return 0;
  const double now =
      std::chrono::duration<double, std::milli>(Clock::now() - origin_).count() / Scale();
  double busy = busy_until_.load();
  double left_ms = std::max(0.0, busy - now);
  auto add = [&](double ready, uint64_t tokens) {
    const double start = std::max(busy, ready);
    busy = start + ComputeMs(tokens);
    left_ms += std::max(0.0, busy - std::max(start, now));
  };
  // In ready order: the waiting and the loading (ready at the earliest
  // when their load started).
  std::vector<std::pair<double, const Job*>> ahead;
  for (const auto& [key, j] : waiting_) ahead.emplace_back(j->ready, j.get());
  for (const Job* j : loading_jobs_) ahead.emplace_back(j->load_from, j);
  std::stable_sort(ahead.begin(), ahead.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  absl::flat_hash_set<BlockHash, BlockHashHasher> earlier;
  if (scheduling_ != nullptr) ahead.insert(ahead.begin(), {scheduling_->ready, scheduling_});
  for (const auto& [ready, j] : ahead) {
    add(ready, ExpectedPrefill(*j, earlier));
    earlier.insert(j->chain.begin(), j->chain.end());
  }
  return static_cast<uint64_t>(left_ms * o_.prefill_tokens_per_s / 1000.0);
}

absl::Status SimWorkerService::Onboard(Job& job) {
  const auto t = Clock::now();
  // The lookup may take as long as computing the whole prompt would (real
  // milliseconds count as simulated ones); a store slower than that, or
  // stalled, is given up on and the prompt computed.
  const auto budget =
      std::chrono::milliseconds(static_cast<int64_t>(std::ceil(ComputeMs(job.prompt))));
  auto m = c_->Begin(job.id, job.chain, budget, job.store_hint);
  if (!m.ok()) return m.status();
  job.match = *m;
  job.resp->set_store_lookup_skipped(m->lookup_skipped);
  {
    std::lock_guard lk(mu_);
    job.found_blocks = m->gpu_blocks + m->store_blocks;
  }
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

void SimWorkerService::EngineLoop() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !waiting_.empty(); });
    if (stop_) {
      for (auto& [key, job] : waiting_) {
        job->status = absl::UnavailableError("the worker is stopping");
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
    scheduling_ = job.get();
    lk.unlock();
    Schedule(*job);
    lk.lock();
    scheduling_ = nullptr;
  }
}

void SimWorkerService::Schedule(Job& job) {
  const uint32_t bt = c_->block_tokens();
  double now = std::max(clock_ms_, job.ready);
  if (!job.looked_up) {
    job.looked_up = true;
    // No store: matching the GPU pages is the engine's own bookkeeping.
    auto m = c_->Begin(job.id, job.chain);
    if (!m.ok()) return Finish(job, m.status());
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
  const uint64_t own = std::min<uint64_t>(uint64_t{job.match.gpu_blocks + more} * bt, job.prompt);
  const uint64_t cached =
      std::min<uint64_t>(uint64_t{job.match.gpu_blocks + job.loaded + more} * bt, job.prompt);
  uint64_t prefill = job.prompt - cached;
  // The request never waits on the tier: the engine, free for it from
  // `free_at` (it took nothing else while the lookup and load were out),
  // computes from then on, and the store's blocks shorten that only if
  // they arrive sooner than computing them would end (chunked prefill
  // that skips ahead to what landed). A slow or stalled store therefore
  // costs the request nothing beyond computing its prompt.
  bool computed_instead = false;
  if (job.onboard_ms > 0) {
    const double free_at = std::max(clock_ms_, job.load_from);
    if (free_at + ComputeMs(job.prompt - own) < now + ComputeMs(prefill)) {
      computed_instead = true;
      now = free_at;
      prefill = job.prompt - own;
      if (job.loaded > 0 && job.resp->load_status().empty()) {
        job.resp->set_load_status(
            "the store's blocks arrived after computing them would have ended: computed instead");
      }
    }
  }
  // Pages for the computed blocks; with every page held by requests
  // loading, the prompt is computed without caching its blocks.
  auto pages = c_->AllocateForCompute(job.id);
  if (!pages.ok() && pages.status().code() != absl::StatusCode::kResourceExhausted) {
    c_->Finished(job.id);
    return Finish(job, pages.status());
  }
  if (!pages.ok()) pages = std::vector<uint32_t>();
  const size_t first = job.match.gpu_blocks + job.loaded + more;
  for (size_t i = 0; i < pages->size(); ++i) {
    ComputeIntoPage(c_->pool().layout(), c_->pool().layer_bases(), (*pages)[i], c_->namespace_id(),
                    job.chain[first + i]);
  }
  const double prefill_ms = ComputeMs(prefill);
  queued_tokens_ -= job.queued_tokens - prefill;
  job.queued_tokens = prefill;
  clock_ms_ = now + prefill_ms;
  {
    std::lock_guard lk(mu_);
    busy_until_ = clock_ms_;
    scheduling_ = nullptr;  // booked: busy_until_ counts it
  }
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
  if (!saved.ok()) return Finish(job, saved);
  requests_++;
  verified_ += verified;
  mismatched_ += mismatched;
  v1::SubmitResponse* resp = job.resp;
  resp->set_prompt_tokens(job.prompt);
  resp->set_prefill_tokens(prefill);
  resp->set_gpu_hit_tokens(own);
  resp->set_onboarded_tokens(
      computed_instead
          ? 0
          : std::min<uint64_t>(uint64_t{job.loaded} * bt, job.prompt - resp->gpu_hit_tokens()));
  resp->set_verified_blocks(verified);
  resp->set_mismatched_blocks(mismatched);
  // What the tier added to its path (none when the engine computed instead).
  resp->set_onboard_ms(computed_instead ? 0 : job.onboard_ms);
  resp->set_decode_ms(o_.decode_ms_per_token * job.output_tokens);
  // TTFT in simulated time, from arrival to the prefill's end: onboarding
  // (real, as measured), the prefill, and the rest waiting for the engine.
  // Less the time the caller took to deliver it (Job::late_ms).
  const double ttft =
      std::max(clock_ms_ - job.arrival - job.late_ms, prefill_ms + resp->onboard_ms());
  resp->set_ttft_ms(ttft);
  resp->set_prefill_ms(prefill_ms);
  resp->set_queue_ms(std::max(0.0, ttft - prefill_ms - resp->onboard_ms()));
  resp->set_late_ms(job.late_ms);
  Finish(job, absl::OkStatus());
}

}  // namespace kvtier::worker
