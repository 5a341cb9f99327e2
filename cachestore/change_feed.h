// What the store tells the outside about its contents: a block entered the
// store (Stored), or left every tier (Removed). The store knows only the
// ChangeSink interface; kvtier-store's main wires a sink that publishes to
// routers (router_sink.h), tests wire their own.
//
// ChangeFeed sits between the tiers and the sink: the tiers' change
// listeners only queue (they run under tier locks), and one thread turns the
// queue into batches per namespace, checks that a block leaving one tier has
// left every tier before reporting it removed, and calls the sink. The sink
// is thus never called under a tier lock. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "cachestore/tier.h"
#include "common/block_key.h"

namespace kvtier::store {

class ChangeSink {
 public:
  virtual ~ChangeSink() = default;
  // Called from one thread at a time, with the blocks of one namespace.
  virtual void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) = 0;
  virtual void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) = 0;
};

class ChangeFeed {
 public:
  // present(key): whether the block is still in some tier. Starts the
  // thread. sink must outlive the feed.
  ChangeFeed(ChangeSink* sink, std::function<bool(const BlockKey&)> present);
  // Delivers what is queued, then stops.
  ~ChangeFeed();

  // Quick; safe under a tier's lock.
  void Add(const BlockKey& key, bool added);
  // A tier change listener that calls Add.
  ChangeListener Listener() {
    return [this](const BlockKey& k, bool added) { Add(k, added); };
  }

 private:
  void Loop();

  ChangeSink* sink_;
  std::function<bool(const BlockKey&)> present_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<BlockKey, bool>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace kvtier::store
