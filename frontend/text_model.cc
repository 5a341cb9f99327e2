#include "frontend/text_model.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "frontend/text/text.h"

namespace kvtier::frontend {
namespace {

// The library's error as a status, freeing its message.
absl::Status Failed(int code, char* err, std::string_view what) {
  std::string msg = std::string(what) + ": " + (err ? err : "(no message)");
  kvt_text_free_string(err);
  switch (code) {
    case KVT_TEXT_INVALID:
      return absl::InvalidArgumentError(msg);
    case KVT_TEXT_MODEL:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<TextModel>> TextModel::Open(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "tokenizer.json", ec)) {
    return absl::NotFoundError(
        absl::StrCat("model directory ", dir, " has no tokenizer.json (a Hugging Face tokenizer)"));
  }
  char* err = nullptr;
  KvtText* t = kvt_text_open(dir.c_str(), &err);
  if (t == nullptr) return Failed(KVT_TEXT_MODEL, err, absl::StrCat("open model ", dir));
  return std::unique_ptr<TextModel>(new TextModel(t));
}

TextModel::~TextModel() { kvt_text_close(text_); }

absl::StatusOr<std::vector<uint32_t>> TextModel::Encode(std::string_view text,
                                                        bool add_special_tokens) const {
  uint32_t* ids = nullptr;
  size_t n = 0;
  char* err = nullptr;
  if (int code = kvt_text_encode(text_, text.data(), text.size(), add_special_tokens ? 1 : 0, &ids,
                                 &n, &err);
      code != 0) {
    return Failed(code, err, "tokenize");
  }
  std::vector<uint32_t> out(ids, ids + n);
  kvt_text_free_ids(ids, n);
  return out;
}

absl::StatusOr<std::string> TextModel::RenderChat(std::string_view request_json) const {
  char* out = nullptr;
  size_t len = 0;
  char* err = nullptr;
  if (int code =
          kvt_text_render_chat(text_, request_json.data(), request_json.size(), &out, &len, &err);
      code != 0) {
    return Failed(code, err, "chat template");
  }
  std::string s(out, len);
  kvt_text_free_string(out);
  return s;
}

absl::StatusOr<std::vector<uint32_t>> TextModel::EncodeChat(std::string_view request_json) const {
  auto text = RenderChat(request_json);
  if (!text.ok()) return text.status();
  return Encode(*text, /*add_special_tokens=*/false);
}

bool TextModel::has_chat_template() const { return kvt_text_has_chat_template(text_) != 0; }

size_t TextModel::vocab_size() const { return kvt_text_vocab_size(text_); }

}  // namespace kvtier::frontend
