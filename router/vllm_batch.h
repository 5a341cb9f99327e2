// One message of vLLM's KV-event stream, decoded: a KVEventBatch (msgpack)
// of BlockStored, BlockRemoved and AllBlocksCleared events -- a positional
// array (tag first) up to vLLM 0.23, a map with "type" since.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier::router {

struct VllmEvent {
  enum Kind { kStored, kRemoved, kCleared } kind = kStored;
  std::vector<uint64_t> hashes;     // normalised to 64 bits (see DecodeVllmBatch)
  std::optional<uint64_t> parent;   // BlockStored: the parent block's hash, if any
  std::vector<uint32_t> token_ids;  // BlockStored
  uint32_t block_size = 0;          // BlockStored
  // Where the blocks are: "GPU" (also when the event names none), or an
  // offloading tier of the engine's own ("CPU", "STORAGE", ...).
  std::string medium = "GPU";
  uint32_t group = 0;  // the KV cache group (group_idx; 0 when not named)
  // BlockStored: the chain's LoRA adapter and, on a chain's first block,
  // cache salt, as ChainVariant (0: neither). Only meaningful without a
  // parent: a block with one inherits its parent's.
  uint64_t variant = 0;
  // BlockStored by an offloading tier that names its blocks by hash alone
  // (block_size 0, no token ids): only blocks already mapped can be placed.
  bool by_hash = false;
  // Non-empty when the router cannot map the event's blocks to kvtier's
  // (multimodal inputs or prompt embeddings among the extra keys, an
  // attention kind other than full attention, blocks remote to the engine,
  // fields of the wrong shape, a type it does not know).
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

}  // namespace kvtier::router
