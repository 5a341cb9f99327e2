#include "common/block_key.h"
#include "common/engine_key.h"

#include "common/limits.h"

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"

namespace kvtier {

absl::StatusOr<uint32_t> DtypeBytes(const std::string& dtype) {
  auto d = ParseDtype(dtype);
  if (!d.ok()) return d.status();
  return ElementBytes(*d);
}

namespace {
absl::Status CheckRange(const char* name, uint64_t v, uint64_t lo, uint64_t hi) {
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace ", name, " = ", v, " is outside ", lo, "..", hi));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status ValidateNamespace(const NamespaceSpec& spec) {
  if (spec.model.empty() || spec.model.size() > 256) {
    return absl::InvalidArgumentError("namespace model must be 1..256 bytes");
  }
  // The canonical string separates fields with "|": a model holding one, or
  // a salt ending as the kv_wire field would, could read as another spec.
  if (spec.model.find('|') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace model \"", spec.model, "\" may not contain \"|\""));
  }
  if (spec.cache_salt.size() > 256) {
    return absl::InvalidArgumentError("namespace cache_salt must be at most 256 bytes");
  }
  if (absl::EndsWith(spec.cache_salt, absl::StrCat("|", kKvWireInt8))) {
    return absl::InvalidArgumentError(absl::StrCat("namespace cache_salt may not end in \"|",
                                                   kKvWireInt8, "\" (it would read as kv_wire ",
                                                   kKvWireInt8, ")"));
  }
  if (spec.layout.size() > 256) {
    return absl::InvalidArgumentError("namespace layout must be at most 256 bytes");
  }
  if (absl::StrContains(spec.cache_salt, "|layout=")) {
    return absl::InvalidArgumentError(
        "namespace cache_salt may not contain \"|layout=\" (it would read as the layout field)");
  }
  auto elem = DtypeBytes(spec.dtype);
  if (!elem.ok()) return elem.status();
  if (!spec.kv_wire.empty() && spec.kv_wire != kKvWireInt8) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace kv_wire \"", spec.kv_wire, "\" is not one of \"\", \"int8\""));
  }
  if (spec.kv_wire == kKvWireInt8 && *elem != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace kv_wire int8 needs a 16-bit dtype (fp16, bf16); ", spec.dtype,
                     " is already 8-bit"));
  }
  if (auto s = CheckRange("layers", spec.layers, 1, 1024); !s.ok()) return s;
  if (auto s = CheckRange("kv_heads", spec.kv_heads, 1, 1024); !s.ok()) return s;
  if (auto s = CheckRange("head_dim", spec.head_dim, 1, 4096); !s.ok()) return s;
  if (auto s = CheckRange("block_tokens", spec.block_tokens, limits::kMinBlockTokens,
                          limits::kMaxBlockTokens);
      !s.ok()) {
    return s;
  }
  uint32_t tp_size = spec.tp_size == 0 ? 1 : spec.tp_size;
  if (auto s = CheckRange("tp_size", tp_size, 1, 1024); !s.ok()) return s;
  if (spec.tp_rank >= tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace tp_rank ", spec.tp_rank, " must be below tp_size ", tp_size));
  }
  return absl::OkStatus();
}

std::string CanonicalNamespace(const NamespaceSpec& spec) {
  return absl::StrCat(spec.model, "|", spec.dtype, "|", spec.layers, "|", spec.kv_heads, "|",
                      spec.head_dim, "|", spec.block_tokens, "|", spec.tp_rank, "|",
                      spec.tp_size == 0 ? 1 : spec.tp_size, "|", spec.cache_salt,
                      spec.kv_wire.empty() ? "" : "|", spec.kv_wire,
                      spec.layout.empty() ? "" : "|layout=", spec.layout);
}

uint64_t NamespaceId(const NamespaceSpec& spec) {
  std::string c = CanonicalNamespace(spec);
  return XXH3_64bits(c.data(), c.size());
}

uint64_t WireLayerBytes(const NamespaceSpec& spec) {
  const uint64_t elems = uint64_t{spec.kv_heads} * spec.head_dim * spec.block_tokens;
  if (spec.kv_wire == kKvWireInt8) return 2 * sizeof(float) + 2 * elems;
  return 2 * elems * *DtypeBytes(spec.dtype);
}

uint64_t BlockBytes(const NamespaceSpec& spec) { return spec.layers * WireLayerBytes(spec); }

BlockHash NextBlockHash(const BlockHash& parent, std::span<const uint32_t> ids) {
  XXH3_state_t st;
  XXH3_128bits_reset(&st);
  uint8_t p[16];
  std::memcpy(p, &parent.hi, 8);
  std::memcpy(p + 8, &parent.lo, 8);
  XXH3_128bits_update(&st, p, sizeof(p));
  // Token ids are hashed as little-endian u32 (the host order on every
  // platform kvtier supports).
  XXH3_128bits_update(&st, ids.data(), ids.size_bytes());
  XXH128_hash_t h = XXH3_128bits_digest(&st);
  return BlockHash{h.high64, h.low64};
}

BlockHash EngineKeyHash(std::string_view key) {
  XXH128_hash_t h = XXH3_128bits(key.data(), key.size());
  return BlockHash{h.high64, h.low64};
}

uint64_t ChainVariant(std::string_view lora_name, std::string_view cache_salt) {
  if (lora_name.empty() && cache_salt.empty()) return 0;
  auto field = [](std::string_view v) {
    std::string out;
    for (char c : v) {
      if (c == '%')
        out += "%25";
      else if (c == '|')
        out += "%7C";
      else
        out += c;
    }
    return out;
  };
  std::string s;
  if (!lora_name.empty()) s = absl::StrCat("lora=", field(lora_name));
  if (!cache_salt.empty()) absl::StrAppend(&s, s.empty() ? "" : "|", "salt=", field(cache_salt));
  const uint64_t v = XXH3_64bits(s.data(), s.size());
  return v == 0 ? 1 : v;
}

std::vector<BlockHash> ChainHashes(uint64_t namespace_id, std::span<const uint32_t> tokens,
                                   uint32_t block_tokens, uint64_t variant) {
  std::vector<BlockHash> out;
  if (block_tokens == 0) return out;
  out.reserve(tokens.size() / block_tokens);
  BlockHash parent{namespace_id, variant};
  for (size_t off = 0; off + block_tokens <= tokens.size(); off += block_tokens) {
    parent = NextBlockHash(parent, tokens.subspan(off, block_tokens));
    out.push_back(parent);
  }
  return out;
}

std::string ToHex(const BlockHash& h) { return absl::StrFormat("%016x%016x", h.hi, h.lo); }
std::string NamespaceName(uint64_t ns) { return absl::StrFormat("%016x", ns); }

absl::StatusOr<BlockHash> BlockHashFromHex(const std::string& hex) {
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("block hash \"", hex, "\" must be 32 hex digits"));
  }
  BlockHash h;
  for (size_t i = 0; i < 32; ++i) {
    char c = hex[i];
    int v;
    if (c >= '0' && c <= '9')
      v = c - '0';
    else if (c >= 'a' && c <= 'f')
      v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      v = c - 'A' + 10;
    else
      return absl::InvalidArgumentError(absl::StrCat("block hash \"", hex, "\" is not hex"));
    uint64_t& half = i < 16 ? h.hi : h.lo;
    half = (half << 4) | static_cast<uint64_t>(v);
  }
  return h;
}

}  // namespace kvtier
