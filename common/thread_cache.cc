// ThreadCache (thread_cache.h, which states its guarantees).
#include "common/thread_cache.h"

#include <chrono>
#include <system_error>

namespace kvtier {

ThreadCache::~ThreadCache() {
  std::unique_lock lk(mu_);
  stop_ = true;
  cv_.notify_all();
  // Queued tasks still run: each owes its caller a result.
  done_cv_.wait(lk, [&] { return live_ == 0; });
}

void ThreadCache::Post(std::function<void()> task) {
  std::unique_lock lk(mu_);
  tasks_.push_back(std::move(task));
  if (idle_ >= tasks_.size()) {
    cv_.notify_one();
    return;
  }
  // Every idle thread has a task already: one more thread. Detached: an
  // ended thread leaves nothing behind, and the destructor waits on live_.
  ++live_;
  try {
    std::thread([this] { Loop(); }).detach();
  } catch (const std::system_error&) {
    // No thread to be had (EAGAIN): run the task here, now, rather than
    // leave it queued with no thread to come.
    --live_;
    auto mine = std::move(tasks_.back());
    tasks_.pop_back();
    lk.unlock();
    mine();
  }
}

void ThreadCache::Loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    if (tasks_.empty()) {
      ++idle_;
      const bool woke = cv_.wait_for(lk, std::chrono::milliseconds(idle_ms_),
                                     [&] { return stop_ || !tasks_.empty(); });
      --idle_;
      // Idle too long, or stopping with nothing queued: end.
      if (!woke || tasks_.empty()) {
        if (--live_ == 0) done_cv_.notify_all();
        return;
      }
    }
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    lk.unlock();
    task();
    lk.lock();
  }
}

}  // namespace kvtier
