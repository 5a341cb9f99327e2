// A model's text side for the frontend: its own tokenizer and chat template
// (kvtier-text, frontend/text: Hugging Face `tokenizers` and `minijinja`),
// so the ids the frontend routes by are the ids the engine computes.
//
// Thread-safe: one TextModel serves every request at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

struct KvtText;

namespace kvtier::frontend {

class TextModel {
 public:
  // The model in `dir` (a Hugging Face model directory: tokenizer.json, and
  // tokenizer_config.json / chat_template.jinja for chats). NOT_FOUND or
  // FAILED_PRECONDITION saying which file is wrong.
  static absl::StatusOr<std::unique_ptr<TextModel>> Open(const std::string& dir);
  ~TextModel();
  TextModel(const TextModel&) = delete;
  TextModel& operator=(const TextModel&) = delete;

  // Token ids of `text`, with the model's special tokens (its BOS) when
  // `add_special_tokens`, as vLLM tokenizes a completion's prompt.
  // INVALID_ARGUMENT for text that is not UTF-8.
  absl::StatusOr<std::vector<uint32_t>> Encode(std::string_view text,
                                               bool add_special_tokens = true) const;
  // A chat request (JSON text with `messages`, and optional
  // `add_generation_prompt`, `tools`, `documents`, `chat_template_kwargs`)
  // through the model's chat template. INVALID_ARGUMENT for a request the
  // template refuses, or a model without a template.
  absl::StatusOr<std::string> RenderChat(std::string_view request_json) const;
  // RenderChat's text tokenized as vLLM tokenizes a chat: without adding
  // special tokens (the template writes them).
  absl::StatusOr<std::vector<uint32_t>> EncodeChat(std::string_view request_json) const;

  bool has_chat_template() const;
  size_t vocab_size() const;

 private:
  explicit TextModel(KvtText* text) : text_(text) {}
  KvtText* text_;
};

}  // namespace kvtier::frontend
