// A fixed set of lane threads that run submitted jobs, with two classes of
// job: loads (on a request's critical path) and offloads (not). Loads never
// queue behind offloads:
//  * every lane takes the oldest queued load before any offload;
//  * `load_lanes` of the lanes take loads only, so a load waits for no
//    offload at all (only for loads ahead of it) when one of them is free;
//  * each class has its own back-pressure bound: the jobs of a class queued
//    or running weigh (in bytes) at most max_inflight_bytes together, and
//    Submit blocks until a new one fits, so megabytes of write-back never
//    hold a load's Submit.
// Within a class, jobs start in submission order. A job is told which lane
// runs it, so its owner can keep per-lane state (the data client keeps a UCX
// worker and endpoint per lane) that only that lane's thread touches,
// without locks.
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
  enum class Class { kLoad = 0, kOffload = 1 };

  // Starts `shared_lanes` threads that run both classes (loads first) and
  // `load_lanes` that run loads only. REQUIRES: shared_lanes >= 1.
  TransferLanes(size_t shared_lanes, size_t load_lanes, uint64_t max_inflight_bytes);
  // Stop().
  ~TransferLanes();
  TransferLanes(const TransferLanes&) = delete;
  TransferLanes& operator=(const TransferLanes&) = delete;

  // Queues `job` of class `c`, which weighs `bytes`. Blocks while it would
  // take the class's jobs in flight past the bound, unless none of the class
  // is in flight: a job heavier than the bound still runs, alone.
  void Submit(Class c, uint64_t bytes, Job job);

  // Lets the lanes run every job already queued, then ends their threads.
  // Idempotent. For the owner, once no other thread submits: a job submitted
  // during or after Stop may never run.
  void Stop();

  size_t lanes() const { return lane_count_; }
  // Lanes [0, shared_lanes()) run both classes; the rest run loads only.
  size_t shared_lanes() const { return shared_lanes_; }

 private:
  struct Queue {
    std::deque<std::pair<uint64_t, Job>> jobs;
    uint64_t inflight_bytes = 0;  // queued + running
  };
  void Run(size_t lane);

  const size_t shared_lanes_;
  const size_t lane_count_;
  const uint64_t max_inflight_bytes_;

  std::mutex mu_;
  std::condition_variable job_cv_;    // a job was queued, or Stop
  std::condition_variable space_cv_;  // a job finished, or Stop
  Queue queues_[2];                   // by Class; guarded by mu_
  bool stop_ = false;                 // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace kvtier
