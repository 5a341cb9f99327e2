// The page pool: an engine's paged KV cache (gpu/kv_layout.h layout) of a
// fixed number of pages, in host memory here (device memory in an engine),
// with block hash -> page, reference counts, and the unreferenced cached
// pages kept in LRU order as the hot set.
//
// A page is FREE, FILLING (allocated for a block being computed or loaded,
// not yet matchable), or CACHED (matchable). Referenced pages are never
// reclaimed. Allocate takes a free page or reclaims the least recently used
// unreferenced cached page, calling on_evict(hash, page) first, while its
// bytes are still intact, so they can be offloaded. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "common/block_key.h"
#include "gpu/kv_layout.h"

namespace kvtier::worker {

class PagePool {
 public:
  using EvictFn = std::function<void(const BlockHash& hash, uint32_t page)>;
  explicit PagePool(const gpu::KvLayout& layout);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  void SetEvictCallback(EvictFn fn) { on_evict_ = std::move(fn); }

  // Pages of the longest cached prefix of chain, each referenced once more.
  std::vector<uint32_t> MatchAndRef(const std::vector<BlockHash>& chain);
  // Length of the longest cached prefix (no references taken).
  size_t Match(const std::vector<BlockHash>& chain) const;
  // A referenced FILLING page for hash; nullopt if every page is referenced.
  std::optional<uint32_t> Allocate();
  // Makes a FILLING page CACHED under hash (matchable). If hash is already
  // cached on another page, this page is returned to the free list and the
  // existing page is referenced instead; the page to use is returned.
  uint32_t Commit(const BlockHash& hash, uint32_t page);
  // Gives back a FILLING page that was never committed.
  void Discard(uint32_t page);
  void Ref(uint32_t page);
  // Refs `page` if it still holds `hash` cached; false (nothing taken) if not.
  bool RefIfHolds(uint32_t page, const BlockHash& hash);
  // The last reference gone, a cached page becomes the most recently used:
  // unreference a chain's pages tail first so that eviction takes its tail.
  void Unref(uint32_t page);

  const gpu::KvLayout& layout() const { return layout_; }
  uint8_t* const* layer_bases() const { return bases_.data(); }
  // The whole pool's memory, layer by layer (for memory registration).
  std::vector<std::pair<uint8_t*, size_t>> regions() const;

  struct Counters {
    uint64_t free = 0, cached = 0, referenced = 0, evictions = 0;
  };
  // A cached block and what it is worth keeping: how many requests found
  // it (MatchAndRef) since it was cached, and its place in the LRU order
  // (0: the most recently used; referenced pages count as most recent).
  struct CachedBlock {
    BlockHash hash;
    uint32_t page = 0;
    uint32_t hits = 0;
    uint64_t recency = 0;
  };
  // Every cached block, most valuable first: by hits, then by recency. A
  // chain's earlier blocks have at least its later ones' hits (a match
  // takes the prefix) and are released after them (Unref tail first), so
  // a prefix ranks before what follows it.
  std::vector<CachedBlock> CachedByValue() const;
  Counters counters() const;

 private:
  enum class State : uint8_t { kFree, kFilling, kCached };
  struct Page {
    State state = State::kFree;
    uint32_t refs = 0;
    BlockHash hash;
    std::list<uint32_t>::iterator lru;
    bool in_lru = false;
    uint32_t hits = 0;  // MatchAndRef finds since it was cached
  };
  void RemoveFromLruLocked(Page& p);

  gpu::KvLayout layout_;
  std::vector<uint8_t*> bases_;
  EvictFn on_evict_;
  mutable std::mutex mu_;
  std::vector<Page> pages_;
  std::vector<uint32_t> free_;
  std::list<uint32_t> lru_;  // front = most recently used
  std::unordered_map<BlockHash, uint32_t, BlockHashHasher> index_;
  uint64_t evictions_ = 0;
};

}  // namespace kvtier::worker
