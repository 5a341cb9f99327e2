// TransferLanes (transfer_lanes.h, which states its guarantees): the two job
// queues and the lane threads' loop.
#include "client/transfer_lanes.h"

namespace kvtier {

TransferLanes::TransferLanes(size_t shared_lanes, size_t load_lanes, uint64_t max_inflight_bytes)
    : shared_lanes_(shared_lanes),
      lane_count_(shared_lanes + load_lanes),
      max_inflight_bytes_(max_inflight_bytes) {
  threads_.reserve(lane_count_);
  for (size_t i = 0; i < lane_count_; ++i) threads_.emplace_back([this, i] { Run(i); });
}

TransferLanes::~TransferLanes() { Stop(); }

void TransferLanes::Stop() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  job_cv_.notify_all();
  space_cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void TransferLanes::Submit(Class c, uint64_t bytes, Job job) {
  std::unique_lock lk(mu_);
  Queue& q = queues_[static_cast<int>(c)];
  // Back-pressure: wait for room unless nothing of the class is in flight
  // (an operation larger than the bound still runs, alone).
  space_cv_.wait(lk, [&] {
    return stop_ || q.inflight_bytes == 0 || q.inflight_bytes + bytes <= max_inflight_bytes_;
  });
  q.inflight_bytes += bytes;
  q.jobs.emplace_back(bytes, std::move(job));
  // Every waiter: a load-only lane must not be the one woken for an offload.
  job_cv_.notify_all();
}

void TransferLanes::Run(size_t lane) {
  const bool loads_only = lane >= shared_lanes_;
  Queue& loads = queues_[static_cast<int>(Class::kLoad)];
  Queue& offloads = queues_[static_cast<int>(Class::kOffload)];
  for (;;) {
    std::pair<uint64_t, Job> job;
    Queue* from;
    {
      std::unique_lock lk(mu_);
      // Jobs queued before Stop still run: each one owes its caller an answer.
      job_cv_.wait(lk, [&] {
        return stop_ || !loads.jobs.empty() || (!loads_only && !offloads.jobs.empty());
      });
      from = !loads.jobs.empty() ? &loads : (loads_only ? nullptr : &offloads);
      if (from == nullptr || from->jobs.empty()) return;  // stopped, nothing left for this lane
      job = std::move(from->jobs.front());
      from->jobs.pop_front();
    }
    job.second(lane);
    {
      std::lock_guard lk(mu_);
      from->inflight_bytes -= job.first;
    }
    space_cv_.notify_all();
  }
}

}  // namespace kvtier
