#include "cachestore/change_feed.h"

#include <map>

namespace kvtier::store {

ChangeFeed::ChangeFeed(ChangeSink* sink, std::function<bool(const BlockKey&)> present)
    : sink_(sink), present_(std::move(present)) {
  thread_ = std::thread([this] { Loop(); });
}

ChangeFeed::~ChangeFeed() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ChangeFeed::Add(const BlockKey& key, bool added) {
  std::lock_guard lk(mu_);
  queue_.emplace_back(key, added);
  cv_.notify_one();
}

void ChangeFeed::Loop() {
  std::vector<std::pair<BlockKey, bool>> batch;
  for (;;) {
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      batch.swap(queue_);
    }
    std::map<uint64_t, std::vector<BlockHash>> stored, removed;
    for (const auto& [k, added] : batch) {
      if (added)
        stored[k.ns].push_back(k.hash);
      else if (!present_(k))
        removed[k.ns].push_back(k.hash);  // gone from every tier
    }
    batch.clear();
    for (const auto& [ns, hs] : stored) sink_->Stored(ns, hs);
    for (const auto& [ns, hs] : removed) sink_->Removed(ns, hs);
  }
}

}  // namespace kvtier::store
