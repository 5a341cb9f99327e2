// Runs tasks on threads it keeps: a task goes to an idle thread if there is
// one, else to a new thread, and a thread that finishes waits up to
// idle_ms for its next task before it ends. No bound on threads (each task
// runs at once, as with std::async), but no thread is created per task in a
// steady stream: creating one costs 0.05-2 ms on a busy machine, which is
// more than a small load's whole transfer (docs/dataplane.md).
//
// Thread-safe. The destructor waits for running tasks and ends the threads.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace kvtier {

class ThreadCache {
 public:
  explicit ThreadCache(int idle_ms = 5000) : idle_ms_(idle_ms) {}
  ~ThreadCache();
  ThreadCache(const ThreadCache&) = delete;
  ThreadCache& operator=(const ThreadCache&) = delete;

  // Runs fn() on a cached or new thread; its result comes through the future.
  template <typename Fn>
  auto Run(Fn fn) -> std::future<std::invoke_result_t<Fn&>> {
    using R = std::invoke_result_t<Fn&>;
    auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
    auto future = task->get_future();
    Post([task] { (*task)(); });
    return future;
  }

  // Threads waiting for a task now.
  size_t idle() {
    std::lock_guard lk(mu_);
    return idle_;
  }

 private:
  void Post(std::function<void()> task);
  void Loop();

  const int idle_ms_;
  std::mutex mu_;
  std::condition_variable cv_;               // a task was posted, or stop
  std::condition_variable done_cv_;          // a thread ended
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  size_t idle_ = 0;                          // threads waiting for a task; guarded by mu_
  size_t live_ = 0;    // threads running (detached; the destructor waits for 0); guarded by mu_
  bool stop_ = false;  // guarded by mu_
};

}  // namespace kvtier
