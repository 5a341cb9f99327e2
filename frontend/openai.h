// The OpenAI API's requests as the frontend takes them: checked (OpenAI's
// error JSON with the status a client should see), tokenized with the
// model's own tokenizer and chat template (TextModel), and rewritten for the
// engine: a completion's prompt travels as token ids, so the engine computes
// exactly the blocks the router priced; a chat travels as messages, which
// vLLM renders with the same template into the same ids (tests/python/
// test_text_model.py holds the two equal), so its response keeps the chat
// format. Pure functions: tests/openai_test.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/string_view.h"
#include "frontend/events.h"
#include "frontend/text_model.h"
#include "nlohmann/json.hpp"

namespace kvtier::frontend {

// An error a client gets, in OpenAI's shape:
// {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // "" : null
  std::string code;   // "" : null
};
std::string ErrorBody(const ApiError& e);

enum class Endpoint { kCompletions, kChat, kPassThrough };

// A model this frontend serves: the name clients send, its LoRA adapters
// (names a request may send instead), its tokenizer and chat template, and
// the namespace its engines' blocks are keyed in (an engine serves the
// model whose namespace it has).
struct ServedModel {
  std::string name;
  std::vector<std::string> adapters;
  const TextModel* text = nullptr;
  uint64_t max_model_len = 0;  // what /v1/models reports
  uint64_t namespace_id = 0;
};

// The model `name` names (itself or one of its adapters) among `models`;
// an empty name is the first model. Nothing when none serves it.
const ServedModel* FindModel(const std::vector<ServedModel>& models, std::string_view name);
// The model a request's JSON names: `*m` set, or the client's error (400
// for a `model` that is not a string, 404 for one not served).
std::optional<ApiError> ModelOf(const nlohmann::json& req, const std::vector<ServedModel>& models,
                                const ServedModel** m);

struct RequestLimits {
  uint64_t max_prompt_tokens = 131072;  // summed over a batch's prompts
  uint32_t max_prompts = 64;            // prompts in one completions request
};

// A request ready to go upstream.
struct Prepared {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string path;              // /v1/completions or /v1/chat/completions
  std::string body;              // the JSON sent upstream
  std::vector<uint32_t> tokens;  // what routing prices: the (first) prompt's ids
  uint64_t prompt_tokens = 0;    // every prompt's ids
  bool stream = false;
  std::string cache_salt;     // vLLM's cache_salt: its blocks hash apart
  std::string adapter;        // the LoRA adapter the request names ("": the base model)
  uint64_t variant = 0;       // ChainVariant(adapter, cache_salt): where its chain is rooted
  uint64_t namespace_id = 0;  // its model's (ServedModel): the engines that serve it
  // What a token-rate limit charges: every prompt's tokens and the tokens
  // it may generate (max_tokens or max_completion_tokens times n; 0 when
  // it sets neither).
  uint64_t max_new_tokens = 0;
  // One prompt, one choice, no prompt logprobs or echo: a prefill engine
  // may compute it for a decode engine. (A client's kv_transfer_params are
  // dropped: only the frontend sets them.)
  bool disaggregable = false;
};

// Checks and prepares `body` for `endpoint`. `served_model`: the name
// clients use (an empty model field means it); `adapters`: the LoRA
// adapters the engines serve, which a request may name instead (another
// name is a 404).
// Errors: 400 for JSON that is not a request of this endpoint (a field of
// the wrong type, an unknown field, a prompt the template refuses) and for
// a prompt over the limit (code context_length_exceeded, as OpenAI and
// vLLM answer), 404 for another model. (413 is the server's, for a body
// over --max-body-bytes.)
struct PrepareResult {
  std::optional<ApiError> error;
  Prepared prepared;
};
PrepareResult Prepare(Endpoint endpoint, std::string_view body, const TextModel& text,
                      const std::string& served_model, const RequestLimits& limits,
                      const std::vector<std::string>& adapters = {});
// The same among several models: the request's `model` picks one (404
// when none serves it), whose tokenizer prepares it.
PrepareResult Prepare(Endpoint endpoint, std::string_view body,
                      const std::vector<ServedModel>& models, const RequestLimits& limits);

// The vLLM endpoints passed through as they are (kPassThroughPaths: POST
// /tokenize, /detokenize, /v1/embeddings, /v1/responses, /v1/score, ...),
// sent to the least-loaded engine of the model the body names. The body
// must be a JSON object; its `model`, when set, must be served (404
// otherwise); an empty or absent one is the first model, which the body
// then names (vLLM requires it on some of these). Nothing is tokenized.
inline constexpr const char* kPassThroughPaths[] = {
    "/tokenize",  "/detokenize", "/v1/embeddings", "/v1/responses", "/v1/score", "/score",
    "/v1/rerank", "/rerank",     "/v2/rerank",     "/pooling",      "/classify", "/v1/classify"};
bool IsPassThrough(std::string_view path);
PrepareResult PreparePassThrough(std::string_view path, std::string_view body,
                                 const std::vector<ServedModel>& models);

// Prefill/decode (docs/disaggregation.md, "The protocol": vLLM's offloading
// P/D keys, which kvtier's connector and its offloading tier both speak).
// The prefill engine's request: `p`'s, answered with one token, unstreamed,
// asking the engine to hand the prompt's KV on under `kv_request_id`
// (vLLM's remote_decoder).
std::string PrefillBody(const Prepared& p, const std::string& kv_request_id);
// What a prefill's 200 answer says of its handoff.
struct Handoff {
  enum Kind {
    kFence,     // kvtier's connector: the decode's keys and its fence
    kKeysOnly,  // no params (vLLM's offloading connector, kvtier's tier)
    kNotSent,   // the engine handed nothing on (its store did not answer)
  };
  Kind kind = kNotSent;
  nlohmann::json params;  // the decode's kv_transfer_params (not kNotSent)
  std::string why;        // kNotSent: why
};
// The decode's kv_transfer_params for `kv_request_id` from a prefill's 200
// answer: vLLM's remote_prefiller keys, with the kvtier fence the answer
// carries (kFence) or alone (kKeysOnly); kNotSent when the answer says the
// engine handed nothing on, or is not an answer (not a JSON object).
Handoff HandoffOf(absl::string_view answer, const std::string& kv_request_id);
// The decode engine's request: `p`'s with the handoff's kv_transfer_params.
std::string DecodeBody(const Prepared& p, const nlohmann::json& params);

// GET /v1/models: the model this frontend serves and its LoRA adapters
// (each with the model as its parent, as vLLM lists them).
std::string ModelsBody(const std::string& served_model, uint64_t created_unix,
                       uint64_t max_model_len, const std::vector<std::string>& adapters = {});
// Every model of `models` and its adapters.
std::string ModelsBody(const std::vector<ServedModel>& models, uint64_t created_unix);

// What a vLLM server's own /metrics (Prometheus text) says of its load:
// each gauge summed over its label sets (one per model and engine).
struct VllmLoad {
  bool seen = false;        // any of the gauges below was present
  double running = 0;       // vllm:num_requests_running
  double waiting = 0;       // vllm:num_requests_waiting
  double kv_usage = -1;     // vllm:kv_cache_usage_perc, 0..1 (-1: absent)
  uint64_t gpu_blocks = 0;  // num_gpu_blocks of vllm:cache_config_info (0: absent)
};
// Reads the lines it knows and skips every other; text that is not
// Prometheus' gives seen == false, never an error.
VllmLoad ParseVllmMetrics(absl::string_view text);

}  // namespace kvtier::frontend
