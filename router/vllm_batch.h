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

}  // namespace kvtier::router
