// vLLM's block hashes are its own (SHA-256 of a pickle, salted per
// process), so the router maps them to kvtier's: BlockStored carries the
// blocks' token ids and its parent's vLLM hash, and kvtier's chain hash of
// the same tokens from the parent's kvtier hash is what the router indexes.
// A map keeps vLLM hash -> kvtier hash for the blocks the engine holds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/block_key.h"
#include "router/source_messages.h"
#include "router/vllm_batch.h"

namespace kvtier::router {

// What one engine's subscriber did and met, counted.
struct VllmSourceStats {
  uint64_t batches = 0, events = 0, blocks_stored = 0, blocks_removed = 0;
  uint64_t malformed = 0, gaps = 0, replays = 0, resyncs = 0, out_of_order = 0;
  uint64_t unknown_parents = 0, skipped = 0, restarts = 0;
  // Events left out one by one (their batch still applies): every skipped
  // event (another medium, group, kind, adapter, an unknown type), and of
  // those the ones whose fields were of the wrong shape. `skipped` counts
  // their blocks; `malformed` counts whole batches that could not be read.
  uint64_t skipped_events = 0, malformed_events = 0;
  // Hellos the router refused (the engine is then out of routing until one
  // succeeds: retried every second), and snapshot chunks it refused (the
  // source registers again).
  uint64_t hello_failures = 0, snapshot_failures = 0;
  // f(name, value) for every counter, named as GetRouterStats.vllm_events.
  template <class F>
  void ForEach(F f) const {
    f("batches", batches), f("events", events), f("blocks_stored", blocks_stored);
    f("blocks_removed", blocks_removed), f("malformed", malformed), f("gaps", gaps);
    f("replays", replays), f("resyncs", resyncs), f("out_of_order", out_of_order);
    f("unknown_parents", unknown_parents), f("skipped", skipped), f("restarts", restarts);
    f("skipped_events", skipped_events), f("malformed_events", malformed_events);
    f("hello_failures", hello_failures), f("snapshot_failures", snapshot_failures);
  }
};

// Maps one engine's vLLM hashes to kvtier's. Not thread-safe.
//
// A block counts as the engine's while any of its media holds it: the GPU,
// or an offloading tier of its own (vLLM's CPU or disk offloading), from
// which the engine loads it without recomputing; the fastest of them is
// what a route prices it at (Moved). One KV cache group is
// indexed: the first full-attention group a BlockStored names (a hybrid
// model's sliding-window groups are left out by the decoder); the events of
// other groups are skipped and counted.
class VllmChainMap {
 public:
  // Blocks the engine still holds whose fastest medium changed, and to what.
  using Moved = std::vector<std::pair<BlockHash, Medium>>;

  VllmChainMap(uint64_t namespace_id, uint32_t block_tokens)
      : ns_(namespace_id), block_tokens_(block_tokens) {}
  // The kvtier hashes an event stores: blocks new to the engine (a stored
  // block whose parent is unknown, and those after it, are counted and left
  // out; an event with a skip_reason, another block size or not
  // block_tokens token ids per hash maps nothing and counts its hashes as
  // skipped). A chain without a parent is rooted at the event's variant.
  // The blocks it holds whose fastest medium changed go to `moved` (a new
  // block counts as moved from the GPU).
  std::vector<BlockHash> Stored(const VllmEvent& e, VllmSourceStats* stats, Moved* moved = nullptr);
  // The kvtier hashes no medium of the engine holds any more; those some
  // medium still holds, whose fastest changed, go to `moved`.
  std::vector<BlockHash> Removed(const VllmEvent& e, VllmSourceStats* stats,
                                 Moved* moved = nullptr);
  void Clear() {
    map_.clear();
    group_.reset();
  }
  size_t size() const { return map_.size(); }
  template <class F>  // f(const BlockHash&, Medium fastest) for every mapped block
  void ForEach(F f) const {
    for (const auto& [vllm, held] : map_) f(held.hash, Fastest(held.media));
  }

 private:
  struct Held {
    BlockHash hash;
    uint8_t media = 0;  // a bit per medium holding it (MediumBit)
  };
  static uint8_t MediumBit(const std::string& medium);
  static Medium Fastest(uint8_t media) {
    return (media & 1) != 0 ? Medium::kGpu : (media & 2) != 0 ? Medium::kCpu : Medium::kDisk;
  }
  // Sets `held`'s media, noting a change of its fastest in `moved`.
  static void Place(Held& held, uint8_t media, Moved* moved);
  bool OtherGroup(const VllmEvent& e);

  uint64_t ns_;
  uint32_t block_tokens_;
  std::optional<uint32_t> group_;  // the group indexed, once one is named
  absl::flat_hash_map<uint64_t, Held> map_;
};

}  // namespace kvtier::router
