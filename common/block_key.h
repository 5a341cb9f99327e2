// Block identity (docs/architecture.md, "Block identity").
//
// A namespace fixes what a block's bytes mean; its id is XXH3-64 of a
// canonical string of its fields. A block hash is chained over the token ids
// of full blocks, seeded with the namespace id. Key = (namespace, hash).
// All functions here are pure and thread-safe.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;
  auto operator<=>(const BlockHash&) const = default;
};

// A 64-bit finalizer (MurmurHash3's fmix64): spreads every input bit over
// the output.
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

struct BlockKey {
  uint64_t ns = 0;
  BlockHash hash;
  auto operator<=>(const BlockKey&) const = default;
  // A well-mixed 64-bit value for sharding and hash tables.
  uint64_t Mix() const {
    uint64_t x = hash.lo ^ (hash.hi * 0x9E3779B97F4A7C15ull) ^ (ns * 0xC2B2AE3D27D4EB4Full);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
  }
};

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const {
    return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull));
  }
};

struct BlockKeyHasher {
  size_t operator()(const BlockKey& k) const { return k.Mix(); }
};

// The fields of a namespace (mirrors kvtier.v1.NamespaceSpec).
struct NamespaceSpec {
  std::string model;
  std::string dtype;  // "fp16", "bf16", "fp8"
  uint32_t layers = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t block_tokens = 0;
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  std::string cache_salt;
  std::string kv_wire;  // "" (the dtype's bytes) or kKvWireInt8
  // What else decides the bytes (proto/kvtier/v1/common.proto): the engine's
  // KV layout and parallel ranks beyond TP; "" for kvtier's own layout.
  std::string layout;
};

// NamespaceSpec::kv_wire of int8-packed blocks (gpu/kv_layout.h, PackInt8Cpu).
inline constexpr char kKvWireInt8[] = "int8";

// Bytes per element of a dtype name, or an error naming the dtype.
absl::StatusOr<uint32_t> DtypeBytes(const std::string& dtype);

// Checks every field against the limits documented in proto/kvtier/v1/common.proto.
absl::Status ValidateNamespace(const NamespaceSpec& spec);

// "model|dtype|layers|kv_heads|head_dim|block_tokens|tp_rank|tp_size|salt",
// with tp_size 0 read as 1, "|kv_wire" after it when kv_wire is set and
// "|layout=LAYOUT" after that when layout is set (so the ids of namespaces
// without them are unchanged). The input of NamespaceId.
std::string CanonicalNamespace(const NamespaceSpec& spec);

// XXH3-64 of CanonicalNamespace(spec). REQUIRES: ValidateNamespace(spec).ok().
uint64_t NamespaceId(const NamespaceSpec& spec);

// Bytes of one layer of a stored block: 2 (K, V) x kv_heads x head_dim x
// block_tokens x dtype bytes, or with kv_wire int8 two float32 scales plus
// one byte per element. A block is its layers one after another, so layer l
// is the byte range [l, l + 1) x WireLayerBytes.
// REQUIRES: ValidateNamespace(spec).ok().
uint64_t WireLayerBytes(const NamespaceSpec& spec);
// layers x WireLayerBytes. REQUIRES: ValidateNamespace(spec).ok().
uint64_t BlockBytes(const NamespaceSpec& spec);

// What besides its tokens decides a request's KV in an engine's prefix
// cache, for routing: its LoRA adapter and its cache salt. 0 for neither;
// otherwise XXH3-64 of "lora=NAME", "salt=SALT" or both joined by "|" (each
// value with "%" and "|" percent-encoded), never 0. The router roots such a
// request's chain at {namespace id, variant}, so equal tokens under another
// adapter or salt never match.
uint64_t ChainVariant(std::string_view lora_name, std::string_view cache_salt);

// h[i] = XXH3-128(h[i-1] || little-endian u32 token ids of block i), with
// h[-1] = {hi: namespace id, lo: variant} (ChainVariant; 0 for a plain
// request). Only full blocks are hashed: a trailing partial block yields no
// hash.
std::vector<BlockHash> ChainHashes(uint64_t namespace_id, std::span<const uint32_t> tokens,
                                   uint32_t block_tokens, uint64_t variant = 0);

// One link of the chain: the hash of a block given its parent's hash.
BlockHash NextBlockHash(const BlockHash& parent, std::span<const uint32_t> block_token_ids);

// 32 lowercase hex digits (hi then lo).
std::string ToHex(const BlockHash& h);
// A namespace id as 16 lowercase hex digits (how logs, errors and kvctl name it).
std::string NamespaceName(uint64_t ns);
absl::StatusOr<BlockHash> BlockHashFromHex(const std::string& hex);

}  // namespace kvtier
