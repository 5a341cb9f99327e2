// Random KV layouts and caches for the gpu/ tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "gpu/kv_layout.h"

namespace kvtier::gpu {

inline KvLayout RandomLayout(std::mt19937_64& rng, Dtype d) {
  KvLayout l;
  l.layers = 1 + rng() % 5;
  l.kv_heads = 1 + rng() % 4;
  l.head_dim = 1 + rng() % 70;  // odd sizes too
  l.block_tokens = 1 + rng() % 17;
  l.dtype = d;
  l.num_pages = 2 + rng() % 20;
  return l;
}

inline std::vector<std::vector<uint8_t>> RandomCache(std::mt19937_64& rng, const KvLayout& l) {
  std::vector<std::vector<uint8_t>> layers(l.layers, std::vector<uint8_t>(l.layer_bytes()));
  for (auto& v : layers) {
    for (auto& b : v) b = static_cast<uint8_t>(rng());
  }
  return layers;
}

}  // namespace kvtier::gpu
