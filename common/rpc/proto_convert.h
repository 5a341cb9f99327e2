// Conversions between the project's block-identity types and their kvtier.v1
// wire messages, in one place.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/block_key.h"
#include "common/prompt_chain.h"
#include "kvtier/v1/common.pb.h"

namespace kvtier {

void ToProto(const BlockHash& h, v1::BlockHash* out);
BlockHash FromProto(const v1::BlockHash& h);
void ToProto(const NamespaceSpec& s, v1::NamespaceSpec* out);
NamespaceSpec FromProto(const v1::NamespaceSpec& p);

// The prompt of a request whose oneof `prompt` is `tokens` (TokenIds) or
// `hashes` (HashChain, with prompt_tokens): v1.RouteRequest and
// v1.SubmitRequest. Errors as ChainFromTokens / ChainFromHashes, and
// INVALID_ARGUMENT when neither is set.
template <class Request>
absl::StatusOr<PromptChain> PromptFromRequest(const Request& req, uint64_t namespace_id,
                                              uint32_t block_tokens, absl::string_view what) {
  if (req.prompt_case() == Request::kTokens) {
    const auto& ids = req.tokens().ids();
    return ChainFromTokens(namespace_id, std::span<const uint32_t>(ids.data(), ids.size()),
                           block_tokens, what);
  }
  if (req.prompt_case() == Request::kHashes) {
    const auto& hs = req.hashes().hashes();
    if (static_cast<uint64_t>(hs.size()) > kMaxPromptBlocks) {  // before copying them
      return absl::InvalidArgumentError(absl::StrCat(what, ": the prompt has ", hs.size(),
                                                     " blocks; the limit is ", kMaxPromptBlocks));
    }
    std::vector<BlockHash> chain;
    chain.reserve(hs.size());
    for (const auto& h : hs) chain.push_back(FromProto(h));
    return ChainFromHashes(std::move(chain), req.prompt_tokens(), block_tokens, what);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": the prompt is empty (give tokens or hashes)"));
}

}  // namespace kvtier
