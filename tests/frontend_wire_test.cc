// The frontend's rendered messages (frontend/wire.h) against Beast's own
// serializer: a request to an engine, a whole answer's head and a stream's
// chunks are the bytes Beast writes for the same message, so rendering them
// in one buffer changes nothing a client or an engine can see.
#include "frontend/wire.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier::frontend {
namespace {

// The bytes of buffers, in order.
template <class Buffers>
std::string Bytes(const Buffers& buffers) {
  std::string out;
  for (const auto& b : beast::buffers_range_ref(buffers)) {
    out.append(static_cast<const char*>(b.data()), b.size());
  }
  return out;
}

// What Beast writes for a whole message.
template <bool isRequest, class Body>
std::string BeastBytes(http::message<isRequest, Body>& m) {
  http::serializer<isRequest, Body> sr{m};
  std::string out;
  beast::error_code ec;
  while (!sr.is_done()) {
    sr.next(ec, [&](beast::error_code&, const auto& buffers) {
      out += Bytes(buffers);
      sr.consume(beast::buffer_bytes(buffers));
    });
    EXPECT_FALSE(ec) << ec.message();
  }
  return out;
}

TEST(FrontendWire, ARequestToAnEngineIsWhatBeastWrites) {
  Engine e;
  e.spec.endpoint = "10.0.0.7:8000";
  const std::string body = R"({"model":"tiny","prompt":[1,2,3],"max_tokens":4})";
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, e.spec.endpoint);
  req.set(http::field::content_type, "application/json");
  req.set(http::field::user_agent, "kvtier-frontend");
  req.keep_alive(true);
  req.body() = body;
  req.prepare_payload();
  const WireRequest wire(e, "/v1/completions", body);
  EXPECT_EQ(Bytes(wire.Buffers()), BeastBytes(req));
}

TEST(FrontendWire, AWholeAnswersHeadIsWhatBeastWrites) {
  http::response<http::string_body> upstream{http::status::ok, 11};
  upstream.set(http::field::content_type, "application/json");
  upstream.set(http::field::cache_control, "no-store");
  upstream.set(http::field::server, "uvicorn");  // not passed on
  for (unsigned status : {200u, 400u, 404u, 429u, 503u}) {
    for (bool keep_alive : {true, false}) {
      for (std::string explain : {std::string(), std::string("engine=e0; reason=lowest_cost")}) {
        const std::string body = R"({"id":"cmpl-0","choices":[]})";
        http::response<http::string_body> res{static_cast<http::status>(status), 11};
        res.set(http::field::server, "kvtier-frontend");
        res.set(http::field::content_type, "application/json");
        res.set(http::field::cache_control, "no-store");
        if (!explain.empty()) res.set("x-kvtier-route", explain);
        res.keep_alive(keep_alive);
        res.body() = body;
        res.prepare_payload();
        auto head = WholeAnswerHead(status, upstream, explain, keep_alive, body.size());
        ASSERT_TRUE(head.has_value()) << status;
        EXPECT_EQ(*head + body, BeastBytes(res)) << status << " " << keep_alive;
      }
    }
  }
  // No Content-Type from the engine: none passed on.
  http::response<http::string_body> bare{http::status::ok, 11};
  auto head = WholeAnswerHead(200, bare, "", true, 2);
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(*head, "HTTP/1.1 200 OK\r\nServer: kvtier-frontend\r\nContent-Length: 2\r\n\r\n");
  // Answers with no Content-Length are left to Beast.
  for (unsigned status : {101u, 204u, 304u}) {
    EXPECT_FALSE(WholeAnswerHead(status, upstream, "", true, 0).has_value()) << status;
  }
}

TEST(FrontendWire, AStreamsChunksAreWhatBeastWrites) {
  const std::string events(300, 'x');  // a size with two hex digits and a letter
  const std::string beast_chunk = Bytes(http::make_chunk(net::buffer(events)));
  const std::string beast_last = Bytes(http::make_chunk_last());
  EXPECT_EQ(Bytes(ChunkWire(events, false).Buffers()), beast_chunk);
  EXPECT_EQ(Bytes(ChunkWire(events, true).Buffers()), beast_chunk + beast_last);
  EXPECT_EQ(std::string(kLastChunk), beast_last);
}

}  // namespace
}  // namespace kvtier::frontend
