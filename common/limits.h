// The protocol's limits, in one place: servers check them, clients and
// benches size their batches by them, and proto comments quote them
// (proto/kvtier/v1/*.proto).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier::limits {

// Block hashes one store request may name (Lookup, BeginGet, BeginPut,
// VerifyBlocks, ...), and lease ids one ReleaseGets may end.
inline constexpr size_t kMaxBlocksPerRequest = 8192;
// Block hashes one router event or snapshot chunk may carry.
inline constexpr size_t kMaxEventHashes = 65536;
// Tokens per block (a namespace's block_tokens, an engine's page).
inline constexpr uint32_t kMinBlockTokens = 1;
inline constexpr uint32_t kMaxBlockTokens = 65536;
// Most tokens / full blocks one prompt may carry (2 Mi tokens: 16 Ki blocks
// of 128 tokens): a route's, a worker's Submit.
inline constexpr uint64_t kMaxPromptTokens = 2097152;
inline constexpr uint64_t kMaxPromptBlocks = 16384;

}  // namespace kvtier::limits
