// A fixed set of lane threads that run submitted jobs in submission order,
// with back-pressure: the jobs queued or running weigh (in bytes) at most
// max_inflight_bytes together, and Submit blocks until a new one fits. A job
// is told which lane runs it, so its owner can keep per-lane state (the data
// client keeps a UCX worker and endpoint per lane) that only that lane's
// thread touches, without locks.
//
// Knows nothing of UCX or of what a job does. Thread-safe: Submit may be
// called from any thread. Returns no statuses: jobs report their own.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvtier {

class TransferLanes {
 public:
  // Runs on lane number `lane` (0 <= lane < lanes()).
  using Job = std::function<void(size_t lane)>;

  // Starts `lanes` threads (REQUIRES: lanes >= 1).
  TransferLanes(size_t lanes, uint64_t max_inflight_bytes);
  // Stop().
  ~TransferLanes();
  TransferLanes(const TransferLanes&) = delete;
  TransferLanes& operator=(const TransferLanes&) = delete;

  // Queues `job`, which weighs `bytes`. Blocks while it would take the jobs
  // in flight past the bound, unless none is in flight: a job heavier than
  // the bound still runs, alone.
  void Submit(uint64_t bytes, Job job);

  // Lets the lanes run every job already queued, then ends their threads.
  // Idempotent. For the owner, once no other thread submits: a job submitted
  // during or after Stop may never run.
  void Stop();

  size_t lanes() const { return lane_count_; }

 private:
  void Run(size_t lane);

  const size_t lane_count_;
  const uint64_t max_inflight_bytes_;

  std::mutex mu_;
  std::condition_variable job_cv_;    // a job was queued, or Stop
  std::condition_variable space_cv_;  // a job finished, or Stop
  std::deque<std::pair<uint64_t, Job>> jobs_;  // guarded by mu_
  uint64_t inflight_bytes_ = 0;                // queued + running; guarded by mu_
  bool stop_ = false;                          // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace kvtier
