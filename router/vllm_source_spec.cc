#include "router/vllm_source_spec.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/limits.h"

namespace kvtier::router {

absl::StatusOr<EngineRole> ParseEngineRole(absl::string_view value) {
  if (value == "prefill") return EngineRole::kPrefill;
  if (value == "decode") return EngineRole::kDecode;
  if (value == "both") return EngineRole::kBoth;
  return absl::InvalidArgumentError(
      absl::StrCat("role \"", value, "\" must be prefill, decode or both"));
}

const char* EngineRoleName(EngineRole role) {
  switch (role) {
    case EngineRole::kPrefill:
      return "prefill";
    case EngineRole::kDecode:
      return "decode";
    case EngineRole::kBoth:
      break;
  }
  return "both";
}

absl::StatusOr<std::vector<VllmSourceSpec>> ParseVllmSources(absl::string_view text) {
  std::vector<VllmSourceSpec> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("vLLM sources, line ", line_no, ": ", why));
    };
    VllmSourceSpec s;
    for (absl::string_view kv : absl::StrSplit(line, ',')) {
      kv = absl::StripAsciiWhitespace(kv);
      const size_t eq = kv.find('=');
      if (eq == absl::string_view::npos) return bad(absl::StrCat("\"", kv, "\" is not key=value"));
      const absl::string_view key = kv.substr(0, eq), value = kv.substr(eq + 1);
      if (key == "id") {
        s.id = std::string(value);
      } else if (key == "endpoint") {
        s.endpoint = std::string(value);
      } else if (key == "events") {
        s.events = std::string(value);
      } else if (key == "replay") {
        s.replay = std::string(value);
      } else if (key == "topic") {
        s.topic = std::string(value);
      } else if (key == "namespace") {
        if (value.size() != 16 || !absl::SimpleHexAtoi(value, &s.namespace_id) ||
            s.namespace_id == 0) {
          return bad(absl::StrCat("namespace \"", value, "\" must be 16 hex digits, not all 0"));
        }
      } else if (key == "block-tokens") {
        if (!absl::SimpleAtoi(value, &s.block_tokens) || s.block_tokens < limits::kMinBlockTokens ||
            s.block_tokens > limits::kMaxBlockTokens) {
          return bad(absl::StrCat("block-tokens \"", value, "\" must be ", limits::kMinBlockTokens,
                                  "..", limits::kMaxBlockTokens));
        }
      } else if (key == "role") {
        auto role = ParseEngineRole(value);
        if (!role.ok()) return bad(std::string(role.status().message()));
        s.role = *role;
      } else {
        return bad(absl::StrCat(
            "unknown key \"", key,
            "\" (id, endpoint, events, replay, topic, namespace, block-tokens, role)"));
      }
    }
    auto zmq_url = [](const std::string& u) {
      return u.rfind("tcp://", 0) == 0 || u.rfind("ipc://", 0) == 0 || u.rfind("inproc://", 0) == 0;
    };
    if (s.id.empty() || s.id.size() > 256) return bad("id must be 1..256 bytes");
    if (s.endpoint.empty() || s.endpoint.size() > 256) return bad("endpoint must be 1..256 bytes");
    if (!zmq_url(s.events)) return bad("events must be a tcp://, ipc:// or inproc:// endpoint");
    if (!s.replay.empty() && !zmq_url(s.replay)) {
      return bad("replay must be a tcp://, ipc:// or inproc:// endpoint");
    }
    if (s.namespace_id == 0) return bad("namespace is missing");
    if (s.block_tokens == 0) return bad("block-tokens is missing");
    for (const auto& o : out) {
      if (o.id == s.id) return bad(absl::StrCat("id \"", s.id, "\" is used twice"));
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace kvtier::router
