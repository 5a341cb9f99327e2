// What the tests that drive kvtier-sim-worker processes share: the
// namespace of the sim worker's default flags, and prompts of token ids
// that are a pure function of a salt.
#pragma once

#include <cstdint>

#include "common/block_key.h"
#include "kvtier/v1/worker.pb.h"

namespace kvtier::testing {

// The sim worker's defaults: 4 layers x 2 heads x 64 dim, fp16, 16 tokens.
inline NamespaceSpec SimSpec() {
  return NamespaceSpec{"sim-model", "fp16", 4, 2, 64, 16, 0, 1, "", "", ""};
}

// `tokens` token ids from `salt`: equal salts share every block.
inline v1::SubmitRequest SimPrompt(uint64_t salt, int tokens, uint64_t id, uint32_t output_tokens) {
  v1::SubmitRequest r;
  r.set_request_id(id);
  for (int i = 0; i < tokens; ++i) {
    r.mutable_tokens()->add_ids(static_cast<uint32_t>(salt * 7919 + i));
  }
  r.set_output_tokens(output_tokens);
  return r;
}

}  // namespace kvtier::testing
