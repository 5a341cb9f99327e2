// Tokens the engine would make: the frontend forwards token ids, so they
// must be the ids each engine computes from the same text. A few fixed
// probes (plain text with the model's special tokens, and a chat through
// its template) are tokenized here and by the engine's /tokenize (vLLM's);
// an engine whose ids differ is refused (frontend/fleet.h), never sent
// ids it would read as another prompt.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "frontend/text_model.h"

namespace kvtier::frontend {

struct TokenProbe {
  std::string name;           // for the log: which probe differed
  std::string request;        // /tokenize's JSON body, "model" left out
  std::vector<uint32_t> ids;  // the frontend's ids for it

  // The body for /tokenize with the served model's name.
  std::string Request(const std::string& model) const;
  // The engine's /tokenize answer beside `ids`: the same, different (`why`
  // names the first position that differs), or no ids at all (not vLLM's
  // /tokenize: nothing to compare).
  struct Compared {
    enum Kind { kSame, kDiffers, kNoIds } kind = kSame;
    std::string why;
  };
  Compared Compare(std::string_view answer) const;
};

// The probes for `text`: plain prompts, and a chat when it has a template.
std::vector<TokenProbe> TokenProbes(const TextModel& text);

}  // namespace kvtier::frontend
