// kvtier-frontend's limits against fake engines (tests/frontend_harness.h):
// a header too long, connections and bodies past their caps, a client that
// never reads, a large prompt beside a stream, what only operators see, and
// the drain on SIGTERM.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "frontend_harness.h"

namespace kvtier::frontend::testing {
namespace {

TEST(FrontendLimits, AHeaderOverTheLimitIsAnswered431) {
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

TEST(FrontendLimits, AConnectionPastTheCapIsAnswered503WithRetryAfter) {
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
TEST(FrontendLimits, AClientThatNeverReadsIsCutAtTheWriteDeadline) {
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
  // The frontend gives up on the client that does not read: its
  // connection ends, leaving only the one this metrics request holds.
  EXPECT_TRUE(WaitFor(
      [&] {
        return Get(fe->port(), "/metrics").body.find("kvtier_frontend_connections 1\n") !=
               std::string::npos;
      },
      std::chrono::seconds(30)))
      << "the connection was held open";
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
TEST(FrontendLimits, ADrainEndsTheStreamsInFlightWholeAndTakesNoNewConnection) {
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
TEST(FrontendLimits, ALargePromptBeingTokenizedHoldsNoStream) {
  FakeEngine e0(FakeEngine::Mode::kStream);
  e0.events = 200;
  e0.gap_ms = 10;
  FrontendOptions o;
  o.threads = 1;
  auto fe = StartFrontend({&e0}, o);
  net::io_context io;
  tcp::socket s = Dial(io, fe->port());
  Write(s, http::verb::post, "/v1/completions", kStreamed);
  // Each read's arrival: the stream's events, timed.
  std::vector<std::chrono::steady_clock::time_point> reads;
  std::atomic<size_t> read_count{0};
  std::atomic<bool> ended{false};
  std::thread reader([&] {
    char buf[4096];
    boost::system::error_code ec;
    std::string all;
    while (!ec && all.find("[DONE]") == std::string::npos) {
      const size_t n = s.read_some(net::buffer(buf), ec);
      all.append(buf, n);
      reads.push_back(std::chrono::steady_clock::now());
      read_count = reads.size();
    }
    ended = true;
  });
  ASSERT_TRUE(WaitFor([&] { return e0.completions.load() == 1; }));
  // Events flowing before the large prompt comes.
  ASSERT_TRUE(WaitFor([&] { return read_count.load() >= 3; }));
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
TEST(FrontendLimits, RoutesAndMetricsAreShownOnlyToOperators) {
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
TEST(FrontendLimits, BodiesPastTheInFlightCapAreAnswered503) {
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

}  // namespace
}  // namespace kvtier::frontend::testing
