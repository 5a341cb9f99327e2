// kvtier-frontend's server: the client's side (each connection's requests
// read, checked and answered; completions tried on the engines the router
// chooses, in turn) and the parts' assembly. The parts: the fleet and its
// health (frontend/fleet.h), the choice (choice.h), upstream connections
// (pool.h), the relay of one try (relay.h), prefill/decode (handoff.h),
// load (load.h) and metrics (metrics.h).
#include "frontend/server.h"

#include <memory>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "frontend/asio.h"
#include "frontend/choice.h"
#include "frontend/fleet.h"
#include "frontend/handoff.h"
#include "frontend/load.h"
#include "frontend/metrics.h"
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
  std::unique_ptr<router::EmbeddedRouter> router;
  std::unique_ptr<DeletionCostUpdater> deletion_costs;  // --deletion-cost-selector
  uint64_t namespace_id = 0;
  Counters counters;
  std::optional<LoadBook> load;
  std::unique_ptr<Fleet> fleet;
  std::unique_ptr<Relay> relay;
  std::unique_ptr<Prefiller> prefiller;
  std::optional<Acceptor> acceptor;
  size_t next_loop = 0;
  std::vector<std::thread> threads;
  uint64_t started_unix = 0;
  int port = 0;

  template <typename Body>
  Task<bool> Reply(Stream& client, http::response<Body>& res, bool keep_alive) {
    res.set(http::field::server, "kvtier-frontend");
    res.keep_alive(keep_alive);
    res.prepare_payload();
    ErrorCode ec;
    co_await http::async_write(client, res, net::redirect_error(kAwait, ec));
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
    PrepareResult prep = Prepare(endpoint, body, *text, options.served_model, options.limits);
    if (prep.error) {
      ApiError err = *prep.error;
      const bool again = co_await ReplyError(client, name, std::move(err), keep_alive);
      co_return again;
    }
    const Prepared& p = prep.prepared;
    std::set<const Engine*> tried;
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
      if (attempt == 0) load->Seen(c.uncached);
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
      if (attempt == 0) {
        const auto us =
            std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - arrived).count();
        counters.added.Record(static_cast<uint64_t>(us));
      }
      const std::shared_ptr<Engine> held = c.engine;  // lives while it serves
      Engine& e = *held;
      // After a handoff the decode engine loads the prompt's KV rather
      // than computing it: its prefill queue gains nothing.
      Ticket ticket = load->Charge(e, p.prompt_tokens, send == &handed ? 0 : c.uncached);
      const std::string explain = absl::StrCat(c.explain, prefill_note, "; attempt=", attempt + 1);
      if (options.log_routes) Log("route", explain, "; prompt_tokens=", p.prompt_tokens);
      Tried t =
          co_await relay->Forward(e, *send, explain, client, keep_alive, &client_keep, &ticket);
      load->Finish(e, &ticket);
      if (t == Tried::kDone) {
        counters.Request(name, 200);
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
    const bool again = co_await ReplyError(client, name, std::move(none), keep_alive);
    co_return again;
  }

  Task<> Session(Socket socket) {
    Stream client(std::move(socket));
    beast::flat_buffer buf;
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(options.max_body_bytes);
      parser.header_limit(64 << 10);
      client.expires_after(std::chrono::milliseconds(options.client_timeout_ms));
      ErrorCode ec;
      co_await http::async_read(client, buf, parser, net::redirect_error(kAwait, ec));
      if (ec == http::error::body_limit) {
        ApiError big{413, "invalid_request_error",
                     absl::StrCat("the body is over ", options.max_body_bytes, " bytes"), "", ""};
        std::string other = "other";
        co_await ReplyError(client, std::move(other), std::move(big), false);
        break;
      }
      if (ec) break;  // closed, timed out or not HTTP
      client.expires_never();
      const auto arrived = Clock::now();
      auto& req = parser.get();
      const bool keep = req.keep_alive();
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
        const unsigned status = up > 0 ? 200 : 503;
        counters.Request("health", static_cast<int>(status));
        std::string health =
            absl::StrCat("{\"status\":\"", up > 0 ? "ok" : "no engine", "\",\"engines_up\":", up,
                         ",\"engines\":", engines.size(), "}");
        again = co_await ReplyJson(client, status, std::move(health), keep);
      } else if (path == "/metrics" && req.method() == http::verb::get) {
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
    ErrorCode ignored;
    client.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  Task<> Accept() {
    for (;;) {
      ErrorCode ec;
      const Executor to = loops[next_loop++ % loops.size()]->get_executor();
      Socket s = co_await acceptor->async_accept(to, net::redirect_error(kAwait, ec));
      if (ec) {
        if (ec == net::error::operation_aborted) co_return;
        continue;
      }
      s.set_option(tcp::no_delay(true), ec);
      auto exec = s.get_executor();
      net::co_spawn(exec, Session(std::move(s)), net::detached);
    }
  }
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
  raw->fleet = std::make_unique<Fleet>(o, &raw->router->core(), &*raw->load, &raw->counters, first);
  raw->relay = std::make_unique<Relay>(o, *raw->fleet, *raw->load, raw->counters, o.threads);
  raw->prefiller = std::make_unique<Prefiller>(raw->router->core(), raw->namespace_id, *raw->fleet,
                                               *raw->load, raw->counters, *raw->relay);
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

Frontend::~Frontend() {
  impl_->deletion_costs.reset();
  for (auto& loop : impl_->loops) loop->stop();
  for (auto& t : impl_->threads) t.join();
  // Every engine's event thread ends before the router it calls is
  // destroyed (coroutine frames that hold engines end with the loops).
  if (impl_->fleet) impl_->fleet->Close();
}

int Frontend::port() const { return impl_->port; }

std::string Frontend::router_address() const { return impl_->router->address(); }

}  // namespace kvtier::frontend
