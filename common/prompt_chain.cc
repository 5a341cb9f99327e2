#include "common/prompt_chain.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<PromptChain> ChainFromTokens(uint64_t namespace_id, std::span<const uint32_t> tokens,
                                            uint32_t block_tokens, absl::string_view what,
                                            uint64_t variant) {
  if (tokens.empty())
    return absl::InvalidArgumentError(absl::StrCat(what, ": the prompt is empty"));
  if (tokens.size() > kMaxPromptTokens) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the prompt has ", tokens.size(),
                                                   " tokens; the limit is ", kMaxPromptTokens));
  }
  return PromptChain{ChainHashes(namespace_id, tokens, block_tokens, variant), tokens.size()};
}

absl::StatusOr<uint64_t> HashedPromptTokens(size_t blocks, uint64_t prompt_tokens,
                                            uint32_t block_tokens, absl::string_view what) {
  if (blocks == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the prompt is empty (no hashes)"));
  }
  if (blocks > kMaxPromptBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the prompt has ", blocks,
                                                   " blocks; the limit is ", kMaxPromptBlocks));
  }
  const uint64_t full = uint64_t{block_tokens} * blocks;
  const uint64_t tokens = prompt_tokens ? prompt_tokens : full;
  if (tokens + block_tokens <= full || tokens > kMaxPromptTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": prompt_tokens ", tokens, " does not fit ", blocks, " blocks of ",
                     block_tokens, " tokens (or exceeds ", kMaxPromptTokens, ")"));
  }
  return tokens;
}

absl::StatusOr<PromptChain> ChainFromHashes(std::vector<BlockHash> hashes, uint64_t prompt_tokens,
                                            uint32_t block_tokens, absl::string_view what) {
  auto tokens = HashedPromptTokens(hashes.size(), prompt_tokens, block_tokens, what);
  if (!tokens.ok()) return tokens.status();
  return PromptChain{std::move(hashes), *tokens};
}

}  // namespace kvtier
