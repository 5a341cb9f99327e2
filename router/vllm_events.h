// vLLM's own KV events, fed to the router (docs/router.md, "vLLM's KV
// events"). A vLLM engine started with --kv-events-config publishes, on a
// ZeroMQ PUB socket, one message per engine step: [topic, seq (8 bytes,
// big-endian), msgpack KVEventBatch], where the batch is [ts, events,
// data_parallel_rank] and each event a BlockStored, BlockRemoved or
// AllBlocksCleared -- a positional array (tag first) up to vLLM 0.23, a map
// with "type" since. Its ROUTER replay socket answers [empty, start seq]
// with the batches it still holds from that seq and an end marker (seq -1,
// empty payload).
//
// vLLM's block hashes are its own (SHA-256 of a pickle, salted per
// process), so the router maps them to kvtier's: BlockStored carries the
// blocks' token ids and its parent's vLLM hash, and kvtier's chain hash of
// the same tokens from the parent's kvtier hash is what the router
// indexes. A source keeps vLLM hash -> kvtier hash for the blocks the
// engine holds.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/block_key.h"

namespace kvtier::router {

class RouterCore;

// One vLLM engine the router subscribes to.
struct VllmSourceSpec {
  std::string id;        // its source id (the worker id routes name)
  std::string endpoint;  // what routes return for it (its API's host:port)
  std::string events;    // ZeroMQ PUB endpoint, e.g. tcp://10.0.0.5:5557
  std::string replay;    // ZeroMQ ROUTER replay endpoint ("" : none)
  std::string topic;     // subscription prefix ("" : every topic)
  uint64_t namespace_id = 0;
  uint32_t block_tokens = 0;  // must equal the engine's --block-size
};

// One spec per non-empty, non-# line: comma-separated key=value with keys
// id, endpoint, events, replay, topic, namespace (16 hex digits) and
// block-tokens. INVALID_ARGUMENT naming the line and the key.
absl::StatusOr<std::vector<VllmSourceSpec>> ParseVllmSources(absl::string_view text);

struct VllmEvent {
  enum Kind { kStored, kRemoved, kCleared } kind = kStored;
  std::vector<uint64_t> hashes;     // normalised to 64 bits (see DecodeVllmBatch)
  std::optional<uint64_t> parent;   // BlockStored: the parent block's hash, if any
  std::vector<uint32_t> token_ids;  // BlockStored
  uint32_t block_size = 0;          // BlockStored
  // Non-empty when the router cannot map the event's blocks to kvtier's
  // (a LoRA adapter, extra keys such as a cache salt or multimodal inputs,
  // another KV group or attention kind, a medium other than the GPU).
  std::string skip_reason;
};

struct VllmBatch {
  double ts = 0;
  std::vector<VllmEvent> events;
};

// Decodes one payload frame. Hashes arrive as msgpack unsigned ints (vLLM's
// default), negative ints (Python's hash() in early versions: two's
// complement) or bytes (the whole digest: its last 8 bytes, big-endian).
// Events are read one by one: one the router cannot use is kept with its
// skip_reason ("malformed: ..." when its fields are of the wrong shape) and
// the rest of the batch applies. INVALID_ARGUMENT saying what was wrong
// only for a payload that is not a KVEventBatch at all.
absl::StatusOr<VllmBatch> DecodeVllmBatch(absl::string_view payload);

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
class VllmChainMap {
 public:
  VllmChainMap(uint64_t namespace_id, uint32_t block_tokens)
      : ns_(namespace_id), block_tokens_(block_tokens) {}
  // The kvtier hashes an event stores or removes (a stored block whose
  // parent is unknown, and those after it, are counted and left out; an
  // event with a skip_reason, another block size or not block_tokens token
  // ids per hash maps nothing and counts its hashes as skipped).
  std::vector<BlockHash> Stored(const VllmEvent& e, VllmSourceStats* stats);
  std::vector<BlockHash> Removed(const VllmEvent& e, VllmSourceStats* stats);
  void Clear() { map_.clear(); }
  size_t size() const { return map_.size(); }
  template <class F>  // f(const BlockHash&) for every mapped block
  void ForEach(F f) const {
    for (const auto& [vllm, kvtier] : map_) f(kvtier);
  }

 private:
  uint64_t ns_;
  uint32_t block_tokens_;
  absl::flat_hash_map<uint64_t, BlockHash> map_;
};

// Subscribes to one engine and feeds `core` as a worker source: a hello and
// an empty snapshot, then its events with the source's own sequence
// numbers, and a heartbeat a second (vLLM reports no load: the router
// counts what it routed there since). A gap in vLLM's sequence is filled
// from the replay socket; when it cannot be (no replay socket, the batches
// gone, a malformed message) the source resyncs: the router forgets the
// engine's blocks and replays what the engine's buffer holds. A sequence
// back at 0, or over 10,000 behind the last applied, is an engine restart.
// Nothing a peer sends can crash it.
class VllmEventSource {
 public:
  VllmEventSource(VllmSourceSpec spec, RouterCore* core);
  ~VllmEventSource();  // stops the thread
  VllmSourceStats stats() const;
  const VllmSourceSpec& spec() const { return spec_; }

 private:
  struct Impl;
  VllmSourceSpec spec_;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
};

}  // namespace kvtier::router
