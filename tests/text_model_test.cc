// TextModel (frontend/text_model.h) with the tiny test model's own files
// (tests/models/tiny-llama, scripts/make_tiny_tokenizer.py): special tokens,
// the chat template's text, what it refuses, broken model files, and many
// threads at once. tests/python/test_text_model.py checks the ids against
// Hugging Face's and vLLM's own tokenization on hundreds of prompts.
#include "frontend/text_model.h"

#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "tests/test_util.h"

namespace kvtier::frontend {
namespace {

const std::string kModel = std::string(KVTIER_SOURCE_DIR) + "/tests/models/tiny-llama";

std::unique_ptr<TextModel> Tiny() {
  auto m = TextModel::Open(kModel);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(TextModel, APromptGetsTheModelsBosAndRoundTripsItsWords) {
  auto m = Tiny();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->vocab_size(), 4096u);
  auto with = m->Encode("The store tiers blocks across RAM and NVMe.");
  auto without = m->Encode("The store tiers blocks across RAM and NVMe.", false);
  ASSERT_TRUE(with.ok() && without.ok());
  ASSERT_FALSE(without->empty());
  EXPECT_EQ(with->front(), 1u) << "<s> is id 1";
  EXPECT_EQ(std::vector<uint32_t>(with->begin() + 1, with->end()), *without);
  // Words the corpus holds are few tokens; every id is inside the vocabulary.
  EXPECT_LT(without->size(), 16u);
  for (uint32_t id : *with) EXPECT_LT(id, 4096u);
  // Special tokens written in the text are the special tokens.
  auto special = m->Encode("<|im_start|>user", false);
  ASSERT_TRUE(special.ok());
  EXPECT_EQ(special->front(), 3u);
  auto empty = m->Encode("", true);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, std::vector<uint32_t>{1});
}

TEST(TextModel, AChatRendersThroughTheModelsOwnTemplate) {
  auto m = Tiny();
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(m->has_chat_template());
  auto text = m->RenderChat(R"({"messages": [
      {"role": "system", "content": "You are terse. "},
      {"role": "user", "content": [{"type": "text", "text": "What is"},
                                   {"type": "text", "text": "a KV cache?"}]}]})");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text,
            "<s><|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nWhat is\na KV cache?<|im_end|>\n<|im_start|>assistant\n");
  auto no_prompt = m->RenderChat(
      R"({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false})");
  ASSERT_TRUE(no_prompt.ok());
  EXPECT_EQ(*no_prompt, "<s><|im_start|>user\nhi<|im_end|>\n");
  // A chat's ids carry the template's <s> once, not the tokenizer's too.
  auto ids = m->EncodeChat(R"({"messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ((*ids)[0], 1u);
  EXPECT_EQ((*ids)[1], 3u);
}

TEST(TextModel, WhatTheTemplateOrTheTokenizerRefusesIsAClientError) {
  auto m = Tiny();
  ASSERT_NE(m, nullptr);
  auto expect_invalid = [&](const std::string& req, const std::string& says) {
    auto r = m->RenderChat(req);
    ASSERT_FALSE(r.ok()) << req;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  };
  expect_invalid(R"({"messages": [{"role": "wizard", "content": "hi"}]})", "unknown role: wizard");
  expect_invalid(R"({"messages": []})", "messages must be a non-empty array");
  expect_invalid(R"({"messages": [1]})", "each message must be an object");
  expect_invalid(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
                 "image_url");
  expect_invalid(R"({"messages": )", "not JSON");
  expect_invalid(R"({"messages": [{"role": "user", "content": "hi"}],
                    "chat_template_kwargs": 3})",
                 "chat_template_kwargs");
  auto bad = m->Encode(std::string("caf\xc3", 4));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("UTF-8"), std::string::npos) << bad.status();
  // And the model still serves.
  EXPECT_TRUE(m->Encode("still here").ok());
}

TEST(TextModel, BrokenModelFilesAreNamed) {
  testing::TempDir dir;
  auto missing = TextModel::Open(dir.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("tokenizer.json"), std::string::npos);

  Write(dir.path() + "/tokenizer.json", "{\"version\": ");
  auto bad = TextModel::Open(dir.path());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();

  // A good tokenizer without a template: prompts work, chats are refused.
  std::ifstream good(kModel + "/tokenizer.json");
  Write(dir.path() + "/tokenizer.json", std::string(std::istreambuf_iterator<char>(good), {}));
  auto plain = TextModel::Open(dir.path());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE((*plain)->has_chat_template());
  EXPECT_TRUE((*plain)->Encode("hello").ok());
  auto chat = (*plain)->RenderChat(R"({"messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_FALSE(chat.ok());
  EXPECT_NE(chat.status().message().find("no chat template"), std::string::npos);

  Write(dir.path() + "/chat_template.jinja", "{% for m in messages %}{{ m.content ");
  auto broken = TextModel::Open(dir.path());
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(broken.status().message().find("chat template"), std::string::npos) << broken.status();
}

TEST(TextModel, ManyThreadsTokenizeAtOnceAlike) {
  auto m = Tiny();
  ASSERT_NE(m, nullptr);
  const std::string text = "kvtier keeps hot prefixes near the engines that use them. ";
  auto want = m->Encode(text);
  ASSERT_TRUE(want.ok());
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto got = m->Encode(text);
        auto chat = m->EncodeChat(R"({"messages": [{"role": "user", "content": "hi"}]})");
        if (!got.ok() || *got != *want || !chat.ok()) wrong++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
}  // namespace kvtier::frontend
