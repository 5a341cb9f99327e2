#include "frontend/events.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace kvtier::frontend {
namespace {

using nlohmann::json;

bool NonEmpty(const json& v) {
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  if (v.is_array() || v.is_object()) return !v.empty();
  return false;
}

// A choice that answers: a token's text or a delta's content (role alone
// is not one), or a finish other than vLLM's abort.
bool Answers(const json& choice) {
  if (!choice.is_object()) return true;
  const json& finish = choice.value("finish_reason", json());
  if (!finish.is_null() && finish != "abort") return true;
  if (NonEmpty(choice.value("text", json()))) return true;
  for (const char* part : {"delta", "message"}) {
    const json& d = choice.value(part, json());
    if (!d.is_object()) continue;
    for (const char* key : {"content", "reasoning_content", "reasoning", "tool_calls"}) {
      if (NonEmpty(d.value(key, json()))) return true;
    }
  }
  return false;
}

}  // namespace

size_t SseEventsEnd(std::string_view s) {
  const size_t lf = s.rfind("\n\n");
  const size_t crlf = s.rfind("\r\n\r\n");
  size_t end = 0;
  if (lf != std::string_view::npos) end = lf + 2;
  if (crlf != std::string_view::npos) end = std::max(end, crlf + 4);
  return end;
}

bool FailsBeforeItsFirstToken(std::string_view events) {
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(events.data(), events.size()), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == ':') continue;
    if (!absl::ConsumePrefix(&line, "data:")) return false;
    const json event =
        json::parse(std::string(absl::StripLeadingAsciiWhitespace(line)), nullptr, false);
    if (!event.is_object() || !event.contains("error") || !event["error"].is_object()) {
      return false;
    }
    const json& code = event["error"].value("code", json());
    return code.is_number_integer() && code.get<int64_t>() >= 500;
  }
  return false;
}

StreamPiece ClassifyEvents(std::string_view events) {
  bool data = false;
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(events.data(), events.size()), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == ':') continue;
    // event:, id:, retry: and anything else vLLM does not send: an answer.
    if (!absl::ConsumePrefix(&line, "data:")) return StreamPiece::kAnswer;
    line = absl::StripLeadingAsciiWhitespace(line);
    data = true;
    if (line == "[DONE]") continue;
    const json event = json::parse(std::string(line), nullptr, false);
    if (!event.is_object() || event.contains("error")) return StreamPiece::kAnswer;
    const json& choices = event.value("choices", json::array());
    if (!choices.is_array()) return StreamPiece::kAnswer;
    for (const json& c : choices) {
      if (Answers(c)) return StreamPiece::kAnswer;
    }
  }
  return data ? StreamPiece::kNoAnswer : StreamPiece::kComments;
}

bool AbortedWithNoToken(std::string_view body) {
  const json answer = json::parse(body, nullptr, false);
  if (!answer.is_object()) return false;
  const json& choices = answer.value("choices", json());
  if (!choices.is_array() || choices.empty()) return false;
  for (const json& c : choices) {
    if (!c.is_object() || c.value("finish_reason", json()) != "abort" || Answers(c)) return false;
  }
  const json& usage = answer.value("usage", json());
  return !usage.is_object() || usage.value("completion_tokens", json(0)) == 0;
}

}  // namespace kvtier::frontend
