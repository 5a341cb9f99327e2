// What kvtier-frontend gives vLLM router users, against fake engines
// (tests/frontend_harness.h): API keys, each key's token rate, the bounded
// queue, retries with back-off, several models, and vLLM's other endpoints
// passed through.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "frontend/gate.h"
#include "frontend_harness.h"
#include "router/vllm_source_spec.h"

namespace kvtier::frontend::testing {
namespace {

// A key file in the test's temporary directory: each (key, line tail).
std::string KeyFile(const std::vector<std::pair<std::string, std::string>>& keys) {
  const std::string path = ::testing::TempDir() + "/keys-" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::ofstream out(path);
  out << "# sha256 name [tokens per minute]\n";
  for (const auto& [key, tail] : keys) out << ApiKeys::Digest(key) << " " << tail << "\n";
  return path;
}

Headers Bearer(const std::string& key) { return {{"authorization", "Bearer " + key}}; }

TEST(FrontendGate, EveryApiRequestNeedsAListedKey) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.api_keys_file = KeyFile({{"sk-alice", "alice"}});
  auto fe = StartFrontend({&e0}, o);
  Answer none = Post(fe->port(), kCompletion);
  EXPECT_EQ(none.status, 401) << none.body;
  EXPECT_NE(none.body.find("didn't provide an API key"), std::string::npos) << none.body;
  Answer wrong = Post(fe->port(), kCompletion, "/v1/completions", Bearer("sk-mallory"));
  EXPECT_EQ(wrong.status, 401) << wrong.body;
  EXPECT_NE(wrong.body.find("invalid_api_key"), std::string::npos) << wrong.body;
  EXPECT_EQ(e0.completions.load(), 0);
  Answer right = Post(fe->port(), kCompletion, "/v1/completions", Bearer("sk-alice"));
  EXPECT_EQ(right.status, 200) << right.body;
  EXPECT_EQ(Get(fe->port(), "/v1/models").status, 401);
  EXPECT_EQ(Get(fe->port(), "/health").status, 200);  // probes carry no key
}

TEST(FrontendGate, AKeyFileThatListsAKeyItselfIsRefused) {
  auto plain = ApiKeys::Parse("sk-alice alice\n", 0);
  ASSERT_FALSE(plain.ok());
  EXPECT_NE(plain.status().message().find("SHA-256"), std::string::npos) << plain.status();
  EXPECT_NE(plain.status().message().find("line 1"), std::string::npos) << plain.status();
  const std::string digest = ApiKeys::Digest("sk-alice");
  EXPECT_FALSE(ApiKeys::Parse(digest + " alice\n" + digest + " again\n", 0).ok());  // twice
  EXPECT_FALSE(ApiKeys::Parse(digest + " alice lots\n", 0).ok());
  EXPECT_FALSE(ApiKeys::Parse("# nothing\n", 0).ok());
  auto keys = ApiKeys::Parse(digest + " alice -  # the default rate\n", 500);
  ASSERT_TRUE(keys.ok()) << keys.status();
  const ApiKeys::Key* k = keys->Find("Bearer sk-alice");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->name, "alice");
  EXPECT_EQ(k->tokens_per_minute, 500u);
  EXPECT_EQ(keys->Find("Bearer sk-alic"), nullptr);
  EXPECT_EQ(keys->Find("sk-alice"), nullptr);  // not a bearer token
}

// A rotated Secret: the file changes in place and the frontend reads it
// again within --api-keys-reload-interval; a file that no longer parses
// keeps the keys it had.
TEST(FrontendGate, ARotatedKeyFileTakesEffectAndABrokenOneKeepsTheLastKeys) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.api_keys_file = KeyFile({{"sk-alice", "alice"}});
  o.api_keys_reload_ms = 50;
  auto fe = StartFrontend({&e0}, o);
  auto status = [&](const std::string& key) {
    return Post(fe->port(), kCompletion, "/v1/completions", Bearer(key)).status;
  };
  ASSERT_EQ(status("sk-alice"), 200);
  ASSERT_EQ(status("sk-bob"), 401);
  {
    std::ofstream out(o.api_keys_file + ".new");
    out << ApiKeys::Digest("sk-bob") << " bob\n";
  }
  ASSERT_EQ(std::rename((o.api_keys_file + ".new").c_str(), o.api_keys_file.c_str()), 0);
  ASSERT_TRUE(WaitFor([&] { return status("sk-bob") == 200; }, std::chrono::seconds(10)));
  EXPECT_EQ(status("sk-alice"), 401);
  {
    std::ofstream out(o.api_keys_file);
    out << "sk-carol carol\n";  // a key itself: refused, as at start
  }
  // The broken file is read (and refused) within a few intervals: bob's
  // key goes on working through them.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < until) ASSERT_EQ(status("sk-bob"), 200);
  EXPECT_EQ(status("sk-carol"), 401);
}

TEST(FrontendGate, AKeyFileReloadsOnlyWhatChangedAndCountsWhatItRefused) {
  const std::string path = KeyFile({{"sk-alice", "alice"}});
  auto f = KeyFile::Open(path, 0, 0);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_NE((*f)->keys()->Find("Bearer sk-alice"), nullptr);
  auto same = (*f)->Reload();
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(*same);
  std::ofstream(path) << "not a digest\n";
  auto bad = (*f)->Reload();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 1"), std::string::npos) << bad.status();
  EXPECT_EQ((*f)->failures(), 1u);
  EXPECT_NE((*f)->keys()->Find("Bearer sk-alice"), nullptr);
  std::ofstream(path) << ApiKeys::Digest("sk-bob") << " bob 600\n";
  auto changed = (*f)->Reload();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_EQ((*f)->reloads(), 1u);
  EXPECT_EQ((*f)->keys()->Find("Bearer sk-alice"), nullptr);
  ASSERT_NE((*f)->keys()->Find("Bearer sk-bob"), nullptr);
  EXPECT_EQ((*f)->keys()->Find("Bearer sk-bob")->tokens_per_minute, 600u);
  std::remove(path.c_str());
  EXPECT_FALSE((*f)->Reload().ok());  // gone: the keys stay
  EXPECT_NE((*f)->keys()->Find("Bearer sk-bob"), nullptr);
  EXPECT_FALSE(KeyFile::Open(path, 0, 0).ok());
}

// A key's bucket holds a minute's tokens: a request takes its prompt and
// max_tokens; one the bucket cannot hold now is 429 with Retry-After, one
// larger than a minute's is 429 saying so.
TEST(FrontendGate, AKeyPastItsTokenRateIsAnswered429) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.api_keys_file = KeyFile({{"sk-alice", "alice 100"}, {"sk-bob", "bob"}});
  o.key_tokens_per_minute = 0;  // bob: no limit
  auto fe = StartFrontend({&e0}, o);
  const std::string big = R"({"model": "tiny", "prompt": "hello there", "max_tokens": 90})";
  Answer first = Post(fe->port(), big, "/v1/completions", Bearer("sk-alice"));
  EXPECT_EQ(first.status, 200) << first.body;
  Answer second = Post(fe->port(), big, "/v1/completions", Bearer("sk-alice"));
  EXPECT_EQ(second.status, 429) << second.body;
  EXPECT_NE(second.body.find("rate_limit_exceeded"), std::string::npos) << second.body;
  // ~90 tokens at 100 a minute: most of a minute.
  EXPECT_GE(std::stoi(second.retry_after), 30) << second.retry_after;
  const std::string huge = R"({"model": "tiny", "prompt": "hello", "max_tokens": 1000})";
  Answer too_large = Post(fe->port(), huge, "/v1/completions", Bearer("sk-alice"));
  EXPECT_EQ(too_large.status, 429);
  EXPECT_NE(too_large.body.find("Request too large"), std::string::npos) << too_large.body;
  // Another key's bucket is its own.
  EXPECT_EQ(Post(fe->port(), huge, "/v1/completions", Bearer("sk-bob")).status, 200);
  EXPECT_EQ(e0.completions.load(), 2);
}

TEST(FrontendGate, ABucketRefillsAtItsRate) {
  TokenRates rates;
  EXPECT_FALSE(rates.Take("k", 600, 600, 0).has_value());  // a full minute's
  auto wait = rates.Take("k", 600, 100, 0);
  ASSERT_TRUE(wait.has_value());
  EXPECT_NEAR(*wait, 10.0, 1e-9);  // 100 tokens at 10 a second
  EXPECT_TRUE(rates.Take("k", 600, 100, 9000).has_value());
  EXPECT_FALSE(rates.Take("k", 600, 100, 10000).has_value());
}

// One request served at a time, one more waits: a third is refused at
// once (queue full), the waiting one is refused once its wait times out,
// and a request that waits while the first ends is served.
TEST(FrontendGate, TheQueueIsBoundedAndTimesOut) {
  FakeEngine e0(FakeEngine::Mode::kStream);
  e0.events = 5;
  e0.gap_ms = 800;  // the first request holds its turn ~4 s
  FrontendOptions o;
  o.max_concurrent_requests = 1;
  o.queue_size = 1;
  o.queue_timeout_ms = 2000;
  auto fe = StartFrontend({&e0}, o);
  auto holding = std::async(std::launch::async, [&] { return Post(fe->port(), kStreamed); });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  auto waiting = std::async(std::launch::async, [&] { return Post(fe->port(), kCompletion); });
  ASSERT_TRUE(WaitFor([&] {
    return Get(fe->port(), "/metrics").body.find("kvtier_frontend_queued 1") != std::string::npos;
  }));
  Answer full = Post(fe->port(), kCompletion);
  EXPECT_EQ(full.status, 429) << full.body;
  EXPECT_EQ(full.retry_after, "1");
  EXPECT_NE(full.body.find("queue is full"), std::string::npos) << full.body;
  Answer timed_out = waiting.get();
  EXPECT_EQ(timed_out.status, 429) << timed_out.body;
  EXPECT_NE(timed_out.body.find("waited 2000 ms"), std::string::npos) << timed_out.body;
  EXPECT_EQ(e0.completions.load(), 1);  // neither reached the engine
  EXPECT_EQ(holding.get().status, 200);
}

TEST(FrontendGate, AWaitingRequestGetsTheTurnThatEnds) {
  FakeEngine e0(FakeEngine::Mode::kStream);
  e0.events = 3;
  e0.gap_ms = 200;
  FrontendOptions o;
  o.max_concurrent_requests = 1;
  o.queue_size = 4;
  o.queue_timeout_ms = 60000;
  auto fe = StartFrontend({&e0}, o);
  auto first = std::async(std::launch::async, [&] { return Post(fe->port(), kStreamed); });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  Answer second = Post(fe->port(), kStreamed);  // waits for the first's turn
  EXPECT_EQ(second.status, 200) << second.body;
  EXPECT_NE(second.body.find("[DONE]"), std::string::npos);
  const Answer a = first.get();
  EXPECT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole);  // the first ended whole before the second was sent
  EXPECT_EQ(e0.completions.load(), 2);
}

// A client that leaves while its request waits for a turn leaves the
// queue: its place goes to the next request, and the engine never sees it.
TEST(FrontendGate, AClientThatLeavesTheQueueFreesItsPlace) {
  FakeEngine e0(FakeEngine::Mode::kStream);
  e0.events = 10;
  e0.gap_ms = 600;  // the first request holds its turn ~6 s
  FrontendOptions o;
  o.max_concurrent_requests = 1;
  o.queue_size = 1;
  o.queue_timeout_ms = 60000;
  auto fe = StartFrontend({&e0}, o);
  auto holding = std::async(std::launch::async, [&] { return Post(fe->port(), kStreamed); });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  auto queued_is = [&](int n) {
    return Get(fe->port(), "/metrics").body.find("kvtier_frontend_queued " + std::to_string(n)) !=
           std::string::npos;
  };
  {
    net::io_context io;
    tcp::socket leaving = Dial(io, fe->port());
    Write(leaving, http::verb::post, "/v1/completions", kCompletion);
    ASSERT_TRUE(WaitFor([&] { return queued_is(1); }));
  }  // closed while it waits
  ASSERT_TRUE(WaitFor([&] { return queued_is(0); })) << "the queue kept a client that left";
  // It left the queue before its turn came, not at it.
  EXPECT_EQ(holding.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  // Its place is free: the next request waits there, and is served.
  Answer next = Post(fe->port(), kCompletion);
  EXPECT_EQ(next.status, 200) << next.body;
  EXPECT_EQ(holding.get().status, 200);
  EXPECT_EQ(e0.completions.load(), 2);  // the one that left never reached the engine
}

// Its only engine fails the request; with a back-off the request waits
// and tries it again, and is served once the engine recovers.
TEST(FrontendGate, ARetryAfterABackOffReachesAnEngineThatRecovered) {
  FakeEngine e0(FakeEngine::Mode::kStatus500);
  FrontendOptions o;
  o.max_attempts = 16;
  o.breaker_errors = 1000;  // the engine stays usable: only the back-off is tested
  o.retry_backoff_ms = 200;
  o.retry_backoff_max_ms = 200;
  auto fe = StartFrontend({&e0}, o);
  auto answer = std::async(std::launch::async, [&] { return Post(fe->port(), kCompletion); });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() >= 1; }));
  e0.mode = FakeEngine::Mode::kWhole;
  Answer a = answer.get();
  EXPECT_EQ(a.status, 200) << a.body;
  EXPECT_GE(e0.completions.load(), 2);
  EXPECT_NE(Get(fe->port(), "/metrics").body.find("kvtier_frontend_retries_total"),
            std::string::npos);
}

TEST(FrontendGate, WithoutABackOffEachEngineIsTriedOnce) {
  FakeEngine e0(FakeEngine::Mode::kStatus500);
  FrontendOptions o;
  o.max_attempts = 16;
  auto fe = StartFrontend({&e0}, o);
  Answer a = Post(fe->port(), kCompletion);
  EXPECT_EQ(a.status, 503) << a.body;
  EXPECT_EQ(e0.completions.load(), 1);
}

// Half-open: once its --down passed, one more failure skips it again.
TEST(FrontendGate, ABreakerThatOpenedReopensOnTheNextFailure) {
  FakeEngine e0(FakeEngine::Mode::kStatus500);
  FrontendOptions o;
  o.breaker_errors = 2;
  o.down_ms = 300;
  o.max_attempts = 1;
  auto fe = StartFrontend({&e0}, o);
  EXPECT_EQ(Post(fe->port(), kCompletion).status, 503);  // 1 in a row
  EXPECT_EQ(Post(fe->port(), kCompletion).status, 503);  // 2: open
  EXPECT_EQ(e0.completions.load(), 2);
  // Open: an engine whose health check passes but which failed lately
  // takes nothing.
  EXPECT_EQ(Post(fe->port(), kCompletion).status, 503);
  EXPECT_EQ(e0.completions.load(), 2);
  ASSERT_TRUE(WaitFor([&] {
    Post(fe->port(), kCompletion);
    return e0.completions.load() == 3;
  }));
  // Half-open: that one failure opened it again.
  EXPECT_EQ(Post(fe->port(), kCompletion).status, 503);
  EXPECT_EQ(e0.completions.load(), 3);
}

TEST(FrontendGate, VllmsOtherEndpointsPassThrough) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  auto fe = StartFrontend({&e0});
  Answer a = Post(fe->port(), R"({"input": "hello"})", "/v1/embeddings");
  EXPECT_EQ(a.status, 200) << a.body;
  // The engine got the endpoint and the body, the model named for it.
  const std::string got = e0.last_request();
  EXPECT_EQ(got.rfind("/v1/embeddings ", 0), 0u) << got;
  EXPECT_NE(got.find(R"("model":"tiny")"), std::string::npos) << got;
  EXPECT_NE(got.find(R"("input":"hello")"), std::string::npos) << got;
  for (const char* path : {"/v1/score", "/v1/responses", "/detokenize", "/rerank", "/pooling"}) {
    EXPECT_EQ(Post(fe->port(), R"({"model": "tiny"})", path).status, 200) << path;
    EXPECT_EQ(e0.last_request().rfind(std::string(path) + " ", 0), 0u) << path;
  }
  Answer other = Post(fe->port(), R"({"model": "gpt-4", "input": "x"})", "/v1/embeddings");
  EXPECT_EQ(other.status, 404) << other.body;
  EXPECT_NE(other.body.find("model_not_found"), std::string::npos);
  EXPECT_EQ(Post(fe->port(), "not json", "/v1/embeddings").status, 400);
  // The engine's own answer (here its 404 for an endpoint it lacks) passes.
  EXPECT_EQ(Post(fe->port(), R"({"prompt": "hi"})", "/tokenize").status, 404);
}

// Two models behind one frontend: each request goes to the engines of the
// model it names (their namespace), /v1/models lists both.
TEST(FrontendGate, EachModelIsRoutedToItsOwnEngines) {
  FakeEngine a0(FakeEngine::Mode::kWhole), b0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  FrontendOptions::ExtraModel other;
  other.name = "tiny-two";
  other.dir = std::string(KVTIER_SOURCE_DIR) + "/tests/models/tiny-llama";
  other.adapters = {"tiny-two-sql"};
  other.namespace_id = 2;
  o.extra_models.push_back(other);
  auto fe = StartFrontend({&a0, &b0}, o, true, {1, 2});
  for (int i = 0; i < 4; ++i) {
    Answer two = Post(fe->port(), R"({"model": "tiny-two", "prompt": "hi", "max_tokens": 2})");
    ASSERT_EQ(two.status, 200) << two.body;
    EXPECT_NE(two.route.find("engine=e1"), std::string::npos) << two.route;
    Answer one = Post(fe->port(), kCompletion);
    ASSERT_EQ(one.status, 200) << one.body;
    EXPECT_NE(one.route.find("engine=e0"), std::string::npos) << one.route;
  }
  Answer adapter = Post(fe->port(), R"({"model": "tiny-two-sql", "prompt": "hi"})");
  EXPECT_NE(adapter.route.find("engine=e1"), std::string::npos) << adapter.route;
  EXPECT_EQ(a0.completions.load(), 4);
  EXPECT_EQ(b0.completions.load(), 5);
  const std::string models = Get(fe->port(), "/v1/models").body;
  for (const char* id : {"\"tiny\"", "\"tiny-two\"", "\"tiny-two-sql\""}) {
    EXPECT_NE(models.find(id), std::string::npos) << models;
  }
  // One model's engine down: its requests never go to the other's.
  b0.mode = FakeEngine::Mode::kStatus500;
  Answer down = Post(fe->port(), R"({"model": "tiny-two", "prompt": "hi"})");
  EXPECT_EQ(down.status, 503) << down.body;
  EXPECT_EQ(a0.completions.load(), 4);
}

TEST(FrontendGate, ModelsThatShareANameOrNamespaceAreRefused) {
  FrontendOptions o;
  o.served_model = "tiny";
  o.engines = *router::ParseVllmSources(
      "id=e0,endpoint=127.0.0.1:1,events=tcp://127.0.0.1:2,namespace=0000000000000001,"
      "block-tokens=16");
  ASSERT_TRUE(ParseExtraModels("name=tiny,model=/m,namespace=0000000000000002", &o).ok());
  EXPECT_NE(o.Validate().message().find("means two models"), std::string::npos) << o.Validate();
  o.extra_models.clear();
  ASSERT_TRUE(ParseExtraModels("name=two,model=/m,namespace=0000000000000001", &o).ok());
  EXPECT_NE(o.Validate().message().find("no engine serves tiny"), std::string::npos)
      << o.Validate();
  o.extra_models.clear();
  ASSERT_TRUE(ParseExtraModels("name=two,model=/m,namespace=0000000000000003", &o).ok());
  EXPECT_NE(o.Validate().message().find("no engine has two's namespace"), std::string::npos)
      << o.Validate();
  EXPECT_FALSE(ParseExtraModels("name=two,model=/m", &o).ok());
  EXPECT_FALSE(ParseExtraModels("name=two,dir=/m,namespace=0000000000000003", &o).ok());
}

}  // namespace
}  // namespace kvtier::frontend::testing
