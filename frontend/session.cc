// kvtier-frontend's client side: each connection's requests read within
// the client timeout and their caps (header, body, bodies in flight),
// routed to their endpoint and answered; connections past the cap refused;
// the accept loop, which pauses when out of descriptors.
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "frontend/server_impl.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // as in server.cc
#endif

namespace kvtier::frontend {

Task<> Frontend::Impl::Session(Socket socket) {
  Held open(&connections);
  Stream client(std::move(socket));
  beast::flat_buffer buf;
  bool unread = false;  // refused with bytes of its request unread
  for (;;) {
    http::request_parser<http::string_body> parser;
    parser.body_limit(options.max_body_bytes);
    parser.header_limit(kHeaderLimit);
    // The whole request within the client timeout, header and body.
    client.expires_after(std::chrono::milliseconds(options.client_timeout_ms));
    ErrorCode ec;
    co_await http::async_read_header(client, buf, parser, net::redirect_error(kAwait, ec));
    // The body's bytes are held from its header on: bodies read at once
    // stay within --max-body-bytes-in-flight (a chunked one counts as
    // --max-body-bytes). One that would pass it is refused unread.
    const uint64_t length = !ec && parser.content_length() ? *parser.content_length()
                            : !ec && parser.chunked()      ? options.max_body_bytes
                                                           : 0;
    Reserved body_bytes(&body_bytes_in_flight, std::min(length, options.max_body_bytes));
    if (!ec && !body_bytes.ok(options.max_body_bytes_in_flight)) {
      ApiError busy{503, "service_unavailable",
                    absl::StrCat("the frontend holds its most request bodies in flight (",
                                 options.max_body_bytes_in_flight, " bytes); try again"),
                    "", ""};
      std::string other = "other";
      co_await ReplyError(client, std::move(other), std::move(busy), false, 1);
      unread = true;
      break;
    }
    if (!ec && !parser.is_done()) {
      co_await http::async_read(client, buf, parser, net::redirect_error(kAwait, ec));
    }
    if (ec == http::error::body_limit) {
      ApiError big{413, "invalid_request_error",
                   absl::StrCat("the body is over ", options.max_body_bytes, " bytes"), "", ""};
      std::string other = "other";
      co_await ReplyError(client, std::move(other), std::move(big), false);
      unread = true;
      break;
    }
    if (ec == http::error::header_limit) {
      ApiError big{431, "invalid_request_error",
                   absl::StrCat("the header is over ", kHeaderLimit, " bytes"), "", ""};
      std::string other = "other";
      co_await ReplyError(client, std::move(other), std::move(big), false);
      unread = true;
      break;
    }
    if (ec) break;  // closed, timed out or not HTTP
    client.expires_never();
    const auto arrived = Clock::now();
    Held busy(&requests_in_flight);
    auto& req = parser.get();
    // Draining: this request is served and its connection closed.
    const bool keep = req.keep_alive() && !draining.load();
    const std::string target(req.target());
    const std::string path = target.substr(0, target.find('?'));
    bool again = keep;
    const bool completion = path == "/v1/completions" || path == "/v1/chat/completions";
    const bool pass = IsPassThrough(path);
    // With --api-keys-file every API path asks for a key; /health and
    // /metrics (an operator's, best on --metrics-listen) do not.
    std::optional<ApiKeys::Key> key;
    const bool api = completion || pass || path == "/v1/models";
    if (api && keys) {
      const std::string auth(req[http::field::authorization]);
      const std::shared_ptr<const ApiKeys> now = keys->keys();  // the file read last
      if (const ApiKeys::Key* k = now->Find(auth)) key = *k;
      if (!key) {
        ApiError who = KeyRequired(!auth.empty());
        std::string other = "unauthorized";
        again = co_await ReplyError(client, std::move(other), std::move(who), keep);
        if (!again) break;
        continue;
      }
    }
    if (completion || pass) {
      Incoming in;
      in.endpoint = pass                             ? Endpoint::kPassThrough
                    : path == "/v1/chat/completions" ? Endpoint::kChat
                                                     : Endpoint::kCompletions;
      in.path = path;
      in.name = pass ? "passthrough" : in.endpoint == Endpoint::kChat ? "chat" : "completions";
      in.key = key;
      in.arrived = arrived;
      in.keep_alive = keep;
      if (req.method() != http::verb::post) {
        ApiError post{405, "invalid_request_error", "use POST", "", ""};
        again = co_await ReplyError(client, in.name, std::move(post), keep);
      } else {
        const std::string& body = req.body();
        // A session id past 256 bytes is not one a client means: ignored.
        in.session_id = std::string(req["x-session-id"]);
        if (in.session_id.size() > 256) in.session_id.clear();
        again = co_await Proxy(client, in, body);
      }
    } else if (path == "/v1/models" && req.method() == http::verb::get) {
      counters.Request("models", 200);
      std::string listed = ModelsBody(models, started_unix);
      again = co_await ReplyJson(client, 200, std::move(listed), keep);
    } else if (path == "/ping" && req.method() == http::verb::get) {
      // Alive: it reads and answers (a liveness probe; it asks no key and
      // does not depend on the engines, as /health does).
      counters.Request("ping", 200);
      std::string pong = "{}";
      again = co_await ReplyJson(client, 200, std::move(pong), keep);
    } else if (path == "/health" && req.method() == http::verb::get) {
      size_t up = 0;
      const int64_t now = NowMs();
      const std::shared_ptr<const FleetView> f = fleet->Snapshot();
      const auto& engines = f->engines;
      for (auto& e : engines) up += e->Usable(now) ? 1 : 0;
      // Draining: failing, so that load balancers send no more.
      const bool ok = up > 0 && !draining.load();
      const unsigned status = ok ? 200 : 503;
      counters.Request("health", static_cast<int>(status));
      std::string health = absl::StrCat(
          "{\"status\":\"", draining.load() ? "draining" : (up > 0 ? "ok" : "no engine"),
          "\",\"engines_up\":", up, ",\"engines\":", engines.size(), "}");
      again = co_await ReplyJson(client, status, std::move(health), keep);
    } else if (path == "/metrics" && req.method() == http::verb::get &&
               options.metrics_listen.empty()) {
      http::response<http::string_body> res{http::status::ok, 11};
      res.set(http::field::content_type, "text/plain; version=0.0.4");
      res.body() =
          RenderMetrics(counters, *fleet->Snapshot(), router->core(), deletion_costs.get());
      again = co_await Reply(client, res, keep);
    } else {
      ApiError missing{404, "invalid_request_error", absl::StrCat("no route ", path), "", ""};
      std::string other = "other";
      again = co_await ReplyError(client, std::move(other), std::move(missing), keep);
    }
    if (!again) break;
  }
  if (unread) {
    co_await Linger(client);
  } else {
    ErrorCode ignored;
    client.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }
}

Task<> Frontend::Impl::Linger(Stream& client) {
  ErrorCode ec;
  client.socket().shutdown(tcp::socket::shutdown_send, ec);
  client.expires_after(kLinger);
  char scratch[16384];
  for (size_t dropped = 0; !ec && dropped < kLingerBytes;) {
    dropped +=
        co_await client.async_read_some(net::buffer(scratch), net::redirect_error(kAwait, ec));
  }
}

Task<> Frontend::Impl::Refuse(Socket socket) {
  Held open(&refusing);
  Stream client(std::move(socket));
  ApiError busy{503, "service_unavailable",
                absl::StrCat("the frontend holds its most connections (", options.max_connections,
                             "); try again"),
                "", ""};
  std::string other = "other";
  co_await ReplyError(client, std::move(other), std::move(busy), false, 1);
  co_await Linger(client);
}

Task<> Frontend::Impl::Accept() {
  Timer pause(co_await net::this_coro::executor);
  for (;;) {
    ErrorCode ec;
    const Executor to = loops[next_loop++ % loops.size()]->get_executor();
    Socket s = co_await acceptor->async_accept(to, net::redirect_error(kAwait, ec));
    if (ec == net::error::operation_aborted) co_return;
    if (ec == net::error::no_descriptors || ec == net::error::no_buffer_space ||
        ec == net::error::no_memory || ec.value() == ENFILE) {
      // Out of descriptors: the pending connection waits in the backlog
      // while those in flight end (accepting again at once would spin).
      if (!out_of_descriptors.exchange(true)) {
        Log("frontend", "cannot accept: ", ec.message(), "; pausing accepts");
      }
      pause.expires_after(std::chrono::milliseconds(50));
      co_await pause.async_wait(net::redirect_error(kAwait, ec));
      continue;
    }
    if (ec) continue;  // that connection failed (reset before it was taken)
    out_of_descriptors = false;
    s.set_option(tcp::no_delay(true), ec);
    auto exec = s.get_executor();
    if (connections.load() + refusing.load() >= static_cast<int64_t>(options.max_connections)) {
      if (refusing.load() < kMostRefusing) net::co_spawn(exec, Refuse(std::move(s)), net::detached);
      continue;  // past both caps: closed unanswered
    }
    net::co_spawn(exec, Session(std::move(s)), net::detached);
  }
}

}  // namespace kvtier::frontend
