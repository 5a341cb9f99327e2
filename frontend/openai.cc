#include "frontend/openai.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/block_key.h"

namespace kvtier::frontend {
namespace {

using nlohmann::json;

// OpenAI's fields of each endpoint and vLLM's extra ones (its protocol
// models): anything else is a client's mistake, answered as OpenAI answers
// it rather than silently ignored.
const std::set<std::string, std::less<>>& CommonFields() {
  static const std::set<std::string, std::less<>> f = {"model",
                                                       "stream",
                                                       "stream_options",
                                                       "max_tokens",
                                                       "n",
                                                       "best_of",
                                                       "temperature",
                                                       "top_p",
                                                       "top_k",
                                                       "min_p",
                                                       "seed",
                                                       "stop",
                                                       "stop_token_ids",
                                                       "frequency_penalty",
                                                       "presence_penalty",
                                                       "repetition_penalty",
                                                       "length_penalty",
                                                       "logit_bias",
                                                       "logprobs",
                                                       "user",
                                                       "echo",
                                                       "use_beam_search",
                                                       "include_stop_str_in_output",
                                                       "ignore_eos",
                                                       "min_tokens",
                                                       "skip_special_tokens",
                                                       "spaces_between_special_tokens",
                                                       "truncate_prompt_tokens",
                                                       "allowed_token_ids",
                                                       "prompt_logprobs",
                                                       "bad_words",
                                                       "response_format",
                                                       "structured_outputs",
                                                       "guided_json",
                                                       "guided_regex",
                                                       "guided_choice",
                                                       "guided_grammar",
                                                       "guided_decoding_backend",
                                                       "guided_whitespace_pattern",
                                                       "priority",
                                                       "request_id",
                                                       "return_tokens_as_token_ids",
                                                       "return_token_ids",
                                                       "cache_salt",
                                                       "kv_transfer_params",
                                                       "vllm_xargs",
                                                       "logits_processors",
                                                       "add_special_tokens",
                                                       "metadata",
                                                       "service_tier",
                                                       "store",
                                                       "thinking_token_budget",
                                                       "mm_processor_kwargs"};
  return f;
}
const std::set<std::string, std::less<>>& CompletionFields() {
  static const std::set<std::string, std::less<>> f = {"prompt", "suffix", "prompt_embeds"};
  return f;
}
const std::set<std::string, std::less<>>& ChatFields() {
  static const std::set<std::string, std::less<>> f = {"messages",
                                                       "max_completion_tokens",
                                                       "top_logprobs",
                                                       "tools",
                                                       "tool_choice",
                                                       "parallel_tool_calls",
                                                       "functions",
                                                       "function_call",
                                                       "add_generation_prompt",
                                                       "continue_final_message",
                                                       "chat_template",
                                                       "chat_template_kwargs",
                                                       "documents",
                                                       "reasoning_effort",
                                                       "modalities",
                                                       "prediction",
                                                       "audio",
                                                       "include_reasoning"};
  return f;
}

ApiError Invalid(std::string message, std::string param = "") {
  return ApiError{400, "invalid_request_error", std::move(message), std::move(param), ""};
}

PrepareResult Fail(ApiError e) {
  PrepareResult r;
  r.error = std::move(e);
  return r;
}

// The ids of one prompt: text (tokenized) or token ids (checked).
std::optional<ApiError> PromptIds(const json& p, const TextModel& text, bool add_special,
                                  std::vector<uint32_t>* out) {
  if (p.is_string()) {
    auto ids = text.Encode(p.get_ref<const std::string&>(), add_special);
    if (!ids.ok()) return Invalid(std::string(ids.status().message()), "prompt");
    *out = std::move(*ids);
    return std::nullopt;
  }
  if (!p.is_array() || p.empty()) {
    return Invalid("prompt must be a string, token ids, or a list of either", "prompt");
  }
  const uint64_t vocab = text.vocab_size();
  out->reserve(p.size());
  for (const json& id : p) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        static_cast<uint64_t>(id.get<int64_t>()) >= vocab) {
      return Invalid(absl::StrCat("prompt token ids must be integers in [0, ", vocab, ")"),
                     "prompt");
    }
    out->push_back(static_cast<uint32_t>(id.get<int64_t>()));
  }
  return std::nullopt;
}

}  // namespace

std::string ErrorBody(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", err}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

PrepareResult PrepareOrThrow(Endpoint endpoint, std::string_view body,
                             const std::vector<ServedModel>& models, const RequestLimits& limits) {
  json req = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (req.is_discarded()) return Fail(Invalid("the body is not valid JSON"));
  if (!req.is_object()) return Fail(Invalid("the body must be a JSON object"));
  const bool chat = endpoint == Endpoint::kChat;
  for (const auto& [key, value] : req.items()) {
    const bool known = CommonFields().count(key) > 0 ||
                       (chat ? ChatFields().count(key) : CompletionFields().count(key)) > 0;
    if (!known) {
      return Fail(Invalid(absl::StrCat("Unrecognized request argument supplied: ", key), key));
    }
  }
  const ServedModel* model = nullptr;
  if (auto e = ModelOf(req, models, &model)) return Fail(*e);
  const TextModel& text = *model->text;
  const std::string& served_model = model->name;
  PrepareResult r;
  Prepared& p = r.prepared;
  p.endpoint = endpoint;
  p.namespace_id = model->namespace_id;
  if (req.contains("model") && !req["model"].get_ref<const std::string&>().empty() &&
      req["model"] != served_model) {
    p.adapter = req["model"].get<std::string>();
  }
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    auto it = req.find(key);
    if (it != req.end() && it->is_number_unsigned()) {
      p.max_new_tokens = std::max(p.max_new_tokens, it->get<uint64_t>());
    }
  }
  if (auto n = req.find("n"); n != req.end() && n->is_number_unsigned() && n->get<uint64_t>() > 1) {
    p.max_new_tokens *= std::min<uint64_t>(n->get<uint64_t>(), 1024);
  }
  // kv_transfer_params come only from the frontend: a client's own could
  // name a kvtier fence (a decode engine would wait on the store for it)
  // or ask an engine to hand its KV on.
  req.erase("kv_transfer_params");
  if (req.contains("stream")) {
    if (!req["stream"].is_boolean()) return Fail(Invalid("stream must be a boolean", "stream"));
    p.stream = req["stream"].get<bool>();
  }
  if (req.contains("cache_salt")) {
    if (!req["cache_salt"].is_string()) {
      return Fail(Invalid("cache_salt must be a string", "cache_salt"));
    }
    p.cache_salt = req["cache_salt"].get<std::string>();
  }
  p.variant = ChainVariant(p.adapter, p.cache_salt);
  if (req.contains("prompt_embeds")) {
    return Fail(
        Invalid("prompt_embeds are not routed by the frontend; send a prompt", "prompt_embeds"));
  }
  if (!chat) {
    p.path = "/v1/completions";
    if (!req.contains("prompt")) return Fail(Invalid("prompt is required", "prompt"));
    bool add_special = true;
    if (req.contains("add_special_tokens")) {
      if (!req["add_special_tokens"].is_boolean()) {
        return Fail(Invalid("add_special_tokens must be a boolean", "add_special_tokens"));
      }
      add_special = req["add_special_tokens"].get<bool>();
    }
    const json& prompt = req["prompt"];
    // A list of prompts: of strings, or of token id lists.
    const bool batch =
        prompt.is_array() && !prompt.empty() && (prompt[0].is_string() || prompt[0].is_array());
    std::vector<std::vector<uint32_t>> all;
    if (batch) {
      if (prompt.size() > limits.max_prompts) {
        return Fail(
            Invalid(absl::StrCat("at most ", limits.max_prompts, " prompts a request"), "prompt"));
      }
      for (const json& one : prompt) {
        std::vector<uint32_t> ids;
        if (one.is_array() && !one.empty() && !one[0].is_number_integer()) {
          return Fail(Invalid("a list of prompts holds strings or token id lists", "prompt"));
        }
        if (auto e = PromptIds(one, text, add_special, &ids)) return Fail(*e);
        p.prompt_tokens += ids.size();
        all.push_back(std::move(ids));
      }
    } else {
      std::vector<uint32_t> ids;
      if (auto e = PromptIds(prompt, text, add_special, &ids)) return Fail(*e);
      p.prompt_tokens = ids.size();
      all.push_back(std::move(ids));
    }
    if (p.prompt_tokens > limits.max_prompt_tokens) {
      return Fail(
          ApiError{400, "invalid_request_error",
                   absl::StrCat("the prompt has ", p.prompt_tokens,
                                " tokens; this frontend takes at most ", limits.max_prompt_tokens),
                   "prompt", "context_length_exceeded"});
    }
    p.tokens = all.front();
    req["prompt"] = batch ? json(all) : json(all.front());
    // The ids already carry what add_special_tokens asked for.
    req.erase("add_special_tokens");
  } else {
    p.path = "/v1/chat/completions";
    if (!req.contains("messages") || !req["messages"].is_array() || req["messages"].empty()) {
      return Fail(Invalid("messages must be a non-empty array", "messages"));
    }
    if (req.contains("chat_template")) {
      return Fail(
          Invalid("a request's own chat_template is not taken: the frontend and the "
                  "engine render the model's",
                  "chat_template"));
    }
    if (req.value("continue_final_message", false)) {
      return Fail(Invalid("continue_final_message is not supported by the frontend",
                          "continue_final_message"));
    }
    json render = {{"messages", req["messages"]}};
    if (req.contains("add_generation_prompt")) {
      if (!req["add_generation_prompt"].is_boolean()) {
        return Fail(Invalid("add_generation_prompt must be a boolean", "add_generation_prompt"));
      }
      render["add_generation_prompt"] = req["add_generation_prompt"];
    }
    for (const char* key : {"tools", "documents", "chat_template_kwargs"}) {
      if (req.contains(key) && !req[key].is_null()) render[key] = req[key];
    }
    auto ids = text.EncodeChat(render.dump());
    if (!ids.ok()) return Fail(Invalid(std::string(ids.status().message()), "messages"));
    p.tokens = std::move(*ids);
    p.prompt_tokens = p.tokens.size();
    if (p.prompt_tokens > limits.max_prompt_tokens) {
      return Fail(
          ApiError{400, "invalid_request_error",
                   absl::StrCat("the messages are ", p.prompt_tokens,
                                " tokens; this frontend takes at most ", limits.max_prompt_tokens),
                   "messages", "context_length_exceeded"});
    }
  }
  if (!req.contains("model") || req["model"].get_ref<const std::string&>().empty()) {
    req["model"] = served_model;
  }
  const bool one_prompt =
      chat || !(req["prompt"].is_array() && !req["prompt"].empty() && req["prompt"][0].is_array());
  const bool one_choice = !req.contains("n") || req["n"].is_null() || req["n"] == 1;
  // Prompt logprobs (and echo) need every prompt position computed where
  // the answer is made: a decode engine that loaded the prompt has none.
  const auto asks = [&req](const char* key) {
    auto it = req.find(key);
    return it != req.end() && !it->is_null() && *it != false;
  };
  p.disaggregable = one_prompt && one_choice && !req.contains("best_of") &&
                    !asks("prompt_logprobs") && !asks("echo");
  p.body = req.dump(-1, ' ', false, json::error_handler_t::replace);
  return r;
}

}  // namespace

PrepareResult Prepare(Endpoint endpoint, std::string_view body, const TextModel& text,
                      const std::string& served_model, const RequestLimits& limits,
                      const std::vector<std::string>& adapters) {
  const std::vector<ServedModel> one = {ServedModel{served_model, adapters, &text, 0, 0}};
  return Prepare(endpoint, body, one, limits);
}

PrepareResult Prepare(Endpoint endpoint, std::string_view body,
                      const std::vector<ServedModel>& models, const RequestLimits& limits) {
  // A field of the wrong type that a check above missed (JSON's own
  // accessors throw) is the client's error, answered as such.
  try {
    return PrepareOrThrow(endpoint, body, models, limits);
  } catch (const json::exception& e) {
    return Fail(Invalid(absl::StrCat("a field has the wrong type: ", e.what())));
  }
}

std::string PrefillBody(const Prepared& p, const std::string& kv_request_id) {
  json req = json::parse(p.body, nullptr, false);
  req["max_tokens"] = 1;
  if (req.contains("max_completion_tokens")) req["max_completion_tokens"] = 1;
  // Nothing that asks for more than the one token, or streams it.
  for (const char* key : {"min_tokens", "stream_options", "best_of"}) req.erase(key);
  req["stream"] = false;
  req["kv_transfer_params"] = json{{"remote_decoder", {{"kv_request_id", kv_request_id}}}};
  return req.dump(-1, ' ', false, json::error_handler_t::replace);
}

Handoff HandoffOf(absl::string_view answer, const std::string& kv_request_id) {
  Handoff h;
  const json res = json::parse(answer.begin(), answer.end(), nullptr, false);
  if (!res.is_object()) {
    h.why = "its answer is not a JSON object";
    return h;
  }
  h.params = json{{"remote_prefiller", {{"kv_request_id", kv_request_id}}}};
  h.kind = Handoff::kKeysOnly;
  auto it = res.find("kv_transfer_params");
  if (it == res.end() || !it->is_object()) return h;
  auto entry = it->find("kvtier");
  if (entry == it->end() || !entry->is_object()) return h;
  if (entry->contains("not_sent")) {
    h.kind = Handoff::kNotSent;
    h.why = entry->at("not_sent").is_string() ? entry->at("not_sent").get<std::string>()
                                              : entry->at("not_sent").dump();
    return h;
  }
  h.kind = Handoff::kFence;
  h.params["kvtier"] = *entry;
  return h;
}

std::string DecodeBody(const Prepared& p, const json& params) {
  json req = json::parse(p.body, nullptr, false);
  req["kv_transfer_params"] = params;
  return req.dump(-1, ' ', false, json::error_handler_t::replace);
}

VllmLoad ParseVllmMetrics(absl::string_view text) {
  VllmLoad load;
  double usage_sum = 0;
  int usage_n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line.front() == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos) continue;
    const absl::string_view name = line.substr(0, name_end);
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos || space + 1 >= line.size()) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &value) || !std::isfinite(value)) continue;
    if (name == "vllm:num_requests_running") {
      load.running += value;
      load.seen = true;
    } else if (name == "vllm:num_requests_waiting") {
      load.waiting += value;
      load.seen = true;
    } else if (name == "vllm:kv_cache_usage_perc") {
      usage_sum += value;
      usage_n++;
      load.seen = true;
    } else if (name == "vllm:cache_config_info") {
      constexpr absl::string_view kKey = "num_gpu_blocks=\"";
      const size_t at = line.find(kKey);
      if (at == absl::string_view::npos) continue;
      const size_t from = at + kKey.size();
      const size_t to = line.find('"', from);
      uint64_t blocks = 0;
      if (to != absl::string_view::npos &&
          absl::SimpleAtoi(line.substr(from, to - from), &blocks)) {
        load.gpu_blocks += blocks;
      }
    }
  }
  if (usage_n > 0) load.kv_usage = std::clamp(usage_sum / usage_n, 0.0, 1.0);
  return load;
}

}  // namespace kvtier::frontend
