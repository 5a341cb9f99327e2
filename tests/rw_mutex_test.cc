// WriterPreferringMutex: a waiting writer goes before readers that arrive
// after it, and readers share.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "common/rw_mutex.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

TEST(WriterPreferringMutex, ReadersShareAndAWaitingWriterGoesBeforeNewReaders) {
  WriterPreferringMutex mu;
  std::shared_lock first(mu);
  {
    // Readers share while no writer waits.
    std::shared_lock second(mu, std::try_to_lock);
    EXPECT_TRUE(second.owns_lock());
  }
  std::atomic<bool> writing{false};
  std::thread writer([&] {
    std::unique_lock w(mu);
    writing = true;
  });
  // Once the writer waits, a new reader is held back (std::shared_mutex on
  // glibc would let it in, and a stream of readers would starve the writer).
  bool held_back = false;
  for (auto until = std::chrono::steady_clock::now() + 5s;
       !held_back && std::chrono::steady_clock::now() < until;) {
    std::shared_lock late(mu, std::try_to_lock);
    held_back = !late.owns_lock();
    if (!held_back) std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(held_back) << "a reader got in ahead of the waiting writer";
  EXPECT_FALSE(writing) << "the writer went in while a reader held the lock";
  first.unlock();
  writer.join();
  EXPECT_TRUE(writing);
  std::unique_lock again(mu, std::try_to_lock);
  EXPECT_TRUE(again.owns_lock()) << "the writer released it";
}

}  // namespace
}  // namespace kvtier
