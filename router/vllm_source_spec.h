// The vLLM engines the router subscribes to (--vllm-sources): one line per
// engine (docs/router.md, "vLLM's KV events").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier::router {

// What an engine does in a prefill/decode split (kvtier-frontend's
// pairing, docs/disaggregation.md; the router ignores it).
enum class EngineRole : uint8_t { kBoth, kPrefill, kDecode };

// "prefill", "decode" or "both" as a role; INVALID_ARGUMENT naming the
// value otherwise. EngineRoleName is its inverse.
absl::StatusOr<EngineRole> ParseEngineRole(absl::string_view value);
const char* EngineRoleName(EngineRole role);

// One vLLM engine the router subscribes to.
struct VllmSourceSpec {
  std::string id;        // its source id (the worker id routes name)
  std::string endpoint;  // what routes return for it (its API's host:port)
  std::string events;    // ZeroMQ PUB endpoint, e.g. tcp://10.0.0.5:5557
  std::string replay;    // ZeroMQ ROUTER replay endpoint ("" : none)
  std::string topic;     // subscription prefix ("" : every topic)
  uint64_t namespace_id = 0;
  uint32_t block_tokens = 0;  // must equal the engine's --block-size
  EngineRole role = EngineRole::kBoth;
};

// One spec per non-empty, non-# line: comma-separated key=value with keys
// id, endpoint, events, replay, topic, namespace (16 hex digits),
// block-tokens and role (prefill, decode or both, the default).
// INVALID_ARGUMENT naming the line and the key.
absl::StatusOr<std::vector<VllmSourceSpec>> ParseVllmSources(absl::string_view text);

}  // namespace kvtier::router
