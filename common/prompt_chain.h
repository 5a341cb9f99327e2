// A request's prompt as a hash chain: the one rule that turns what a caller
// sends (token ids, or its own chained block hashes plus a token count) into
// the chain the store, the router and the workers key blocks by.
//
// Both the router's Route and a worker's Submit take a prompt this way;
// they share the limits below, so a prompt one accepts the other accepts.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "common/limits.h"

namespace kvtier {

// The prompt limits (common/limits.h).
using limits::kMaxPromptBlocks;
using limits::kMaxPromptTokens;

struct PromptChain {
  std::vector<BlockHash> chain;  // one hash per full block
  uint64_t prompt_tokens = 0;    // full blocks plus a trailing partial block
};

// Token ids: ChainHashes(namespace_id, tokens, block_tokens, variant).
// INVALID_ARGUMENT (prefixed with `what`, e.g. "route") for an empty prompt
// or one over kMaxPromptTokens. REQUIRES: block_tokens > 0.
absl::StatusOr<PromptChain> ChainFromTokens(uint64_t namespace_id, std::span<const uint32_t> tokens,
                                            uint32_t block_tokens, absl::string_view what,
                                            uint64_t variant = 0);

// The caller's own chain. prompt_tokens 0 means "exactly the full blocks";
// otherwise it must reach into the chain's last block (tokens after the
// chain's blocks, a trailing partial block, are the caller's business) and
// stay within kMaxPromptTokens. INVALID_ARGUMENT for an empty chain, one
// over kMaxPromptBlocks, or a count that does not fit. REQUIRES:
// block_tokens > 0.
absl::StatusOr<PromptChain> ChainFromHashes(std::vector<BlockHash> hashes, uint64_t prompt_tokens,
                                            uint32_t block_tokens, absl::string_view what);
// ChainFromHashes's checks and prompt length for a chain of `blocks` hashes
// the caller reads in place.
absl::StatusOr<uint64_t> HashedPromptTokens(size_t blocks, uint64_t prompt_tokens,
                                            uint32_t block_tokens, absl::string_view what);

}  // namespace kvtier
