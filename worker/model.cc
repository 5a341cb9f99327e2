#include "worker/model.h"

#include "common/pattern.h"

#include <cstring>
#include <vector>

namespace kvtier::worker {

void ModelChunk(uint64_t ns, const BlockHash& hash, uint32_t layer, uint8_t* out, uint64_t len) {
  FillPattern(hash.hi ^ (hash.lo * 0x9E3779B97F4A7C15ull) ^ ns ^
                  (uint64_t{layer} + 1) * 0xC2B2AE3D27D4EB4Full,
              out, len);
}

void ComputeIntoPage(const gpu::KvLayout& l, uint8_t* const* bases, uint32_t page, uint64_t ns,
                     const BlockHash& hash) {
  const uint64_t chunk = l.layer_page_bytes();
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    ModelChunk(ns, hash, layer, bases[layer] + page * chunk, chunk);
  }
}

bool PageMatchesModel(const gpu::KvLayout& l, uint8_t* const* bases, uint32_t page, uint64_t ns,
                      const BlockHash& hash, bool packed) {
  const uint64_t chunk = l.layer_page_bytes();
  if (packed) {
    std::vector<uint8_t> block(l.block_bytes()), wire(l.packed_bytes());
    ModelBlock(l, ns, hash, block.data());
    if (!gpu::PackInt8Cpu(l, block.data(), wire.data()).ok() ||
        !gpu::UnpackInt8Cpu(l, wire.data(), block.data()).ok()) {
      return false;
    }
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      if (std::memcmp(block.data() + layer * chunk, bases[layer] + page * chunk, chunk) != 0) {
        return false;
      }
    }
    return true;
  }
  std::vector<uint8_t> want(chunk);
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    ModelChunk(ns, hash, layer, want.data(), chunk);
    if (std::memcmp(want.data(), bases[layer] + page * chunk, chunk) != 0) return false;
  }
  return true;
}

void ModelBlock(const gpu::KvLayout& l, uint64_t ns, const BlockHash& hash, uint8_t* out) {
  const uint64_t chunk = l.layer_page_bytes();
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    ModelChunk(ns, hash, layer, out + layer * chunk, chunk);
  }
}

}  // namespace kvtier::worker
