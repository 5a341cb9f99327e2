// kvtier-text: a model's tokenization as the frontend does it, one JSON
// request per input line, one JSON answer per output line (for checking the
// frontend's ids against an engine's, and for operators):
//   {"prompt": "...", "add_special_tokens": true}   -> {"ids": [...]}
//   {"messages": [...], "add_generation_prompt": true, ...}
//                                                   -> {"ids": [...], "text": "..."}
//   a bad line                                      -> {"error": "..."}
#include <iostream>
#include <string>

#include "common/config.h"
#include "frontend/text_model.h"
#include "nlohmann/json.hpp"

int main(int argc, char** argv) {
  std::string model;
  kvtier::FlagSet flags("kvtier-text",
                        "Tokenizes JSON requests read from stdin, one per line, with a model's "
                        "own tokenizer and chat template, as kvtier-frontend does.");
  flags.String("model", &model, "the model's directory (tokenizer.json, tokenizer_config.json)");
  kvtier::ParseFlagsOrExit(flags, argc, argv);
  if (model.empty()) {
    std::cerr << "kvtier-text: --model is required\n";
    return 2;
  }
  auto text = kvtier::frontend::TextModel::Open(model);
  if (!text.ok()) {
    std::cerr << "kvtier-text: " << text.status().message() << "\n";
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    nlohmann::json out;
    auto req = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (req.is_discarded() || !req.is_object()) {
      out["error"] = "not a JSON object";
    } else if (req.contains("messages")) {
      auto rendered = (*text)->RenderChat(line);
      auto ids = rendered.ok() ? (*text)->Encode(*rendered, false) : rendered.status();
      if (ids.ok()) {
        out["ids"] = *ids;
        out["text"] = *rendered;
      } else {
        out["error"] = std::string(ids.status().message());
      }
    } else if (req.contains("prompt") && req["prompt"].is_string()) {
      const bool special = req.value("add_special_tokens", true);
      auto ids = (*text)->Encode(req["prompt"].get<std::string>(), special);
      if (ids.ok()) {
        out["ids"] = *ids;
      } else {
        out["error"] = std::string(ids.status().message());
      }
    } else {
      out["error"] = "a request has \"prompt\" (a string) or \"messages\"";
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n"
              << std::flush;
  }
  return 0;
}
