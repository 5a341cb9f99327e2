#include "cachestore/write_back_queue.h"

#include <chrono>

namespace kvtier::store {

WriteBackQueue::WriteBackQueue(uint64_t max_bytes, Callbacks callbacks)
    : max_bytes_(max_bytes), cb_(std::move(callbacks)) {
  writer_ = std::thread([this] { WriterLoop(); });
}

WriteBackQueue::~WriteBackQueue() { Stop(); }

void WriteBackQueue::Stop() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

WriteBackQueue::PushResult WriteBackQueue::Push(const BlockKey& key, const uint8_t* data,
                                                uint64_t length, uint64_t checksum) {
  std::lock_guard lk(mu_);
  if (pending_.count(key)) return PushResult::kAlreadyQueued;
  if (stop_ || bytes_ + length > max_bytes_) return PushResult::kFull;
  auto b = std::make_shared<Block>(
      Block{key, std::string(reinterpret_cast<const char*>(data), length), checksum});
  bytes_ += length;
  pending_[key] = b;
  fifo_.push_back(std::move(b));
  cv_.notify_one();
  return PushResult::kQueued;
}

std::shared_ptr<const WriteBackQueue::Block> WriteBackQueue::Find(const BlockKey& key) const {
  std::lock_guard lk(mu_);
  auto it = pending_.find(key);
  return it == pending_.end() ? nullptr : it->second;
}

bool WriteBackQueue::Contains(const BlockKey& key) const {
  std::lock_guard lk(mu_);
  return pending_.count(key) > 0;
}

void WriteBackQueue::Erase(const std::vector<BlockKey>& keys, std::vector<BlockKey>* gone) {
  std::lock_guard lk(mu_);
  for (const auto& k : keys) {
    if (pending_.erase(k)) gone->push_back(k);
  }
}

std::vector<BlockKey> WriteBackQueue::Keys(const uint64_t* ns) const {
  std::lock_guard lk(mu_);
  std::vector<BlockKey> out;
  for (const auto& [k, b] : pending_) {
    if (!ns || k.ns == *ns) out.push_back(k);
  }
  return out;
}

void WriteBackQueue::set_paused(bool paused) {
  {
    std::lock_guard lk(mu_);
    paused_ = paused;
  }
  cv_.notify_all();
}

void WriteBackQueue::WriterLoop() {
  for (;;) {
    std::shared_ptr<Block> b;
    {
      std::unique_lock lk(mu_);
      while (!stop_ && fifo_.empty()) {
        if (!paused_) {
          cv_.wait(lk);
          continue;
        }
        // Paused for want of space: look again twice a second, so the tier
        // recovers when space returns even if nothing is being demoted.
        if (cv_.wait_for(lk, std::chrono::milliseconds(500)) == std::cv_status::timeout &&
            cb_.try_resume()) {
          paused_ = false;
        }
      }
      if (fifo_.empty()) return;  // stopping and drained
      b = std::move(fifo_.front());
      fifo_.pop_front();
      auto it = pending_.find(b->key);
      if (it == pending_.end() || it->second != b) {  // erased while queued
        bytes_ -= b->bytes.size();
        if (fifo_.empty()) idle_cv_.notify_all();
        continue;
      }
      writing_ = true;
    }
    absl::Status s = cb_.write(*b);
    bool erased_meanwhile;
    {
      std::lock_guard lk(mu_);
      auto it = pending_.find(b->key);
      erased_meanwhile = it == pending_.end();
      if (!erased_meanwhile && it->second == b) pending_.erase(it);
    }
    // An operator erased the block while it was being written (found
    // queued, not yet stored): it must not stay on disk.
    if (s.ok() && erased_meanwhile) cb_.unwrite(b->key);
    std::lock_guard lk(mu_);
    bytes_ -= b->bytes.size();
    writing_ = false;
    if (fifo_.empty()) idle_cv_.notify_all();
  }
}

void WriteBackQueue::WaitIdle() {
  std::unique_lock lk(mu_);
  idle_cv_.wait(lk, [&] { return fifo_.empty() && !writing_; });
}

uint64_t WriteBackQueue::blocks() const {
  std::lock_guard lk(mu_);
  return fifo_.size() + (writing_ ? 1 : 0);
}

uint64_t WriteBackQueue::bytes() const {
  std::lock_guard lk(mu_);
  return bytes_;
}

}  // namespace kvtier::store
