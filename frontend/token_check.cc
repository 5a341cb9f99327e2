#include "frontend/token_check.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace kvtier::frontend {

using json = nlohmann::json;

std::string TokenProbe::Request(const std::string& model) const {
  json j = json::parse(request);
  j["model"] = model;
  return j.dump();
}

TokenProbe::Compared TokenProbe::Compare(std::string_view answer) const {
  const json j = json::parse(answer, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array()) {
    return {Compared::kNoIds, absl::StrCat(name, ": /tokenize answered no token ids")};
  }
  const json& tokens = j["tokens"];
  for (size_t i = 0; i < std::max(ids.size(), tokens.size()); ++i) {
    const bool ours = i < ids.size(), theirs = i < tokens.size() && tokens[i].is_number_unsigned();
    if (ours && theirs && tokens[i].get<uint64_t>() == ids[i]) continue;
    return {Compared::kDiffers,
            absl::StrCat(name, ": id ", i, " is ",
                         theirs ? absl::StrCat(tokens[i].get<uint64_t>()) : std::string("absent"),
                         " there and ", ours ? absl::StrCat(ids[i]) : std::string("absent"),
                         " here (", tokens.size(), " ids there, ", ids.size(), " here)")};
  }
  return {};
}

std::vector<TokenProbe> TokenProbes(const TextModel& text) {
  std::vector<TokenProbe> probes;
  // Spaces, digits, punctuation, non-ASCII and an emoji: where tokenizer
  // pipelines (normalizers, pre-tokenizers, byte fallback) part ways.
  for (const char* prompt : {"Hello, world! The store tiers blocks across RAM and NVMe.",
                             "  two spaces, a\ttab and a\nnewline: 3.14159 x 2 = 6.28318",
                             "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
                             "\xf0\x9f\x9a\x80 done"}) {
    auto ids = text.Encode(prompt, /*add_special_tokens=*/true);
    if (!ids.ok()) continue;
    probes.push_back({absl::StrCat("prompt \"", std::string(prompt).substr(0, 24), "...\""),
                      json{{"prompt", prompt}, {"add_special_tokens", true}}.dump(),
                      std::move(*ids)});
  }
  if (text.has_chat_template()) {
    const json chat = {{"messages",
                        {{{"role", "system"}, {"content", "You are a helpful assistant."}},
                         {{"role", "user"}, {"content", "What does a KV cache hold?"}}}},
                       {"add_generation_prompt", true}};
    auto ids = text.EncodeChat(chat.dump());
    if (ids.ok()) {
      json request = chat;
      request["add_special_tokens"] = false;  // the template writes them (vLLM's default)
      probes.push_back({"a chat through the template", request.dump(), std::move(*ids)});
    }
  }
  return probes;
}

}  // namespace kvtier::frontend
