// The simulated model: a block's KV bytes are a pure function of
// (namespace, block hash, layer), so every onboarded byte can be checked
// against what the model would have computed.
#pragma once

#include <cstdint>

#include "common/block_key.h"
#include "gpu/kv_layout.h"

namespace kvtier::worker {

// Fills one layer's chunk of a block.
void ModelChunk(uint64_t ns, const BlockHash& hash, uint32_t layer, uint8_t* out, uint64_t len);
// Writes the model's KV for hash into page (every layer).
void ComputeIntoPage(const gpu::KvLayout& layout, uint8_t* const* layer_bases, uint32_t page,
                     uint64_t ns, const BlockHash& hash);
// True if page holds exactly the model's KV for hash; with `packed`, the
// model's KV after int8 packing and unpacking (what an int8 namespace's load
// must give, byte for byte).
bool PageMatchesModel(const gpu::KvLayout& layout, uint8_t* const* layer_bases, uint32_t page,
                      uint64_t ns, const BlockHash& hash, bool packed = false);
// The model's whole block (layer-major), as the store holds it.
void ModelBlock(const gpu::KvLayout& layout, uint64_t ns, const BlockHash& hash, uint8_t* out);

}  // namespace kvtier::worker
