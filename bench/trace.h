// The Mooncake request-trace format (bench/traces/README.md): one JSON object
// per line with timestamp (ms), input_length and output_length (tokens) and
// hash_ids, one id per 512-token block, each standing for its whole prefix.
// Parsing validates every field and names the line and field on error.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_key.h"

namespace kvtier {

inline constexpr uint32_t kTraceBlockTokens = 512;
// Limits on one request of a trace (a malformed file must not exhaust memory).
inline constexpr uint64_t kTraceMaxInputTokens = 8u << 20;

// The block hash of a trace's hash id in namespace ns: what the replay's
// workers store and the router indexes for that block.
inline BlockHash TraceHash(uint64_t ns, uint64_t id) {
  return BlockHash{(id + 1) * 0x9E3779B97F4A7C15ull ^ ns, id};
}

struct TraceRequest {
  uint64_t timestamp_ms = 0;
  uint32_t input_length = 0;
  uint32_t output_length = 0;
  std::vector<uint64_t> hash_ids;
};

absl::StatusOr<TraceRequest> ParseTraceLine(std::string_view line);

// Reads up to limit requests (0: all); blank lines are skipped.
absl::StatusOr<std::vector<TraceRequest>> ReadTrace(const std::string& path, size_t limit = 0);

struct PrefixCacheFigures {
  uint64_t blocks = 0;      // prompt blocks
  uint64_t hit_blocks = 0;  // leading blocks already cached
  uint64_t tokens = 0;      // prompt tokens
  uint64_t hit_tokens = 0;  // tokens of the hit blocks (a partial last block counts its tokens)
  double block_hit_ratio() const { return blocks ? double(hit_blocks) / blocks : 0; }
  double token_hit_ratio() const { return tokens ? double(hit_tokens) / tokens : 0; }
};

// A cache shared by all engines, of capacity_blocks blocks in LRU order
// (0: infinite). Each request hits its longest cached prefix, then caches
// all of its blocks.
PrefixCacheFigures SharedPrefixCache(const std::vector<TraceRequest>& trace,
                                     uint64_t capacity_blocks);

}  // namespace kvtier
