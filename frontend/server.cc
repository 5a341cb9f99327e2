// kvtier-frontend's server: the client's side (each connection's requests
// read, checked and answered; completions tried on the engines the router
// chooses, in turn) and the parts' assembly. The parts: the fleet and its
// health (frontend/fleet.h), the choice (choice.h), upstream connections
// (pool.h), the relay of one try (relay.h), prefill/decode (handoff.h),
// load (load.h) and metrics (metrics.h).
#include "frontend/server.h"

// GCC 12 warns that Asio's coroutine frames, allocated by their own
// operator new, are freed by their own operator delete "mismatched" once
// it inlines one frame's code into another's (a false positive: both are
// awaitable_frame_base's, a recycling allocator's pair).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <future>
#include <memory>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc/metrics.h"
#include "frontend/asio.h"
#include "frontend/choice.h"
#include "frontend/fleet.h"
#include "frontend/handoff.h"
#include "frontend/load.h"
#include "frontend/metrics.h"
#include "frontend/offload.h"
#include "frontend/relay.h"
#include "router/embedded_router.h"

namespace kvtier::frontend {

struct Frontend::Impl {
  FrontendOptions options;
  // One io_context per thread; connections are dealt round-robin. Declared
  // first of what uses them: coroutines and pooled connections are
  // destroyed before their io_contexts.
  std::vector<std::unique_ptr<net::io_context>> loops;
  // Each loop runs until stopped, whether or not it has connections yet.
  std::vector<net::executor_work_guard<Executor>> keep_running;
  std::unique_ptr<TextModel> text;
  // Prepares large requests (joined before `text` goes).
  std::optional<net::thread_pool> text_pool;
  static constexpr size_t kInlineBody = 16 << 10;
  std::unique_ptr<router::EmbeddedRouter> router;
  std::unique_ptr<DeletionCostUpdater> deletion_costs;  // --deletion-cost-selector
  uint64_t namespace_id = 0;
  Counters counters;
  std::optional<LoadBook> load;
  std::unique_ptr<Fleet> fleet;
  std::unique_ptr<Relay> relay;
  std::unique_ptr<Prefiller> prefiller;
  std::unique_ptr<MetricsServer> metrics_server;  // --metrics-listen
  std::optional<Acceptor> acceptor;
  size_t next_loop = 0;
  std::vector<std::thread> threads;
  uint64_t started_unix = 0;
  int port = 0;
  // Client connections open, connections being refused, requests being
  // served (read, not yet answered whole).
  std::atomic<int64_t> refusing{0};
  std::atomic<int64_t>& connections = counters.connections;
  std::atomic<int64_t>& requests_in_flight = counters.requests_in_flight;
  std::atomic<uint64_t>& body_bytes_in_flight = counters.body_bytes_in_flight;
  std::atomic<bool> draining{false}, out_of_descriptors{false};

  template <typename Body>
  Task<bool> Reply(Stream& client, http::response<Body>& res, bool keep_alive) {
    res.set(http::field::server, "kvtier-frontend");
    res.keep_alive(keep_alive);
    res.prepare_payload();
    ErrorCode ec;
    // A client that does not read its answer is cut at the client timeout.
    client.expires_after(std::chrono::milliseconds(options.client_timeout_ms));
    co_await http::async_write(client, res, net::redirect_error(kAwait, ec));
    client.expires_never();
    co_return !ec && keep_alive;
  }

  // GCC 12 destroys some temporaries of a co_await's full-expression twice:
  // every argument of a coroutine call here is a named local.
  Task<bool> ReplyJson(Stream& client, unsigned status, std::string body, bool keep_alive) {
    http::response<http::string_body> res{static_cast<http::status>(status), 11};
    res.set(http::field::content_type, "application/json");
    res.body() = std::move(body);
    const bool again = co_await Reply(client, res, keep_alive);
    co_return again;
  }

  Task<bool> ReplyError(Stream& client, std::string endpoint, ApiError e, bool keep_alive) {
    counters.Request(endpoint, e.status);
    std::string body = ErrorBody(e);
    const bool again = co_await ReplyJson(client, e.status, std::move(body), keep_alive);
    co_return again;
  }

  Task<bool> Proxy(Stream& client, Endpoint endpoint, const std::string& name,
                   const std::string& body, bool keep_alive, Clock::time_point arrived) {
    // A large body (a long prompt to tokenize, a long chat to render) is
    // prepared off this thread: the streams it serves go on meanwhile.
    auto prepare = [this, endpoint, &body] {
      return Prepare(endpoint, body, *text, options.served_model, options.limits);
    };
    PrepareResult prep;
    if (body.size() <= kInlineBody) {
      prep = prepare();
    } else {
      // GCC 12: the coroutine's argument a named local, its result one too.
      PrepareResult off = co_await OffThread(*text_pool, prepare);
      prep = std::move(off);
    }
    if (prep.error) {
      ApiError err = *prep.error;
      const bool again = co_await ReplyError(client, name, std::move(err), keep_alive);
      co_return again;
    }
    const Prepared& p = prep.prepared;
    std::set<const Engine*> tried;
    ClientAnswer answer;  // over the tries
    bool client_keep = keep_alive;
    // With prefill engines, a long uncached prompt is prefilled there first
    // and the decode engine sent it with the handoff's params.
    Prepared handed;
    const Prepared* send = &p;
    std::string prefill_note;
    for (uint32_t attempt = 0; attempt < options.max_attempts; ++attempt) {
      Choice c = Choose(router->core(), namespace_id, *fleet->Snapshot(), p.tokens, p.prompt_tokens,
                        tried, Want::kDecode, counters);
      if (c.engine == nullptr) break;
      if (attempt == 0) {
        load->Seen(c.uncached);
        // What the frontend adds: read to chosen (a handoff's prefill is
        // the engines' time, not the frontend's).
        const auto us =
            std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - arrived).count();
        counters.added.Record(static_cast<uint64_t>(us));
      }
      if (attempt == 0 && p.disaggregable && c.uncached > options.pd_threshold &&
          fleet->HasPrefillEngines()) {
        bool gone = false;
        auto params = co_await prefiller->Prefill(p, client, &prefill_note, &gone);
        if (gone) {
          counters.Request(name, 499);
          co_return false;
        }
        if (params) {
          handed = p;
          handed.body = DecodeBody(p, *params);
          send = &handed;
        }
      }
      tried.insert(c.engine.get());
      if (attempt > 0) counters.failovers++;
      const std::shared_ptr<Engine> held = c.engine;  // lives while it serves
      Engine& e = *held;
      // After a handoff the decode engine loads the prompt's KV rather
      // than computing it: its prefill queue gains nothing.
      Ticket ticket = load->Charge(e, p.prompt_tokens, send == &handed ? 0 : c.uncached);
      const std::string explain = absl::StrCat(c.explain, prefill_note, "; attempt=", attempt + 1);
      if (options.log_routes) Log("route", explain, "; prompt_tokens=", p.prompt_tokens);
      Tried t = co_await relay->Forward(e, *send, explain, client, keep_alive, &client_keep,
                                        &ticket, &answer);
      load->Finish(e, &ticket);
      if (t == Tried::kDone) {
        if (!answer.cut) Fleet::Answered(e);
        counters.Request(name, answer.status);
        if (answer.cut) counters.streams_cut++;
        co_return client_keep;
      }
      if (t == Tried::kClientGone) {
        counters.Request(name, 499);
        co_return false;
      }
    }
    counters.no_engine++;
    ApiError none{503, "service_unavailable",
                  tried.empty() ? "no engine is available"
                                : absl::StrCat("no engine could serve the request (", tried.size(),
                                               " tried)"),
                  "", ""};
    if (answer.head_sent) {  // its event stream began: it ends with the error
      counters.Request(name, 503);
      std::string error = ErrorBody(none);
      const bool told = co_await relay->EndWithEvent(client, std::move(error));
      if (!told) counters.client_disconnects++;
      co_return false;
    }
    const bool again = co_await ReplyError(client, name, std::move(none), keep_alive);
    co_return again;
  }

  static constexpr uint32_t kHeaderLimit = 64 << 10;

  // Counts one while it lives.
  struct Held {
    explicit Held(std::atomic<int64_t>* n) : n(n) { ++*n; }
    ~Held() { --*n; }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
    std::atomic<int64_t>* n;
  };

  // `n` bytes counted in `*total` while it lives; ok() when the total
  // with them is within a cap.
  struct Reserved {
    Reserved(std::atomic<uint64_t>* total, uint64_t n) : total(total), n(n), after(*total += n) {}
    ~Reserved() { *total -= n; }
    Reserved(const Reserved&) = delete;
    Reserved& operator=(const Reserved&) = delete;
    bool ok(uint64_t cap) const { return n == 0 || after <= cap; }
    std::atomic<uint64_t>* total;
    uint64_t n, after;
  };

  Task<> Session(Socket socket) {
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
        counters.Request("other", 503);
        ApiError busy{503, "service_unavailable",
                      absl::StrCat("the frontend holds its most request bodies in flight (",
                                   options.max_body_bytes_in_flight, " bytes); try again"),
                      "", ""};
        std::string body = ErrorBody(busy);
        http::response<http::string_body> res{http::status::service_unavailable, 11};
        res.set(http::field::content_type, "application/json");
        res.set(http::field::retry_after, "1");
        res.body() = std::move(body);
        co_await Reply(client, res, false);
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
      if (path == "/v1/completions" || path == "/v1/chat/completions") {
        const bool chat = path == "/v1/chat/completions";
        const std::string name = chat ? "chat" : "completions";
        if (req.method() != http::verb::post) {
          ApiError post{405, "invalid_request_error", "use POST", "", ""};
          again = co_await ReplyError(client, name, std::move(post), keep);
        } else {
          const Endpoint endpoint = chat ? Endpoint::kChat : Endpoint::kCompletions;
          const std::string& body = req.body();
          again = co_await Proxy(client, endpoint, name, body, keep, arrived);
        }
      } else if (path == "/v1/models" && req.method() == http::verb::get) {
        counters.Request("models", 200);
        std::string models = ModelsBody(options.served_model, started_unix, options.max_model_len);
        again = co_await ReplyJson(client, 200, std::move(models), keep);
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

  // Closes a connection whose client may still be sending (a request
  // refused unread): the answer's end is sent, then what comes is read and
  // dropped for up to kLinger, so that closing with unread bytes (a TCP
  // reset) does not destroy the answer before the client reads it.
  static constexpr auto kLinger = std::chrono::seconds(1);
  static constexpr size_t kLingerBytes = 16 << 20;
  Task<> Linger(Stream& client) {
    ErrorCode ec;
    client.socket().shutdown(tcp::socket::shutdown_send, ec);
    client.expires_after(kLinger);
    char scratch[16384];
    for (size_t dropped = 0; !ec && dropped < kLingerBytes;) {
      dropped +=
          co_await client.async_read_some(net::buffer(scratch), net::redirect_error(kAwait, ec));
    }
  }

  // A connection past --max-connections: answered 503 with Retry-After
  // (within the client timeout) and closed.
  Task<> Refuse(Socket socket) {
    Held open(&refusing);
    Stream client(std::move(socket));
    counters.Request("other", 503);
    http::response<http::string_body> res{http::status::service_unavailable, 11};
    res.set(http::field::content_type, "application/json");
    res.set(http::field::retry_after, "1");
    res.body() = ErrorBody(ApiError{503, "service_unavailable",
                                    absl::StrCat("the frontend holds its most connections (",
                                                 options.max_connections, "); try again"),
                                    "", ""});
    co_await Reply(client, res, false);
    co_await Linger(client);
  }

  Task<> Accept() {
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
        if (refusing.load() < kMostRefusing)
          net::co_spawn(exec, Refuse(std::move(s)), net::detached);
        continue;  // past both caps: closed unanswered
      }
      net::co_spawn(exec, Session(std::move(s)), net::detached);
    }
  }
  static constexpr int64_t kMostRefusing = 64;
};

Frontend::Frontend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<Frontend>> Frontend::Start(FrontendOptions options,
                                                          std::unique_ptr<TextModel> text) {
  if (auto s = options.Validate(); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->text = std::move(text);
  const FrontendOptions& o = impl->options;
  auto router = router::EmbeddedRouter::Start(o.router, o.router_listen);
  if (!router.ok()) return router.status();
  impl->router = std::move(*router);
  impl->namespace_id =
      o.engines.empty() ? o.dns.front().spec.namespace_id : o.engines.front().namespace_id;
  const size_t colon = o.listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--listen ", o.listen, " is not host:port"));
  }
  ErrorCode ec;
  auto addr = net::ip::make_address(o.listen.substr(0, colon), ec);
  if (ec)
    return absl::InvalidArgumentError(absl::StrCat("--listen ", o.listen, ": ", ec.message()));
  tcp::endpoint ep(addr, static_cast<uint16_t>(std::stoi(o.listen.substr(colon + 1))));
  for (int i = 0; i < o.threads; ++i) {
    impl->loops.push_back(std::make_unique<net::io_context>(BOOST_ASIO_CONCURRENCY_HINT_1));
    impl->keep_running.push_back(net::make_work_guard(impl->loops.back()->get_executor()));
  }
  impl->acceptor.emplace(impl->loops[0]->get_executor());
  impl->acceptor->open(ep.protocol(), ec);
  if (!ec) impl->acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor->bind(ep, ec);
  if (!ec) impl->acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", o.listen, ": ", ec.message()));
  }
  impl->port = impl->acceptor->local_endpoint().port();
  impl->started_unix =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  if (!o.deletion_cost.selector.empty()) {
    router::RouterCore* core = &impl->router->core();
    auto costs = DeletionCostUpdater::Start(
        o.deletion_cost,
        o.engines.empty() ? o.dns.front().spec.block_tokens : o.engines.front().block_tokens,
        [core] { return core->Sources(); });
    if (!costs.ok()) return costs.status();
    impl->deletion_costs = std::move(*costs);
  }
  Impl* raw = impl.get();
  const Executor first = raw->loops[0]->get_executor();
  raw->load.emplace(o.decode_weight);
  raw->text_pool.emplace(static_cast<size_t>(o.text_threads));
  raw->fleet = std::make_unique<Fleet>(o, &raw->router->core(), &*raw->load, &raw->counters, first,
                                       raw->text.get());
  raw->relay = std::make_unique<Relay>(o, *raw->fleet, *raw->load, raw->counters, o.threads);
  raw->prefiller = std::make_unique<Prefiller>(raw->router->core(), raw->namespace_id, *raw->fleet,
                                               *raw->load, raw->counters, *raw->relay);
  if (!o.metrics_listen.empty()) {
    auto server = MetricsServer::Start(o.metrics_listen, [raw] {
      return CollectMetrics(raw->counters, *raw->fleet->Snapshot(), raw->router->core(),
                            raw->deletion_costs.get());
    });
    if (!server.ok()) return server.status();
    raw->metrics_server = std::move(*server);
  }
  net::co_spawn(first, raw->Accept(), net::detached);
  raw->fleet->Start();
  for (size_t i = 0; i < raw->loops.size(); ++i) {
    raw->threads.emplace_back([raw, i] {
      t_loop = i;
      raw->loops[i]->run();
    });
  }
  return std::unique_ptr<Frontend>(new Frontend(std::move(impl)));
}

bool Frontend::Drain(uint64_t grace_ms) {
  Impl* impl = impl_.get();
  if (impl->draining.exchange(true)) return impl->requests_in_flight.load() == 0;
  std::promise<void> closed;
  net::post(impl->loops[0]->get_executor(), [impl, &closed] {
    ErrorCode ignored;
    impl->acceptor->close(ignored);
    closed.set_value();
  });
  closed.get_future().wait();
  Log("frontend", "draining: no new connection; ", impl->requests_in_flight.load(),
      " requests in flight get up to ", grace_ms, " ms");
  const auto until = Clock::now() + std::chrono::milliseconds(grace_ms);
  while (impl->requests_in_flight.load() > 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t left = impl->requests_in_flight.load();
  Log("frontend", left == 0 ? "drained: every request in flight ended"
                            : absl::StrCat("drain timed out: ", left, " requests are cut"));
  return left == 0;
}

Frontend::~Frontend() {
  impl_->metrics_server.reset();  // its scrapes read what follows
  impl_->deletion_costs.reset();
  for (auto& loop : impl_->loops) loop->stop();
  for (auto& t : impl_->threads) t.join();
  // Every engine's event thread ends before the router it calls is
  // destroyed (coroutine frames that hold engines end with the loops).
  if (impl_->fleet) impl_->fleet->Close();
}

int Frontend::port() const { return impl_->port; }

int Frontend::metrics_port() const {
  return impl_->metrics_server ? impl_->metrics_server->port() : 0;
}

std::string Frontend::router_address() const { return impl_->router->address(); }

}  // namespace kvtier::frontend
