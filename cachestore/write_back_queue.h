// The disk tier's write-back queue: copies of blocks RAM evicted, waiting
// for one writer thread to store them, oldest first.
//
// Bounded in bytes: a block that does not fit is refused and the caller
// counts the drop. Queued blocks stay readable (Find) and erasable until
// written; a block erased while being written is undone after the write
// (Callbacks::unwrite), so an operator's evict always wins. While paused
// (the filesystem is short of space) the writer drops nothing itself: it
// asks try_resume twice a second once the queue is empty.
// Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "common/block_key.h"

namespace kvtier::store {

class WriteBackQueue {
 public:
  struct Block {
    BlockKey key;
    std::string bytes;
    uint64_t checksum;
  };
  struct Callbacks {
    // Stores one block; runs on the writer thread, one block at a time.
    std::function<absl::Status(const Block&)> write;
    // Removes a block that write stored although it was erased meanwhile.
    std::function<void(const BlockKey&)> unwrite;
    // While paused and idle, every 500 ms: true when writes may resume.
    std::function<bool()> try_resume;
  };
  enum class PushResult { kQueued, kAlreadyQueued, kFull };

  // Starts the writer thread.
  WriteBackQueue(uint64_t max_bytes, Callbacks callbacks);
  // Writes everything still queued, then stops the writer. Idempotent; the
  // owner calls it while everything the callbacks use is still alive.
  void Stop();
  // Stop().
  ~WriteBackQueue();

  // Copies the block in. kFull past the byte bound or while stopping.
  PushResult Push(const BlockKey& key, const uint8_t* data, uint64_t length, uint64_t checksum);
  // The queued block, or null. The block stays valid while it is held.
  std::shared_ptr<const Block> Find(const BlockKey& key) const;
  bool Contains(const BlockKey& key) const;
  // Takes the named blocks out of the queue (a block being written is
  // undone after its write); appends each one taken to *gone.
  void Erase(const std::vector<BlockKey>& keys, std::vector<BlockKey>* gone);
  // Keys of queued blocks; of one namespace when ns is given.
  std::vector<BlockKey> Keys(const uint64_t* ns = nullptr) const;

  // Pausing wakes the writer, so it starts asking try_resume even when the
  // pause came from a write outside the queue.
  void set_paused(bool paused);
  bool paused() const { return paused_; }

  // Blocks until nothing is queued or being written.
  void WaitIdle();
  uint64_t blocks() const;  // queued or being written
  uint64_t bytes() const;

 private:
  void WriterLoop();

  const uint64_t max_bytes_;
  const Callbacks cb_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::shared_ptr<Block>> fifo_;
  std::unordered_map<BlockKey, std::shared_ptr<Block>, BlockKeyHasher> pending_;
  uint64_t bytes_ = 0;
  bool writing_ = false;
  bool stop_ = false;
  std::atomic<bool> paused_{false};
  std::thread writer_;
};

}  // namespace kvtier::store
