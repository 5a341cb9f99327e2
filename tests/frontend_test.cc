// kvtier-frontend against fake engines (tests/fake_engine.h): what it does
// when an engine answers 5xx, dies before a stream's first event, or a
// client sends too much or holds too many connections, and how it drains.
// Real Frontend, real sockets on 127.0.0.1, the tiny model's tokenizer;
// the engines' side is scripted. test_frontend.py runs real vLLM engines.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "fake_engine.h"
#include "frontend/server.h"
#include "test_util.h"

namespace kvtier::frontend {
namespace {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using testing::FakeEngine;
using testing::WaitFor;

std::unique_ptr<Frontend> StartFrontend(const std::vector<const FakeEngine*>& engines,
                                        FrontendOptions o = {}, bool route_header = true) {
  o.listen = "127.0.0.1:0";
  o.router_listen = "127.0.0.1:0";
  o.served_model = "tiny";
  o.health_interval_ms = 200;
  o.route_header = route_header;
  for (size_t i = 0; i < engines.size(); ++i) {
    router::VllmSourceSpec spec;
    spec.id = "e" + std::to_string(i);
    spec.endpoint = engines[i]->endpoint();
    spec.namespace_id = 1;
    spec.block_tokens = 16;
    o.engines.push_back(spec);
  }
  auto text = TextModel::Open(std::string(KVTIER_SOURCE_DIR) + "/tests/models/tiny-llama");
  EXPECT_TRUE(text.ok()) << text.status();
  auto fe = Frontend::Start(o, std::move(*text));
  EXPECT_TRUE(fe.ok()) << fe.status();
  return std::move(*fe);
}

// A client connection with a receive timeout: a test never waits forever.
tcp::socket Dial(net::io_context& io, int port, int rcvbuf = 0) {
  tcp::socket s(io);
  s.open(tcp::v4());
  if (rcvbuf > 0) s.set_option(net::socket_base::receive_buffer_size(rcvbuf));
  timeval tv{10, 0};
  setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  s.connect({net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)});
  return s;
}

struct Answer {
  int status = 0;
  std::string body;
  std::string route;        // x-kvtier-route
  std::string retry_after;  // Retry-After
  bool whole = false;       // read to its end
  std::string error;
};

Answer Read(tcp::socket& s) {
  boost::beast::flat_buffer buf;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  boost::system::error_code ec;
  http::read(s, buf, parser, ec);
  Answer a;
  a.status = parser.is_header_done() ? parser.get().result_int() : 0;
  a.body = parser.get().body();
  a.route = std::string(parser.get()["x-kvtier-route"]);
  a.retry_after = std::string(parser.get()[http::field::retry_after]);
  a.whole = !ec && parser.is_done();
  a.error = ec.message();
  return a;
}

Answer Send(tcp::socket& s, http::verb verb, const std::string& target, const std::string& body,
            bool keep_alive = true) {
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "127.0.0.1");
  if (!body.empty()) req.set(http::field::content_type, "application/json");
  req.body() = body;
  req.keep_alive(keep_alive);
  req.prepare_payload();
  http::write(s, req);
  return Read(s);
}

Answer Post(int port, const std::string& body, const std::string& target = "/v1/completions") {
  net::io_context io;
  tcp::socket s = Dial(io, port);
  return Send(s, http::verb::post, target, body, false);
}

Answer Get(int port, const std::string& target) {
  net::io_context io;
  tcp::socket s = Dial(io, port);
  return Send(s, http::verb::get, target, "", false);
}

const std::string kCompletion = R"({"model": "tiny", "prompt": "hello there", "max_tokens": 4})";
const std::string kStreamed =
    R"({"model": "tiny", "prompt": "hello there", "max_tokens": 4, "stream": true})";

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
// kBreakerErrors in a row, as a circuit breaker opens.
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

// vLLM sends a stream's header before its prefill: an engine that dies
// before the first event has sent the client nothing, and another answers.
TEST(FrontendRelay, AStreamWhoseEngineDiesBeforeItsFirstEventGoesToAnother) {
  FakeEngine e0(FakeEngine::Mode::kDiesBeforeAnEvent), e1(FakeEngine::Mode::kStream);
  auto fe = StartFrontend({&e0, &e1});
  Answer a = Post(fe->port(), kStreamed);
  ASSERT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole) << a.error;
  // The header came from the first engine tried; the events from e1.
  EXPECT_NE(a.route.find("engine=e0"), std::string::npos) << a.route;
  for (const char* t : {"t0", "t1", "t2", "[DONE]"}) {
    EXPECT_NE(a.body.find(t), std::string::npos) << t << " not in " << a.body;
  }
  EXPECT_EQ(e0.completions.load(), 1);
  EXPECT_EQ(e1.completions.load(), 1);
}

// When no engine can continue a stream that began, it ends with an error
// event, as vLLM ends a stream that failed, never silently short.
TEST(FrontendRelay, AStreamNoEngineCouldContinueEndsWithAnErrorEvent) {
  FakeEngine e0(FakeEngine::Mode::kDiesBeforeAnEvent), e1(FakeEngine::Mode::kDiesBeforeAnEvent);
  auto fe = StartFrontend({&e0, &e1});
  Answer a = Post(fe->port(), kStreamed);
  ASSERT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole) << a.error;
  EXPECT_NE(a.body.find("\"error\""), std::string::npos) << a.body;
  EXPECT_NE(a.body.find("no engine could serve"), std::string::npos) << a.body;
  EXPECT_NE(a.body.find("[DONE]"), std::string::npos) << a.body;
  EXPECT_EQ(e0.completions.load() + e1.completions.load(), 2);
}

TEST(FrontendRelay, AHeaderOverTheLimitIsAnswered431) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  auto fe = StartFrontend({&e0});
  net::io_context io;
  tcp::socket s = Dial(io, fe->port());
  // Raw bytes: Beast's own request refuses a field this long.
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + std::string(80 << 10, 'x') +
      "\r\nContent-Length: " + std::to_string(kCompletion.size()) + "\r\n\r\n" + kCompletion;
  boost::system::error_code ec;
  net::write(s, net::buffer(req), ec);
  Answer a = Read(s);
  EXPECT_EQ(a.status, 431) << a.error;
  EXPECT_NE(a.body.find("header"), std::string::npos) << a.body;
  EXPECT_EQ(e0.completions.load(), 0);
}

TEST(FrontendRelay, AConnectionPastTheCapIsAnswered503WithRetryAfter) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.max_connections = 2;
  auto fe = StartFrontend({&e0}, o);
  net::io_context io;
  // Two connections held (each answered once, so each was taken).
  tcp::socket a = Dial(io, fe->port()), b = Dial(io, fe->port());
  ASSERT_EQ(Send(a, http::verb::get, "/v1/models", "").status, 200);
  ASSERT_EQ(Send(b, http::verb::get, "/v1/models", "").status, 200);
  Answer third = Get(fe->port(), "/v1/models");
  EXPECT_EQ(third.status, 503) << third.body;
  EXPECT_EQ(third.retry_after, "1");
  EXPECT_NE(third.body.find("most connections"), std::string::npos) << third.body;
  // One closes: a new connection is served again.
  a.close();
  EXPECT_TRUE(WaitFor([&] { return Get(fe->port(), "/v1/models").status == 200; }))
      << "a connection was still refused after one of the two closed";
}

// A client that never reads what it asked for is cut at the client
// timeout, not held forever: the frontend stops writing and closes.
TEST(FrontendRelay, AClientThatNeverReadsIsCutAtTheWriteDeadline) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.client_timeout_ms = 500;
  auto fe = StartFrontend({&e0}, o);
  net::io_context io;
  tcp::socket s = Dial(io, fe->port(), /*rcvbuf=*/4096);
  // Requests pipelined, their answers (a few KiB each) left unread: far
  // more than the socket buffers hold.
  constexpr int kAsked = 4000;
  std::string many;
  for (int i = 0; i < kAsked; ++i) many += "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  std::thread writer([&] {
    boost::system::error_code ignored;
    net::write(s, net::buffer(many), ignored);
  });
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the subject: a client that waits
  // Reading now finds the answers written before the deadline, then the
  // connection's end, long before all were answered.
  int answered = 0;
  boost::beast::flat_buffer buf;
  boost::system::error_code ec;
  while (!ec) {
    http::response<http::string_body> res;
    http::read(s, buf, res, ec);
    if (!ec) answered++;
  }
  s.shutdown(tcp::socket::shutdown_both, ec);
  writer.join();
  EXPECT_LT(answered, kAsked);
  EXPECT_NE(ec, boost::asio::error::would_block) << "the connection was held open";
  EXPECT_NE(ec, boost::asio::error::try_again) << "the connection was held open";
}

// SIGTERM's drain: no new connection, /health failing on connections
// already open, and the stream in flight ends whole.
TEST(FrontendRelay, ADrainEndsTheStreamsInFlightWholeAndTakesNoNewConnection) {
  FakeEngine e0(FakeEngine::Mode::kStream);
  e0.events = 10;
  e0.gap_ms = 100;
  auto fe = StartFrontend({&e0});
  net::io_context io;
  tcp::socket held = Dial(io, fe->port());  // a keep-alive connection, open before the drain
  ASSERT_EQ(Send(held, http::verb::get, "/health", "").status, 200);
  auto stream = std::async(std::launch::async, [&] { return Post(fe->port(), kStreamed); });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  auto drained = std::async(std::launch::async, [&] { return fe->Drain(10000); });
  // The drain closes the listener: a new connection is refused.
  EXPECT_TRUE(WaitFor([&] {
    tcp::socket s(io);
    boost::system::error_code ec;
    s.connect({net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(fe->port())}, ec);
    return ec == net::error::connection_refused;
  })) << "new connections were still taken while draining";
  Answer health = Send(held, http::verb::get, "/health", "");
  EXPECT_EQ(health.status, 503);
  EXPECT_NE(health.body.find("draining"), std::string::npos) << health.body;
  Answer a = stream.get();
  EXPECT_EQ(a.status, 200);
  EXPECT_TRUE(a.whole) << a.error;
  EXPECT_NE(a.body.find("t9"), std::string::npos) << a.body;
  EXPECT_NE(a.body.find("[DONE]"), std::string::npos) << a.body;
  EXPECT_TRUE(drained.get());
}

// A large prompt is tokenized off the I/O threads: a stream served by the
// same (only) thread goes on while it is.
TEST(FrontendRelay, ALargePromptBeingTokenizedHoldsNoStream) {
  FakeEngine e0(FakeEngine::Mode::kStream);
  e0.events = 200;
  e0.gap_ms = 10;
  FrontendOptions o;
  o.threads = 1;
  auto fe = StartFrontend({&e0}, o);
  net::io_context io;
  tcp::socket s = Dial(io, fe->port());
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, "x");
  req.set(http::field::content_type, "application/json");
  req.body() = kStreamed;
  req.prepare_payload();
  http::write(s, req);
  // Each read's arrival: the stream's events, timed.
  std::vector<std::chrono::steady_clock::time_point> reads;
  std::atomic<bool> ended{false};
  std::thread reader([&] {
    char buf[4096];
    boost::system::error_code ec;
    std::string all;
    while (!ec && all.find("[DONE]") == std::string::npos) {
      const size_t n = s.read_some(net::buffer(buf), ec);
      all.append(buf, n);
      reads.push_back(std::chrono::steady_clock::now());
    }
    ended = true;
  });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // events flowing
  // 6 MiB of text: refused (over --max-prompt-tokens) once tokenized.
  std::string words;
  while (words.size() < (6u << 20)) words += "the store tiers blocks across memory ";
  const auto asked = std::chrono::steady_clock::now();
  Answer big =
      Post(fe->port(), R"({"model": "tiny", "prompt": ")" + words + R"(", "max_tokens": 1})");
  const auto answered = std::chrono::steady_clock::now();
  EXPECT_EQ(big.status, 400) << big.body.substr(0, 200);
  reader.join();
  ASSERT_TRUE(ended.load());
  // The longest silence of the stream while the big prompt was prepared.
  std::chrono::steady_clock::duration longest{};
  for (size_t i = 1; i < reads.size(); ++i) {
    if (reads[i] < asked || reads[i - 1] > answered) continue;
    longest = std::max(longest, reads[i] - reads[i - 1]);
  }
  const auto took = answered - asked;
  auto ms = [](auto d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
  EXPECT_GT(ms(took), 100) << "the prompt was prepared too fast to tell";
  EXPECT_LT(ms(longest) * 3, ms(took)) << "the stream stood still " << ms(longest) << " ms of the "
                                       << ms(took) << " ms the large prompt took";
}

// What names engines and their load is for operators: the route header
// only when asked for, /metrics on the operator port when one is given.
TEST(FrontendRelay, RoutesAndMetricsAreShownOnlyToOperators) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.metrics_listen = "127.0.0.1:0";
  auto fe = StartFrontend({&e0}, o, /*route_header=*/false);
  Answer a = Post(fe->port(), kCompletion);
  EXPECT_EQ(a.status, 200);
  EXPECT_EQ(a.route, "") << "the route header was sent unasked";
  EXPECT_EQ(Get(fe->port(), "/metrics").status, 404);
  ASSERT_NE(fe->metrics_port(), 0);
  Answer m = Get(fe->metrics_port(), "/metrics");
  EXPECT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("kvtier_frontend_requests_total{code=\"200\",endpoint=\"completions\"} 1"),
            std::string::npos)
      << m.body.substr(0, 2000);
  EXPECT_NE(m.body.find("process_open_fds"), std::string::npos);
}

// Bodies held at once are capped: a client trickling a large body holds
// its bytes from its header on, and a body that would pass the cap is
// refused unread (503, Retry-After) until the first is gone.
TEST(FrontendRelay, BodiesPastTheInFlightCapAreAnswered503) {
  FakeEngine e0(FakeEngine::Mode::kWhole);
  FrontendOptions o;
  o.max_body_bytes = 1 << 20;
  o.max_body_bytes_in_flight = 1 << 20;
  auto fe = StartFrontend({&e0}, o);
  net::io_context io;
  // 800 KiB announced, 10 bytes sent: the rest never comes.
  tcp::socket slow = Dial(io, fe->port());
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(800 << 10) + "\r\n\r\n{\"prompt\":";
  net::write(slow, net::buffer(head));
  // Its header read: its bytes are held.
  ASSERT_TRUE(WaitFor([&] {
    return Get(fe->port(), "/metrics")
               .body.find("kvtier_frontend_body_bytes_in_flight " + std::to_string(800 << 10)) !=
           std::string::npos;
  })) << Get(fe->port(), "/metrics").body.substr(0, 3000);
  // A whole 500 KiB body (not JSON: 400 when read) from another client.
  auto other = [&] { return Post(fe->port(), std::string(500 << 10, 'x')); };
  Answer refused;
  ASSERT_TRUE(WaitFor(
      [&] {
        refused = other();
        return refused.status == 503;
      },
      std::chrono::seconds(30)))
      << "a body past the cap was read: " << refused.status << " " << refused.error << " "
      << refused.body.substr(0, 200);
  EXPECT_EQ(refused.retry_after, "1");
  EXPECT_NE(refused.body.find("bodies in flight"), std::string::npos) << refused.body;
  slow.close();
  EXPECT_TRUE(WaitFor([&] { return other().status == 400; }, std::chrono::seconds(30)))
      << "bodies were still refused after the slow one left";
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

}  // namespace
}  // namespace kvtier::frontend
