// kvtier-frontend's failover against fake engines (tests/frontend_harness.h):
// what it does when an engine answers 5xx, keeps failing, dies before a
// stream's first event, or tokenizes otherwise. test_frontend.py runs real
// vLLM engines.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "frontend_harness.h"

namespace kvtier::frontend::testing {
namespace {

TEST(FrontendRelay, AWholeAnswerAndAStreamPassThrough) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  auto fe = StartFrontend({&e0});
  Answer a = Post(fe->port(), kCompletion);
  EXPECT_EQ(a.status, 200) << a.body;
  EXPECT_TRUE(a.whole) << a.error;
  EXPECT_NE(a.body.find("\"text\":\"ok\""), std::string::npos) << a.body;
  e0.mode = FakeEngine::Mode::kStream;
  a = Post(fe->port(), kStreamed);
  EXPECT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole) << a.error;
  for (const char* t : {"t0", "t1", "t2", "[DONE]"}) {
    EXPECT_NE(a.body.find(t), std::string::npos) << t << " not in " << a.body;
  }
}

// A 5xx is that request's failure: it goes to another engine, and the
// engine that answered it keeps taking requests.
TEST(FrontendRelay, AnEngineAnswering5xxLosesTheRequestNotItsPlace) {
  FakeEngine e0(FakeEngine::Mode::kStatus500), e1(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.down_ms = 60000;  // were it taken out, it would stay out for the test
  auto fe = StartFrontend({&e0, &e1}, o);
  Answer a = Post(fe->port(), kCompletion);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_NE(a.route.find("engine=e1"), std::string::npos) << a.route;
  EXPECT_NE(a.route.find("attempt=2"), std::string::npos) << a.route;
  EXPECT_EQ(e0.completions.load(), 1);
  // The next request goes to e0 first again (fewest in flight, first):
  // it was not skipped for --down.
  e0.mode = FakeEngine::Mode::kWhole;
  a = Post(fe->port(), kCompletion);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_NE(a.route.find("engine=e0"), std::string::npos) << a.route;
  EXPECT_EQ(e0.completions.load(), 2);
}

// An engine whose every answer fails is skipped once it failed
// --breaker-errors (3) times in a row, as a circuit breaker opens.
TEST(FrontendRelay, AnEngineWhoseAnswersKeepFailingIsSkipped) {
  FakeEngine e0(FakeEngine::Mode::kStatus500), e1(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.down_ms = 60000;
  auto fe = StartFrontend({&e0, &e1}, o);
  for (int i = 0; i < 5; ++i) {
    Answer a = Post(fe->port(), kCompletion);
    ASSERT_EQ(a.status, 200) << a.body;
  }
  EXPECT_EQ(e0.completions.load(), 3);  // tried three times, then skipped
  EXPECT_EQ(e1.completions.load(), 5);
}

// A stream's first engine fails before its first token, in either way an
// engine does: it dies before its first event (vLLM sends a stream's
// header before its prefill), or, draining (SIGTERM, --shutdown-timeout),
// it aborts a request that reached it after the signal: no token, a
// usage-only event, [DONE] (the cluster's engine-kill test saw clients get
// that as a whole answer of nothing).
class FrontendFailsBeforeAToken : public ::testing::TestWithParam<FakeEngine::Mode> {};

INSTANTIATE_TEST_SUITE_P(Ways, FrontendFailsBeforeAToken,
                         ::testing::Values(FakeEngine::Mode::kDiesBeforeAnEvent,
                                           FakeEngine::Mode::kAbortsStream),
                         [](const auto& info) {
                           return info.param == FakeEngine::Mode::kAbortsStream ? "Aborts" : "Dies";
                         });

// Nothing of it reached the client: another engine answers, and the client
// has its tokens and none of the failed stream's events.
TEST_P(FrontendFailsBeforeAToken, AStreamGoesToAnotherEngine) {
  FakeEngine e0(GetParam()), e1(FakeEngine::Mode::kStream);
  auto fe = StartFrontend({&e0, &e1});
  Answer a = Post(fe->port(), kStreamed);
  ASSERT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole) << a.error;
  // The header came from the first engine tried; the events from e1.
  EXPECT_NE(a.route.find("engine=e0"), std::string::npos) << a.route;
  for (const char* t : {"t0", "t1", "t2", "[DONE]"}) {
    EXPECT_NE(a.body.find(t), std::string::npos) << t << " not in " << a.body;
  }
  EXPECT_EQ(a.body.find("completion_tokens\":0"), std::string::npos) << a.body;
  EXPECT_EQ(a.body.find("[DONE]"), a.body.rfind("[DONE]")) << a.body;
  EXPECT_EQ(e0.completions.load(), 1);
  EXPECT_EQ(e1.completions.load(), 1);
}

// When no engine can continue a stream that began, it ends with an error
// event, as vLLM ends a stream that failed, never silently short nor as a
// whole answer of nothing.
TEST_P(FrontendFailsBeforeAToken, AStreamNoEngineCouldContinueEndsWithAnErrorEvent) {
  FakeEngine e0(GetParam()), e1(GetParam());
  auto fe = StartFrontend({&e0, &e1});
  Answer a = Post(fe->port(), kStreamed);
  ASSERT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole) << a.error;
  EXPECT_NE(a.body.find("\"error\""), std::string::npos) << a.body;
  EXPECT_NE(a.body.find("no engine could serve"), std::string::npos) << a.body;
  EXPECT_NE(a.body.find("[DONE]"), std::string::npos) << a.body;
  EXPECT_EQ(e0.completions.load() + e1.completions.load(), 2);
}

// Unstreamed, vLLM's abort is a 200 whose choice finished "abort" with no
// text: another engine answers it.
TEST(FrontendRelay, AWholeAnswerAbortedBeforeItsFirstTokenGoesToAnother) {
  FakeEngine e0(FakeEngine::Mode::kAbortsWhole), e1(FakeEngine::Mode::kWhole);
  auto fe = StartFrontend({&e0, &e1});
  Answer a = Post(fe->port(), kCompletion);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_NE(a.route.find("engine=e1"), std::string::npos) << a.route;
  EXPECT_NE(a.body.find("\"ok\""), std::string::npos) << a.body;
  EXPECT_EQ(e0.completions.load(), 1);
  EXPECT_EQ(e1.completions.load(), 1);
}

// The frontend forwards token ids: an engine whose tokenizer gives other
// ids for the same text is refused (it would read them as another
// prompt); one whose ids agree serves.
TEST(FrontendRelay, AnEngineWhoseTokenIdsDifferIsRefused) {
  auto model = TextModel::Open(std::string(KVTIER_SOURCE_DIR) + "/tests/models/tiny-llama");
  ASSERT_TRUE(model.ok());
  const TextModel* text = model->get();
  // vLLM's /tokenize over the same files, and one off by an id at the end.
  auto same = [text](const std::string& body) {
    const auto j = nlohmann::json::parse(body);
    auto ids = j.contains("messages") ? text->EncodeChat(body)
                                      : text->Encode(j["prompt"].get<std::string>(), true);
    return nlohmann::json{{"tokens", *ids}, {"count", ids->size()}}.dump();
  };
  FakeEngine e0(FakeEngine::Mode::kWhole), e1(FakeEngine::Mode::kWhole);
  e0.tokenize = [same](const std::string& body) {
    auto j = nlohmann::json::parse(same(body));
    j["tokens"].back() = j["tokens"].back().get<uint64_t>() + 1;
    return j.dump();
  };
  e1.tokenize = same;
  auto fe = StartFrontend({&e0, &e1});
  // e0 would be first (fewest in flight, first); once checked, never.
  ASSERT_TRUE(WaitFor([&] {
    Answer h = Get(fe->port(), "/metrics");
    return h.body.find("kvtier_frontend_engine_up{engine=\"e0\"} 0") != std::string::npos;
  })) << "e0 was not refused";
  const int before = e0.completions.load();
  for (int i = 0; i < 4; ++i) {
    Answer a = Post(fe->port(), kCompletion);
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.route.find("engine=e1"), std::string::npos) << a.route;
  }
  EXPECT_EQ(e0.completions.load(), before);
  EXPECT_NE(Get(fe->port(), "/metrics").body.find("kvtier_frontend_engine_up{engine=\"e1\"} 1"),
            std::string::npos);
}

// A client that leaves before its engine answered is counted as gone (and
// its engine connection closed, which vLLM takes as an abort).
TEST(FrontendRelay, AClientThatLeavesBeforeTheAnswerIsCountedGone) {
  FakeEngine e0(FakeEngine::Mode::kSilent);
  auto fe = StartFrontend({&e0});
  {
    net::io_context io;
    tcp::socket s = Dial(io, fe->port());
    http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
    req.set(http::field::host, "x");
    req.body() = kCompletion;
    req.prepare_payload();
    http::write(s, req);
    ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  }  // the client leaves
  EXPECT_TRUE(WaitFor([&] {
    const std::string m = Get(fe->port(), "/metrics").body;
    return m.find("kvtier_frontend_client_disconnects_total 1") != std::string::npos &&
           m.find("code=\"499\"") != std::string::npos;
  })) << Get(fe->port(), "/metrics").body.substr(0, 1500);
}

Answer PostInSession(int port, const std::string& session) {
  return Post(port, kCompletion, "/v1/completions", {{"x-session-id", session}});
}

// With --session-affinity-ttl a session's requests go to the engine that
// answered it last, where routing alone (here: fewest requests in flight,
// e0 on a tie) would send them elsewhere; requests without one are routed.
TEST(FrontendRelay, ASessionStaysOnItsEngine) {
  FakeEngine e0(FakeEngine::Mode::kStream), e1(FakeEngine::Mode::kWhole);
  e0.events = 10;
  e0.gap_ms = 100;
  FrontendOptions o;
  o.session_ttl_ms = 60000;
  auto fe = StartFrontend({&e0, &e1}, o);
  // e0 busy with a stream: the session's first request goes to e1.
  auto stream = std::async(std::launch::async, [&] { return Post(fe->port(), kStreamed); });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  Answer first = PostInSession(fe->port(), "s1");
  ASSERT_EQ(first.status, 200) << first.body;
  EXPECT_NE(first.route.find("engine=e1"), std::string::npos) << first.route;
  EXPECT_TRUE(stream.get().whole);
  e0.mode = FakeEngine::Mode::kWhole;
  // Both idle: routing alone picks e0; the session stays on e1.
  for (int i = 0; i < 4; ++i) {
    Answer a = PostInSession(fe->port(), "s1");
    ASSERT_EQ(a.status, 200) << a.body;
    EXPECT_NE(a.route.find("engine=e1"), std::string::npos) << a.route;
    EXPECT_NE(a.route.find("session=kept"), std::string::npos) << a.route;
  }
  Answer other = Post(fe->port(), kCompletion);
  EXPECT_NE(other.route.find("engine=e0"), std::string::npos) << other.route;
  Answer fresh = PostInSession(fe->port(), "s2");
  EXPECT_NE(fresh.route.find("engine=e0"), std::string::npos) << fresh.route;
  EXPECT_EQ(fresh.route.find("session=kept"), std::string::npos) << fresh.route;
}

}  // namespace
}  // namespace kvtier::frontend::testing
