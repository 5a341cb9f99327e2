// kvtier-frontend's server: the parts' assembly, and a completion's tries
// on the engines the router chooses. The parts: the fleet and its health
// (frontend/fleet.h), the choice (choice.h), upstream connections
// (pool.h), the relay of one try (relay.h), prefill/decode (handoff.h),
// load (load.h), metrics (metrics.h); the client's side is session.cc.
#include "frontend/server.h"

// GCC 12 warns that Asio's coroutine frames, allocated by their own
// operator new, are freed by their own operator delete "mismatched" once
// it inlines one frame's code into another's (a false positive: both are
// awaitable_frame_base's, a recycling allocator's pair).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <memory>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/log.h"
#include "frontend/choice.h"
#include "frontend/offload.h"
#include "frontend/server_impl.h"

namespace kvtier::frontend {

// GCC 12 destroys some temporaries of a co_await's full-expression twice:
// every argument of a coroutine call here is a named local.
Task<bool> Frontend::Impl::ReplyJson(Stream& client, unsigned status, std::string body,
                                     bool keep_alive, uint64_t retry_after_s) {
  http::response<http::string_body> res{static_cast<http::status>(status), 11};
  res.set(http::field::content_type, "application/json");
  if (retry_after_s > 0) res.set(http::field::retry_after, std::to_string(retry_after_s));
  res.body() = std::move(body);
  const bool again = co_await Reply(client, res, keep_alive);
  co_return again;
}

Task<bool> Frontend::Impl::ReplyError(Stream& client, std::string endpoint, ApiError e,
                                      bool keep_alive, uint64_t retry_after_s) {
  counters.Request(endpoint, e.status);
  std::string body = ErrorBody(e);
  const bool again =
      co_await ReplyJson(client, e.status, std::move(body), keep_alive, retry_after_s);
  co_return again;
}

Task<> Frontend::Impl::Backoff(uint32_t round) {
  thread_local std::minstd_rand jitter(std::random_device{}());
  const uint64_t base =
      std::min(options.retry_backoff_max_ms, options.retry_backoff_ms << std::min(round, 20u));
  const double scale = 0.8 + 0.4 * std::uniform_real_distribution<double>(0, 1)(jitter);
  Timer t(co_await net::this_coro::executor);
  t.expires_after(
      std::chrono::milliseconds(static_cast<int64_t>(static_cast<double>(base) * scale)));
  ErrorCode ignored;
  co_await t.async_wait(net::redirect_error(kAwait, ignored));
}

Task<bool> Frontend::Impl::Proxy(Stream& client, const Incoming& in, const std::string& body) {
  const std::string& name = in.name;
  const bool keep_alive = in.keep_alive;
  // A large body (a long prompt to tokenize, a long chat to render) is
  // prepared off this thread: the streams it serves go on meanwhile.
  auto prepare = [this, &in, &body] {
    return in.endpoint == Endpoint::kPassThrough
               ? PreparePassThrough(in.path, body, models)
               : Prepare(in.endpoint, body, models, options.limits);
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
  if (in.key.has_value()) {
    const uint64_t tokens = p.prompt_tokens + p.max_new_tokens;
    if (auto wait = rates.Take(in.key->name, in.key->tokens_per_minute, tokens, NowMs())) {
      ApiError over = OverTokenRate(*in.key, tokens, *wait);
      const uint64_t after = std::isinf(*wait) ? 0 : static_cast<uint64_t>(std::ceil(*wait));
      const bool again = co_await ReplyError(client, name, std::move(over), keep_alive,
                                             std::max<uint64_t>(after, 1));
      co_return again;
    }
  }
  // Its turn: held until its answer ends.
  Admission::Refused refused = Admission::Refused::kNone;
  Admission::Slot turn;
  {
    Held queued(&counters.queued);
    std::function<bool()> gone = [&client] { return ClientGone(&client); };
    Admission::Slot got = co_await admission->Enter(&refused, std::move(gone));
    turn = std::move(got);
  }
  if (refused == Admission::Refused::kClientGone) {  // it left while it waited
    counters.Request(name, 499);
    counters.client_disconnects++;
    co_return false;
  }
  if (refused != Admission::Refused::kNone) {
    counters.queue_refused++;
    ApiError busy = QueueRefused(refused, options.queue_timeout_ms);
    const bool again = co_await ReplyError(client, name, std::move(busy), keep_alive, 1);
    co_return again;
  }
  const std::string& session_id = in.session_id;
  const Clock::time_point arrived = in.arrived;
  std::set<const Engine*> tried;
  ClientAnswer answer;  // over the tries
  bool client_keep = keep_alive;
  // With prefill engines, a long uncached prompt is prefilled there first
  // and the decode engine sent it with the handoff's params.
  Prepared handed;
  const Prepared* send = &p;
  std::string prefill_note;
  const bool affine = sessions.has_value() && !session_id.empty();
  uint32_t attempt = 0, rounds = 0;
  while (attempt < options.max_attempts) {
    const std::shared_ptr<const FleetView> view = fleet->Snapshot();
    Choice c;
    if (attempt == 0 && affine) {
      // The session's engine, if it is usable: the router is asked with
      // every other engine left out, so the route's load lands there.
      const std::string bound = sessions->Engine(session_id, NowMs());
      const auto kept = std::find_if(view->engines.begin(), view->engines.end(), [&](auto& e) {
        return e->spec.id == bound && e->Usable(NowMs()) && Serves(e->spec, Want::kDecode);
      });
      if (kept != view->engines.end()) {
        std::set<const Engine*> others;
        for (const auto& e : view->engines) {
          if (e != *kept) others.insert(e.get());
        }
        c = Choose(router->core(), p.namespace_id, *view, p.tokens, p.prompt_tokens, p.variant,
                   others, Want::kDecode, counters);
        if (c.engine != nullptr) absl::StrAppend(&c.explain, "; session=kept");
      }
    }
    if (c.engine == nullptr) {
      c = Choose(router->core(), p.namespace_id, *view, p.tokens, p.prompt_tokens, p.variant, tried,
                 Want::kDecode, counters);
    }
    if (c.engine == nullptr) {
      // Every engine tried (or none usable): with attempts left, the
      // usable ones again after a back-off.
      if (options.retry_backoff_ms == 0 || rounds >= options.max_attempts) break;
      co_await Backoff(rounds++);
      counters.retries++;
      tried.clear();
      continue;
    }
    if (attempt == 0) {
      if (p.endpoint != Endpoint::kPassThrough) load->Seen(c.uncached);
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
        counters.client_disconnects++;
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
    Tried t = co_await relay->Forward(e, *send, explain, client, keep_alive, &client_keep, &ticket,
                                      &answer);
    load->Finish(e, &ticket);
    if (t == Tried::kDone) {
      if (!answer.cut) Fleet::Answered(e);
      if (affine && answer.status < 500) sessions->Bind(session_id, e.spec.id, NowMs());
      counters.Request(name, answer.status);
      if (answer.cut) counters.streams_cut++;
      co_return client_keep;
    }
    if (t == Tried::kClientGone) {  // every way a client leaves is counted here
      counters.Request(name, 499);
      counters.client_disconnects++;
      co_return false;
    }
    ++attempt;
  }
  counters.no_engine++;
  ApiError none{503, "service_unavailable",
                tried.empty()
                    ? "no engine is available"
                    : absl::StrCat("no engine could serve the request (", tried.size(), " tried)"),
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
  impl->models.push_back(ServedModel{o.served_model, o.lora_adapters, impl->text.get(),
                                     o.max_model_len, o.FirstNamespace()});
  for (const auto& m : o.extra_models) {
    auto t = TextModel::Open(m.dir);
    if (!t.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--extra-models ", m.name, ": ", t.status().message()));
    }
    impl->extra_texts.push_back(std::move(*t));
    impl->models.push_back(ServedModel{m.name, m.adapters, impl->extra_texts.back().get(),
                                       m.max_model_len, m.namespace_id});
  }
  if (!o.api_keys_file.empty()) {
    auto keys = KeyFile::Open(o.api_keys_file, o.key_tokens_per_minute, o.api_keys_reload_ms);
    if (!keys.ok()) return keys.status();
    impl->keys = std::move(*keys);
  }
  impl->admission =
      std::make_shared<Admission>(o.max_concurrent_requests, o.queue_size, o.queue_timeout_ms);
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
  if (!ec && o.reuse_port) {
    // Another frontend may listen on the same address (a rolling restart).
    const int one = 1;
    if (::setsockopt(impl->acceptor->native_handle(), SOL_SOCKET, SO_REUSEPORT, &one,
                     sizeof(one)) != 0) {
      ec = ErrorCode(errno, boost::system::system_category());
    }
  }
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
                                       &raw->models);
  raw->relay = std::make_unique<Relay>(o, *raw->fleet, *raw->load, o.threads);
  if (o.session_ttl_ms > 0) raw->sessions.emplace(static_cast<int64_t>(o.session_ttl_ms));
  raw->prefiller = std::make_unique<Prefiller>(raw->router->core(), *raw->fleet, *raw->load,
                                               raw->counters, *raw->relay);
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
      " requests in flight and ", impl->connections.load(), " connections get up to ", grace_ms,
      " ms");
  // Each connection ends after its next answer (sent with Connection:
  // close), so a busy keep-alive client's next request is answered, never
  // met by a close: once no request is in flight the drain still waits up
  // to kIdleLinger for the connections to end; those idle past it are
  // closed with no request on them.
  constexpr auto kIdleLinger = std::chrono::seconds(2);
  const auto until = Clock::now() + std::chrono::milliseconds(grace_ms);
  std::optional<Clock::time_point> idle_since;
  for (auto now = Clock::now(); now < until; now = Clock::now()) {
    if (impl->requests_in_flight.load() > 0) {
      idle_since.reset();
    } else {
      if (impl->connections.load() == 0) break;
      if (!idle_since) idle_since = now;
      if (now - *idle_since >= kIdleLinger) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t left = impl->requests_in_flight.load();
  Log("frontend", left == 0 ? absl::StrCat("drained: every request in flight ended (",
                                           impl->connections.load(), " idle connections closed)")
                            : absl::StrCat("drain timed out: ", left, " requests are cut"));
  return left == 0;
}

Frontend::~Frontend() {
  impl_->metrics_server.reset();  // its scrapes read what follows
  impl_->deletion_costs.reset();
  for (auto& loop : impl_->loops) loop->stop();
  for (auto& t : impl_->threads) t.join();
  // Turns held by frames destroyed with the loops wake nobody.
  impl_->admission->Close();
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
