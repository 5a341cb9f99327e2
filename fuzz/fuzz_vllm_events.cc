// libFuzzer: the router's decoder of vLLM's KV-event payloads (outside
// input: whatever a ZeroMQ peer sends) and the hash mapping fed from it.
#include <cstddef>
#include <cstdint>

#include "router/vllm_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto b =
      kvtier::router::DecodeVllmBatch(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!b.ok()) return 0;
  kvtier::router::VllmChainMap map(0x5eed, 4);
  kvtier::router::VllmSourceStats stats;
  for (const auto& e : b->events) {
    if (e.kind == kvtier::router::VllmEvent::kStored) {
      // Decoded stored events always carry block_size tokens a block.
      if (e.skip_reason.empty() && e.token_ids.size() != size_t{e.block_size} * e.hashes.size()) {
        __builtin_trap();
      }
      auto out = map.Stored(e, &stats);
      if (out.size() > e.hashes.size()) __builtin_trap();
    } else if (e.kind == kvtier::router::VllmEvent::kRemoved) {
      map.Removed(e, &stats);
    } else {
      map.Clear();
    }
  }
  return 0;
}
