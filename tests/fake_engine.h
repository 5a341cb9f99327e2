// A fake vLLM server for kvtier-frontend's tests: an in-process HTTP
// server on 127.0.0.1 whose answers the test sets (a whole answer, an event
// stream, a 5xx, a stream that dies before its first event, one that hangs
// after its header). /health answers 200 and /metrics nothing, as a vLLM
// server does when idle. Each connection has a thread of its own; the
// destructor closes every socket and joins them.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvtier::testing {

class FakeEngine {
 public:
  enum class Mode {
    kWhole,                // 200, a JSON body of known length
    kStream,               // 200, `events` SSE events `gap` apart, then [DONE]
    kStatus500,            // 500, a JSON error
    kDiesBeforeAnEvent,    // an event stream's header, then the connection closed
    kHangsAfterItsHeader,  // an event stream's header, then nothing until closed
    kSilent,               // no answer at all until closed (a long prefill, unstreamed)
    // What vLLM answers for a request it aborted before its first token (a
    // draining engine's, after SIGTERM): streamed, its header, a usage-only
    // event and [DONE]; unstreamed, 200 with the choice finished "abort".
    kAbortsStream,
    kAbortsWhole
  };

  explicit FakeEngine(Mode mode) : mode(mode) {
    acceptor_.open(tcp::v4());
    acceptor_.set_option(boost::asio::socket_base::reuse_address(true));
    acceptor_.bind({boost::asio::ip::make_address("127.0.0.1"), 0});
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~FakeEngine() {
    stopping_ = true;
    boost::system::error_code ignored;
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);  // wakes the blocked accept
    acceptor_.close(ignored);
    {
      std::lock_guard lk(mu_);
      for (auto& s : sockets_) s->shutdown(tcp::socket::shutdown_both, ignored);
    }
    accept_thread_.join();
    for (auto& t : threads_) t.join();
  }

  int port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

  std::atomic<Mode> mode;
  std::atomic<int> events{3};
  std::atomic<int> gap_ms{0};
  std::atomic<int> completions{0};  // completion requests received
  // The target and body of the last request that was not /health,
  // /metrics or /tokenize.
  std::string last_request() {
    std::lock_guard lk(mu_);
    return last_request_;
  }
  // /tokenize's answer to a request body (vLLM's {"tokens": [...]}); unset:
  // 404, as a server without the endpoint. Set before the engine is used.
  std::function<std::string(const std::string&)> tokenize;

 private:
  using tcp = boost::asio::ip::tcp;

  void AcceptLoop() {
    for (;;) {
      auto s = std::make_shared<tcp::socket>(io_);
      boost::system::error_code ec;
      acceptor_.accept(*s, ec);
      if (ec || stopping_) return;
      std::lock_guard lk(mu_);
      sockets_.push_back(s);
      threads_.emplace_back([this, s] { Serve(*s); });
    }
  }

  void Serve(tcp::socket& s) {
    namespace http = boost::beast::http;
    boost::beast::flat_buffer buf;
    for (;;) {
      http::request<http::string_body> req;
      boost::system::error_code ec;
      http::read(s, buf, req, ec);
      if (ec) return;
      const std::string target(req.target());
      // A whole answer; false when the connection ends with it.
      auto answer = [&](http::status status, std::string body) {
        http::response<http::string_body> res{status, 11};
        if (!body.empty()) res.set(http::field::content_type, "application/json");
        res.body() = std::move(body);
        res.keep_alive(req.keep_alive());
        res.prepare_payload();
        http::write(s, res, ec);
        return !ec && req.keep_alive();
      };
      bool again = true;
      if (target == "/health" || target == "/metrics") {
        again = answer(http::status::ok, "");
      } else if (target == "/tokenize") {
        again = tokenize ? answer(http::status::ok, tokenize(req.body()))
                         : answer(http::status::not_found, R"({"detail":"Not Found"})");
      } else {
        {
          std::lock_guard lk(mu_);
          last_request_ = target + " " + req.body();
        }
        completions++;
        const Mode m = mode.load();
        if (m == Mode::kWhole) {
          again = answer(http::status::ok,
                         R"({"id":"cmpl-1","object":"text_completion","choices":[{"text":"ok"}]})");
        } else if (m == Mode::kAbortsWhole) {
          again = answer(http::status::ok,
                         R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,)"
                         R"("text":"","finish_reason":"abort"}],"usage":{"prompt_tokens":7,)"
                         R"("total_tokens":7,"completion_tokens":0}})");
        } else if (m == Mode::kStatus500) {
          again = answer(http::status::internal_server_error,
                         R"({"error":{"message":"engine trouble","type":"InternalServerError"}})");
        } else if (m == Mode::kSilent) {
          char byte;
          s.read_some(boost::asio::buffer(&byte, 1), ec);  // until closed
          return;
        } else {
          Stream(s, m);
          return;
        }
      }
      if (!again) return;
    }
  }

  // An event stream, as vLLM writes one: the header at once, then events.
  void Stream(tcp::socket& s, Mode m) {
    namespace http = boost::beast::http;
    boost::system::error_code ec;
    http::response<http::empty_body> res{http::status::ok, 11};
    res.set(http::field::content_type, "text/event-stream; charset=utf-8");
    res.chunked(true);
    res.keep_alive(false);
    http::response_serializer<http::empty_body> sr{res};
    http::write_header(s, sr, ec);
    if (ec) return;
    if (m == Mode::kDiesBeforeAnEvent) {
      s.close(ec);
      return;
    }
    if (m == Mode::kHangsAfterItsHeader) {
      char byte;
      s.read_some(boost::asio::buffer(&byte, 1), ec);  // until closed
      return;
    }
    if (m == Mode::kAbortsStream) {
      const std::string e =
          "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[],"
          "\"usage\":{\"prompt_tokens\":7,\"total_tokens\":7,\"completion_tokens\":0}}\n\n"
          "data: [DONE]\n\n";
      boost::asio::write(s, http::make_chunk(boost::asio::buffer(e)), ec);
      boost::asio::write(s, http::make_chunk_last(), ec);
      s.shutdown(tcp::socket::shutdown_send, ec);
      return;
    }
    for (int i = 0; i < events.load(); ++i) {
      // The pace of a decode, as the test sets it: time is the subject.
      if (gap_ms.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms.load()));
      const std::string e = "data: {\"choices\":[{\"text\":\"t" + std::to_string(i) + "\"}]}\n\n";
      boost::asio::write(s, http::make_chunk(boost::asio::buffer(e)), ec);
      if (ec) return;
    }
    const std::string done = "data: [DONE]\n\n";
    boost::asio::write(s, http::make_chunk(boost::asio::buffer(done)), ec);
    boost::asio::write(s, http::make_chunk_last(), ec);
    s.shutdown(tcp::socket::shutdown_send, ec);
  }

  boost::asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<tcp::socket>> sockets_;
  std::string last_request_;  // guarded by mu_
  std::vector<std::thread> threads_;
  std::thread accept_thread_;
};

}  // namespace kvtier::testing
