// Prepare (frontend/openai.h): what a request becomes upstream (a
// completion's prompt as the model's token ids, a chat as its messages),
// what routing prices, and the error each bad request gets, in OpenAI's
// shape and status.
#include "frontend/openai.h"

#include <gtest/gtest.h>

#include "common/block_key.h"
#include "nlohmann/json.hpp"

namespace kvtier::frontend {
namespace {

using nlohmann::json;

const TextModel& Tiny() {
  static std::unique_ptr<TextModel> m = [] {
    auto t = TextModel::Open(std::string(KVTIER_SOURCE_DIR) + "/tests/models/tiny-llama");
    EXPECT_TRUE(t.ok()) << t.status();
    return std::move(*t);
  }();
  return *m;
}

PrepareResult Completion(const json& body, RequestLimits limits = {}) {
  return Prepare(Endpoint::kCompletions, body.dump(), Tiny(), "tiny", limits);
}

TEST(OpenAi, ATextPromptTravelsAsTheModelsTokenIds) {
  auto r = Completion({{"model", "tiny"},
                       {"prompt", "The store tiers blocks."},
                       {"max_tokens", 4},
                       {"stream", true},
                       {"priority", 2}});
  ASSERT_FALSE(r.error) << r.error->message;
  const auto want = *Tiny().Encode("The store tiers blocks.");
  EXPECT_EQ(r.prepared.tokens, want);
  EXPECT_EQ(r.prepared.path, "/v1/completions");
  EXPECT_TRUE(r.prepared.stream);
  json up = json::parse(r.prepared.body);
  EXPECT_EQ(up["prompt"].get<std::vector<uint32_t>>(), want);
  EXPECT_EQ(up["max_tokens"], 4);
  EXPECT_EQ(up["priority"], 2) << "vLLM's own fields pass through";
  // Without the model's BOS when the client says so; the field is spent.
  auto plain = Completion({{"prompt", "The store tiers blocks."}, {"add_special_tokens", false}});
  ASSERT_FALSE(plain.error);
  EXPECT_EQ(plain.prepared.tokens.size() + 1, want.size());
  EXPECT_FALSE(json::parse(plain.prepared.body).contains("add_special_tokens"));
  EXPECT_EQ(json::parse(plain.prepared.body)["model"], "tiny") << "an absent model is ours";
}

TEST(OpenAi, TokenIdsAndListsOfPromptsAreTaken) {
  auto ids = Completion({{"prompt", {1, 200, 300}}});
  ASSERT_FALSE(ids.error);
  EXPECT_EQ(ids.prepared.tokens, (std::vector<uint32_t>{1, 200, 300}));
  auto batch = Completion({{"prompt", {"first prompt", "second"}}});
  ASSERT_FALSE(batch.error);
  json up = json::parse(batch.prepared.body);
  ASSERT_EQ(up["prompt"].size(), 2u);
  EXPECT_EQ(up["prompt"][1].get<std::vector<uint32_t>>(), *Tiny().Encode("second"));
  EXPECT_EQ(batch.prepared.tokens, *Tiny().Encode("first prompt")) << "routed by the first";
  auto lists = Completion({{"prompt", {{1, 2}, {1, 3, 4}}}});
  ASSERT_FALSE(lists.error);
  EXPECT_EQ(lists.prepared.prompt_tokens, 5u);
}

// Prefill/decode: the prefill engine answers one token, unstreamed, and
// hands the KV on; the decode gets the client's request with the prefill's
// params; only a kvtier handoff in an answer counts.
TEST(OpenAi, APrefillAsksForOneTokenAndTheDecodeCarriesItsHandoff) {
  auto r = Completion({{"prompt", {1, 200, 300}},
                       {"max_tokens", 40},
                       {"min_tokens", 8},
                       {"stream", true},
                       {"stream_options", {{"include_usage", true}}},
                       {"priority", 3}});
  ASSERT_FALSE(r.error);
  EXPECT_TRUE(r.prepared.disaggregable);
  json pre = json::parse(PrefillBody(r.prepared, "kvtier-1"));
  EXPECT_EQ(pre["max_tokens"], 1);
  EXPECT_EQ(pre["stream"], false);
  EXPECT_FALSE(pre.contains("min_tokens")) << "more than one token would be refused";
  EXPECT_FALSE(pre.contains("stream_options"));
  EXPECT_EQ(pre["kv_transfer_params"], json::parse(R"({"remote_decoder":
                                                         {"kv_request_id": "kvtier-1"}})"));
  EXPECT_EQ(pre["prompt"], json({1, 200, 300}));
  EXPECT_EQ(pre["priority"], 3);
  const json keys = {{"remote_prefiller", {{"kv_request_id", "kvtier-1"}}}};
  // kvtier's connector: its fence rides with the decode's keys.
  const json fence = {{"namespace", "00c0ffee00c0ffee"}, {"blocks", 31}};
  Handoff h =
      HandoffOf(json({{"choices", json::array()},
                      {"kv_transfer_params",
                       {{"remote_prefiller", {{"kv_request_id", "x"}}}, {"kvtier", fence}}}})
                    .dump(),
                "kvtier-1");
  ASSERT_EQ(h.kind, Handoff::kFence);
  json want = keys;
  want["kvtier"] = fence;
  EXPECT_EQ(h.params, want) << "the frontend's own id, the engine's fence";
  // An engine that answers no params (vLLM's offloading connector with
  // kvtier's tier), or another connector's: the keys alone.
  for (const std::string& answer :
       {json({{"choices", json::array()}}).dump(), json({{"kv_transfer_params", nullptr}}).dump(),
        json({{"kv_transfer_params", {{"remote_block_ids", {1, 2}}}}}).dump()}) {
    h = HandoffOf(answer, "kvtier-1");
    EXPECT_EQ(h.kind, Handoff::kKeysOnly) << answer;
    EXPECT_EQ(h.params, keys) << answer;
  }
  // Handed nothing on: no handoff, saying why.
  h = HandoffOf(json({{"kv_transfer_params", {{"kvtier", {{"not_sent", "store down"}}}}}}).dump(),
                "kvtier-1");
  EXPECT_EQ(h.kind, Handoff::kNotSent);
  EXPECT_EQ(h.why, "store down");
  EXPECT_EQ(HandoffOf("not json", "kvtier-1").kind, Handoff::kNotSent);
  json dec = json::parse(DecodeBody(r.prepared, want));
  EXPECT_EQ(dec["kv_transfer_params"], want);
  EXPECT_EQ(dec["max_tokens"], 40);
  EXPECT_EQ(dec["min_tokens"], 8);
  EXPECT_EQ(dec["stream"], true);
  // Not split: several prompts or choices, prompt logprobs or echo (the
  // decode engine would have no prompt positions to score).
  EXPECT_FALSE(Completion({{"prompt", {{1, 2}, {1, 3}}}}).prepared.disaggregable);
  EXPECT_FALSE(Completion({{"prompt", {1, 2}}, {"n", 2}}).prepared.disaggregable);
  EXPECT_FALSE(Completion({{"prompt", {1, 2}}, {"prompt_logprobs", 1}}).prepared.disaggregable);
  EXPECT_FALSE(Completion({{"prompt", {1, 2}}, {"echo", true}}).prepared.disaggregable);
  EXPECT_TRUE(Completion({{"prompt", {1, 2}}, {"echo", false}}).prepared.disaggregable);
  EXPECT_TRUE(
      Completion({{"prompt", {1, 2}}, {"prompt_logprobs", nullptr}}).prepared.disaggregable);
}

// A client cannot hand an engine a fence (it would make a decode engine
// wait on the store for blocks nobody wrote) nor ask it to hand its KV on:
// kv_transfer_params come only from the frontend.
TEST(OpenAi, AClientsKvTransferParamsNeverReachAnEngine) {
  const json forged = {{"kvtier", {{"namespace", "00c0ffee00c0ffee"}, {"blocks", 9999}}}};
  for (const json& params : {forged, json({{"do_remote_decode", true}})}) {
    auto r = Completion({{"prompt", {1, 2, 3}}, {"kv_transfer_params", params}});
    ASSERT_FALSE(r.error) << r.error->message;
    EXPECT_FALSE(json::parse(r.prepared.body).contains("kv_transfer_params")) << params;
    EXPECT_TRUE(r.prepared.disaggregable) << "served as any other request";
  }
  json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
               {"kv_transfer_params", forged}};
  auto c = Prepare(Endpoint::kChat, chat.dump(), Tiny(), "tiny", {});
  ASSERT_FALSE(c.error) << c.error->message;
  EXPECT_FALSE(json::parse(c.prepared.body).contains("kv_transfer_params"));
}

TEST(OpenAi, AChatTravelsAsMessagesAndIsPricedByItsTemplatesIds) {
  json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  auto r = Prepare(Endpoint::kChat, body.dump(), Tiny(), "tiny", {});
  ASSERT_FALSE(r.error) << r.error->message;
  EXPECT_EQ(r.prepared.path, "/v1/chat/completions");
  EXPECT_EQ(r.prepared.tokens,
            *Tiny().EncodeChat(R"({"messages": [{"role": "user", "content": "hi"}]})"));
  EXPECT_EQ(json::parse(r.prepared.body)["messages"], body["messages"]);
}

TEST(OpenAi, EachBadRequestGetsItsStatusAndSaysWhatWasWrong) {
  struct Case {
    Endpoint endpoint;
    std::string body;
    int status;
    std::string says;
  };
  const std::vector<Case> cases = {
      {Endpoint::kCompletions, R"({"prompt": )", 400, "not valid JSON"},
      {Endpoint::kCompletions, R"([1, 2])", 400, "JSON object"},
      {Endpoint::kCompletions, R"({"prompt": "x", "model": "gpt-9"})", 404, "gpt-9"},
      {Endpoint::kCompletions, R"({"prompt": "x", "frobnicate": 1})", 400, "frobnicate"},
      {Endpoint::kCompletions, R"({"max_tokens": 3})", 400, "prompt is required"},
      {Endpoint::kCompletions, R"({"prompt": {"a": 1}})", 400, "prompt must be"},
      {Endpoint::kCompletions, R"({"prompt": [1, 99999]})", 400, "[0, 4096)"},
      {Endpoint::kCompletions, R"({"prompt": [1, -2]})", 400, "[0, 4096)"},
      {Endpoint::kCompletions, R"({"prompt": "x", "stream": "yes"})", 400, "stream"},
      {Endpoint::kCompletions, R"({"prompt": "x", "messages": []})", 400, "messages"},
      {Endpoint::kChat, R"({"messages": []})", 400, "non-empty"},
      {Endpoint::kChat, R"({"messages": [{"role": "wizard", "content": "x"}]})", 400,
       "unknown role"},
      {Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}], "prompt": "x"})", 400,
       "prompt"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"})", 400,
       "chat_template"},
      // JSON's own accessors throw on a wrong type: answered, not a dropped
      // connection.
      {Endpoint::kChat,
       R"({"messages": [{"role": "user", "content": "x"}], "continue_final_message": "yes"})", 400,
       "wrong type"},
  };
  for (const Case& c : cases) {
    auto r = Prepare(c.endpoint, c.body, Tiny(), "tiny", {});
    ASSERT_TRUE(r.error) << c.body;
    EXPECT_EQ(r.error->status, c.status) << c.body;
    EXPECT_NE(r.error->message.find(c.says), std::string::npos)
        << c.body << ": " << r.error->message;
    json err = json::parse(ErrorBody(*r.error));
    EXPECT_EQ(err["error"]["message"], r.error->message);
    EXPECT_TRUE(err["error"].contains("type") && err["error"].contains("param") &&
                err["error"].contains("code"));
  }
}

TEST(OpenAi, PromptsOverTheLimitAreRefusedAsOpenAiRefusesThem) {
  RequestLimits small;
  small.max_prompt_tokens = 8;
  small.max_prompts = 2;
  auto r = Completion({{"prompt", std::vector<uint32_t>(9, 5)}}, small);
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->status, 400);
  EXPECT_EQ(r.error->code, "context_length_exceeded");
  auto many = Completion({{"prompt", {"a", "b", "c"}}}, small);
  ASSERT_TRUE(many.error);
  EXPECT_NE(many.error->message.find("at most 2 prompts"), std::string::npos);
  EXPECT_FALSE(Completion({{"prompt", std::vector<uint32_t>(8, 5)}}, small).error);
}

TEST(OpenAi, ModelsListsTheServedModel) {
  json m = json::parse(ModelsBody("tiny", 1700000000, 4096));
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["max_model_len"], 4096);
}

// A request naming a LoRA adapter the engines serve goes to them as it is,
// its chain rooted at the adapter (and its cache salt, if any), so it is
// routed on that adapter's blocks; an adapter nobody serves is a 404.
TEST(OpenAi, AnAdapterOrACacheSaltRootsTheRequestsChain) {
  const std::vector<std::string> adapters = {"sql"};
  auto prepare = [&](const json& body) {
    return Prepare(Endpoint::kCompletions, body.dump(), Tiny(), "tiny", {}, adapters);
  };
  auto lora = prepare({{"model", "sql"}, {"prompt", "hello there"}});
  ASSERT_FALSE(lora.error) << lora.error->message;
  EXPECT_EQ(lora.prepared.adapter, "sql");
  EXPECT_EQ(lora.prepared.variant, ChainVariant("sql", ""));
  EXPECT_EQ(json::parse(lora.prepared.body)["model"], "sql");
  auto salted = prepare({{"model", "sql"}, {"prompt", "hello there"}, {"cache_salt", "t7"}});
  EXPECT_EQ(salted.prepared.variant, ChainVariant("sql", "t7"));
  auto base = prepare({{"model", "tiny"}, {"prompt", "hello there"}});
  EXPECT_EQ(base.prepared.adapter, "");
  EXPECT_EQ(base.prepared.variant, 0u);
  EXPECT_EQ(prepare({{"prompt", "hello"}, {"cache_salt", "t7"}}).prepared.variant,
            ChainVariant("", "t7"));
  auto other = prepare({{"model", "chat"}, {"prompt", "hello"}});
  ASSERT_TRUE(other.error);
  EXPECT_EQ(other.error->status, 404);
  json m = json::parse(ModelsBody("tiny", 1700000000, 4096, adapters));
  ASSERT_EQ(m["data"].size(), 2u);
  EXPECT_EQ(m["data"][1]["id"], "sql");
  EXPECT_EQ(m["data"][1]["parent"], "tiny");
}

// A stream is forwarded up to its last whole event: a piece cut after
// "data:" keeps that event back until its end comes.
TEST(OpenAi, AStreamOpeningWithAnEnginesOwnErrorFailsBeforeItsFirstToken) {
  // vLLM's event when its engine core died before the first token.
  const std::string died =
      "data: {\"error\": {\"message\": \"EngineCore encountered an issue.\", "
      "\"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n"
      "data: [DONE]\n\n";
  EXPECT_TRUE(FailsBeforeItsFirstToken(died));
  EXPECT_TRUE(FailsBeforeItsFirstToken(": keep-alive\n\n" + died));
  // A client's error is the client's answer; a token is an answer.
  EXPECT_FALSE(
      FailsBeforeItsFirstToken("data: {\"error\": {\"message\": \"bad\", \"code\": 400}}\n\n"));
  EXPECT_FALSE(FailsBeforeItsFirstToken(
      "data: {\"id\": \"cmpl-1\", \"choices\": [{\"text\": \"Hi\"}]}\n\n" + died));
  EXPECT_FALSE(FailsBeforeItsFirstToken("data: {\"error\": \"text\"}\n\n"));
  EXPECT_FALSE(FailsBeforeItsFirstToken("data: [DONE]\n\n"));
  EXPECT_FALSE(FailsBeforeItsFirstToken(""));
}

// vLLM ends a request it aborted before its first token (a draining
// engine's, after SIGTERM) with no choice at all: a usage-only event when
// the client asked for usage, then [DONE]. That answers nothing, and the
// frontend holds it back; a token, a finish, an error answers.
TEST(OpenAi, EventsThatCarryNoTokenAnswerNothing) {
  EXPECT_EQ(ClassifyEvents(""), StreamPiece::kComments);
  EXPECT_EQ(ClassifyEvents(": keep-alive\n\n"), StreamPiece::kComments);
  EXPECT_EQ(ClassifyEvents("data: [DONE]\n\n"), StreamPiece::kNoAnswer);
  EXPECT_EQ(ClassifyEvents("data: {\"id\": \"cmpl-1\", \"choices\": [], \"usage\": "
                           "{\"completion_tokens\": 0}}\n\ndata: [DONE]\n\n"),
            StreamPiece::kNoAnswer);
  // A chat's role delta comes before its first token.
  EXPECT_EQ(ClassifyEvents("data: {\"choices\": [{\"index\": 0, \"delta\": {\"role\": "
                           "\"assistant\", \"content\": \"\"}, \"finish_reason\": null}]}\n\n"),
            StreamPiece::kNoAnswer);
  EXPECT_EQ(ClassifyEvents("data: {\"choices\": [{\"text\": \"\", \"finish_reason\": "
                           "\"abort\"}]}\n\n"),
            StreamPiece::kNoAnswer);
  // Answers.
  EXPECT_EQ(ClassifyEvents("data: {\"choices\": [{\"text\": \"Hi\"}]}\n\n"), StreamPiece::kAnswer);
  EXPECT_EQ(ClassifyEvents(": ping\n\ndata: {\"choices\": [{\"delta\": {\"content\": "
                           "\"Hi\"}}]}\n\n"),
            StreamPiece::kAnswer);
  EXPECT_EQ(ClassifyEvents("data: {\"choices\": [{\"delta\": {\"tool_calls\": [{\"id\": "
                           "\"t\"}]}}]}\n\n"),
            StreamPiece::kAnswer);
  // A first token that is the end (EOS at once) still finishes: "stop".
  EXPECT_EQ(ClassifyEvents("data: {\"choices\": [{\"text\": \"\", \"finish_reason\": "
                           "\"stop\"}]}\n\n"),
            StreamPiece::kAnswer);
  EXPECT_EQ(ClassifyEvents("data: {\"error\": {\"message\": \"bad\", \"code\": 400}}\n\n"),
            StreamPiece::kAnswer);
  EXPECT_EQ(ClassifyEvents("data: not json\n\n"), StreamPiece::kAnswer);
  EXPECT_EQ(ClassifyEvents("event: x\ndata: [DONE]\n\n"), StreamPiece::kAnswer);
}

TEST(OpenAi, AWholeAnswerAbortedBeforeItsFirstTokenIsNoAnswer) {
  EXPECT_TRUE(AbortedWithNoToken(
      "{\"choices\": [{\"index\": 0, \"text\": \"\", \"finish_reason\": \"abort\"}], "
      "\"usage\": {\"prompt_tokens\": 7, \"completion_tokens\": 0}}"));
  EXPECT_TRUE(AbortedWithNoToken(
      "{\"choices\": [{\"message\": {\"role\": \"assistant\", \"content\": \"\"}, "
      "\"finish_reason\": \"abort\"}]}"));
  // Tokens made before the abort are an answer; so is any other finish.
  EXPECT_FALSE(
      AbortedWithNoToken("{\"choices\": [{\"text\": \"Hi\", \"finish_reason\": \"abort\"}], "
                         "\"usage\": {\"completion_tokens\": 1}}"));
  EXPECT_FALSE(
      AbortedWithNoToken("{\"choices\": [{\"text\": \"\", \"finish_reason\": \"abort\"}], "
                         "\"usage\": {\"completion_tokens\": 2}}"));
  EXPECT_FALSE(
      AbortedWithNoToken("{\"choices\": [{\"text\": \"\", \"finish_reason\": "
                         "\"length\"}]}"));
  EXPECT_FALSE(AbortedWithNoToken("{\"choices\": []}"));
  EXPECT_FALSE(AbortedWithNoToken("not json"));
}

TEST(OpenAi, SseEventsEndIsJustPastTheLastBlankLine) {
  EXPECT_EQ(SseEventsEnd(""), 0u);
  EXPECT_EQ(SseEventsEnd("data: {\"a\":1}"), 0u);
  EXPECT_EQ(SseEventsEnd("data: {\"a\":1}\n"), 0u);
  const std::string one = "data: {\"a\":1}\n\n";
  EXPECT_EQ(SseEventsEnd(one), one.size());
  EXPECT_EQ(SseEventsEnd(one + "data:"), one.size());
  EXPECT_EQ(SseEventsEnd(one + one + "da"), 2 * one.size());
  const std::string crlf = "data: {\"a\":1}\r\n\r\n";
  EXPECT_EQ(SseEventsEnd(crlf + "data: {"), crlf.size());
  EXPECT_EQ(SseEventsEnd(": keep-alive\n\n"), 14u);
}

// The gauges as vLLM 0.1x's /metrics writes them (labels per model and
// engine; two engines of a data-parallel server are summed).
TEST(OpenAi, VllmsMetricsGiveItsRunningWaitingAndKvUse) {
  const std::string text =
      R"(# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000",num_cpu_blocks="None"} 1.0
vllm:num_requests_running_total 99
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 12345.0
)";
  VllmLoad load = ParseVllmMetrics(text);
  EXPECT_TRUE(load.seen);
  EXPECT_DOUBLE_EQ(load.running, 4);
  EXPECT_DOUBLE_EQ(load.waiting, 7);
  EXPECT_DOUBLE_EQ(load.kv_usage, 0.375);
  EXPECT_EQ(load.gpu_blocks, 1000u);
}

TEST(OpenAi, MetricsThatAreNotVllmsSayNothing) {
  for (const char* text :
       {"", "<html>nope</html>", "vllm:num_requests_running{ NaN\n",
        "vllm:num_requests_running{a=\"b\"} not-a-number\n", "vllm:kv_cache_usage_perc 1e999\n"}) {
    VllmLoad load = ParseVllmMetrics(text);
    EXPECT_FALSE(load.seen) << text;
    EXPECT_EQ(load.kv_usage, -1) << text;
  }
  EXPECT_EQ(ParseVllmMetrics("vllm:kv_cache_usage_perc 7\n").kv_usage, 1);
}

// Several models: the request's `model` (or an adapter of one) picks the
// model whose namespace its engines have; an empty one is the first.
TEST(OpenAi, AModelNamePicksItsModelsNamespace) {
  const std::vector<ServedModel> models = {ServedModel{"a", {}, &Tiny(), 0, 11},
                                           ServedModel{"b", {"b-sql"}, &Tiny(), 0, 22}};
  auto prep = [&](const json& body) {
    return Prepare(Endpoint::kCompletions, body.dump(), models, RequestLimits{});
  };
  EXPECT_EQ(prep({{"model", "b"}, {"prompt", "hi"}}).prepared.namespace_id, 22u);
  EXPECT_EQ(prep({{"model", "a"}, {"prompt", "hi"}}).prepared.namespace_id, 11u);
  auto adapter = prep({{"model", "b-sql"}, {"prompt", "hi"}});
  EXPECT_EQ(adapter.prepared.namespace_id, 22u);
  EXPECT_EQ(adapter.prepared.adapter, "b-sql");
  auto unnamed = prep({{"prompt", "hi"}});
  EXPECT_EQ(unnamed.prepared.namespace_id, 11u);
  EXPECT_EQ(json::parse(unnamed.prepared.body)["model"], "a");
  auto other = prep({{"model", "c"}, {"prompt", "hi"}});
  ASSERT_TRUE(other.error);
  EXPECT_EQ(other.error->status, 404);
  EXPECT_EQ(other.error->code, "model_not_found");
}

// What a token rate charges: the prompt and what the request may generate.
TEST(OpenAi, ARequestSaysHowManyTokensItMayGenerate) {
  EXPECT_EQ(Completion({{"prompt", "hi"}, {"max_tokens", 7}, {"n", 3}}).prepared.max_new_tokens,
            21u);
  EXPECT_EQ(Completion({{"prompt", "hi"}}).prepared.max_new_tokens, 0u);
}

TEST(OpenAi, APassThroughBodyIsKeptAndNamesItsModel) {
  const std::vector<ServedModel> models = {ServedModel{"a", {}, &Tiny(), 0, 11}};
  auto r = PreparePassThrough("/v1/embeddings", R"({"input": "x"})", models);
  ASSERT_FALSE(r.error);
  EXPECT_EQ(r.prepared.path, "/v1/embeddings");
  EXPECT_EQ(json::parse(r.prepared.body), json({{"input", "x"}, {"model", "a"}}));
  EXPECT_TRUE(r.prepared.tokens.empty());
  const std::string named = R"({"model": "a", "input": "x"})";
  EXPECT_EQ(PreparePassThrough("/v1/embeddings", named, models).prepared.body, named);
  EXPECT_EQ(PreparePassThrough("/v1/score", R"([1])", models).error->status, 400);
  EXPECT_EQ(PreparePassThrough("/v1/score", R"({"model": 3})", models).error->status, 400);
  EXPECT_TRUE(IsPassThrough("/tokenize"));
  EXPECT_FALSE(IsPassThrough("/v1/completions"));
}

}  // namespace
}  // namespace kvtier::frontend
