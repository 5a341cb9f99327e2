// TransferLanes (transfer_lanes.h, which states its guarantees): the job
// queue and the lane threads' loop.
#include "client/transfer_lanes.h"

namespace kvtier {

TransferLanes::TransferLanes(size_t lanes, uint64_t max_inflight_bytes)
    : lane_count_(lanes), max_inflight_bytes_(max_inflight_bytes) {
  threads_.reserve(lanes);
  for (size_t i = 0; i < lanes; ++i) threads_.emplace_back([this, i] { Run(i); });
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

void TransferLanes::Submit(uint64_t bytes, Job job) {
  std::unique_lock lk(mu_);
  // Back-pressure: wait for room unless nothing is in flight (an operation
  // larger than the bound still runs, alone).
  space_cv_.wait(lk, [&] {
    return stop_ || inflight_bytes_ == 0 || inflight_bytes_ + bytes <= max_inflight_bytes_;
  });
  inflight_bytes_ += bytes;
  jobs_.emplace_back(bytes, std::move(job));
  job_cv_.notify_one();
}

void TransferLanes::Run(size_t lane) {
  for (;;) {
    std::pair<uint64_t, Job> job;
    {
      std::unique_lock lk(mu_);
      // Jobs queued before Stop still run: each one owes its caller an answer.
      job_cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job.second(lane);
    {
      std::lock_guard lk(mu_);
      inflight_bytes_ -= job.first;
    }
    space_cv_.notify_all();
  }
}

}  // namespace kvtier
