// kvtier-frontend's tests against fake engines (tests/fake_engine.h): a
// Frontend in process over them, and an HTTP client with a receive timeout
// (a test never waits forever). Real sockets on 127.0.0.1, the tiny
// model's tokenizer.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fake_engine.h"
#include "frontend/server.h"
#include "test_util.h"

namespace kvtier::frontend::testing {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using kvtier::testing::FakeEngine;
using kvtier::testing::WaitFor;

// `namespaces`: each engine's (default: 1 for every engine).
inline std::unique_ptr<Frontend> StartFrontend(const std::vector<const FakeEngine*>& engines,
                                               FrontendOptions o = {}, bool route_header = true,
                                               const std::vector<uint64_t>& namespaces = {}) {
  o.listen = "127.0.0.1:0";
  o.router_listen = "127.0.0.1:0";
  o.served_model = "tiny";
  o.health_interval_ms = 200;
  o.route_header = route_header;
  for (size_t i = 0; i < engines.size(); ++i) {
    router::VllmSourceSpec spec;
    spec.id = "e" + std::to_string(i);
    spec.endpoint = engines[i]->endpoint();
    spec.namespace_id = i < namespaces.size() ? namespaces[i] : 1;
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
inline tcp::socket Dial(net::io_context& io, int port, int rcvbuf = 0) {
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

inline Answer Read(tcp::socket& s) {
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

// `headers`: more header fields (name, value) to send.
using Headers = std::vector<std::pair<std::string, std::string>>;

// Writes a request (a JSON body, when one is given) and reads nothing.
inline void Write(tcp::socket& s, http::verb verb, const std::string& target,
                  const std::string& body, bool keep_alive = true, const Headers& headers = {}) {
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "127.0.0.1");
  for (const auto& [name, value] : headers) req.set(name, value);
  if (!body.empty()) req.set(http::field::content_type, "application/json");
  req.body() = body;
  req.keep_alive(keep_alive);
  req.prepare_payload();
  http::write(s, req);
}

inline Answer Send(tcp::socket& s, http::verb verb, const std::string& target,
                   const std::string& body, bool keep_alive = true, const Headers& headers = {}) {
  Write(s, verb, target, body, keep_alive, headers);
  return Read(s);
}

inline Answer Post(int port, const std::string& body, const std::string& target = "/v1/completions",
                   const Headers& headers = {}) {
  net::io_context io;
  tcp::socket s = Dial(io, port);
  return Send(s, http::verb::post, target, body, false, headers);
}

inline Answer Get(int port, const std::string& target) {
  net::io_context io;
  tcp::socket s = Dial(io, port);
  return Send(s, http::verb::get, target, "", false);
}

inline const std::string kCompletion =
    R"({"model": "tiny", "prompt": "hello there", "max_tokens": 4})";
inline const std::string kStreamed =
    R"({"model": "tiny", "prompt": "hello there", "max_tokens": 4, "stream": true})";

}  // namespace kvtier::frontend::testing
