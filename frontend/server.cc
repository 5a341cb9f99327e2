// <utility> before Asio: Boost 1.74's awaitable.hpp uses std::exchange
// without including it.
#include <utility>
// clang-format off
#include "frontend/server.h"
// clang-format on

#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <cerrno>
#include <chrono>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/limits.h"
#include "common/log.h"
#include "router/embedded_router.h"
#include "router/vllm_events.h"

namespace kvtier::frontend {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using ErrorCode = boost::system::error_code;
// Every socket, timer and coroutine runs on one thread's io_context, named
// by its concrete executor type: no strands and no type-erased executor on
// the request path (they were a fifth of the frontend's CPU per request).
using Executor = net::io_context::executor_type;
template <typename T = void>
using Task = net::awaitable<T, Executor>;
using Stream = beast::basic_stream<tcp, Executor>;
using Socket = net::basic_stream_socket<tcp, Executor>;
using Timer = net::basic_waitable_timer<Clock, net::wait_traits<Clock>, Executor>;
using Resolver = net::ip::basic_resolver<tcp, Executor>;
using Acceptor = net::basic_socket_acceptor<tcp, Executor>;
constexpr net::use_awaitable_t<Executor> kAwait;

// The io_context (by index) this thread runs: a pooled upstream connection
// is reused only by the thread whose reactor it is registered with.
thread_local size_t t_loop = 0;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

const char* ReasonName(router::Reason r) {
  switch (r) {
    case router::Reason::kLowestCost:
      return "lowest_cost";
    case router::Reason::kTieBreak:
      return "tie_break";
    case router::Reason::kBalanceGuard:
      return "balance_guard";
    case router::Reason::kSampled:
      return "sampled";
  }
  return "unknown";
}

// One engine of the fleet: where it answers, what the frontend sends it,
// whether it is up, and its idle keep-alive connections.
struct Engine {
  router::VllmSourceSpec spec;
  std::string host, port;
  int dns_pool = -1;  // index in options.dns; -1: a static engine
  std::atomic<int64_t> in_flight{0};
  // Requests sent there and not answered yet (for a stream: no first event
  // yet), and the prompt tokens the router expected it to compute for
  // them (its prefill queue, as this frontend sees it).
  std::atomic<int64_t> waiting_tokens{0}, waiting_requests{0};
  // The prompt tokens of the requests it answered and is still decoding.
  std::atomic<int64_t> decoding_tokens{0};
  std::atomic<bool> healthy{true};
  int health_failures = 0;           // in a row; only its health loop touches it
  std::atomic<bool> removed{false};  // left the fleet (DNS): its loops end
  std::atomic<int64_t> down_until_ms{0};
  std::atomic<uint64_t> requests{0}, failures{0};
  std::atomic<uint64_t> health_checks{0};  // ended, answered or not
  std::mutex mu;
  struct Idle {
    std::shared_ptr<Stream> stream;
    Clock::time_point since;
  };
  // Per thread (t_loop), newest last; guarded by mu.
  std::vector<std::vector<Idle>> idle;
  std::unique_ptr<router::VllmEventSource> events;  // guarded by mu
  VllmLoad vllm;                                    // guarded by mu: its /metrics, last scraped
  // Requests vLLM said wait there beyond this frontend's own, when scraped:
  // other frontends' (guarded by mu).
  double foreign_waiting = 0;
  int64_t last_push_us = 0;  // guarded by mu: when the router was last told its load

  bool Usable(int64_t now) const { return healthy.load() && down_until_ms.load() <= now; }
};

// What the frontend counts, for /metrics.
struct Counters {
  std::mutex mu;
  std::map<std::pair<std::string, int>, uint64_t> requests;        // (endpoint, status)
  std::map<std::pair<std::string, std::string>, uint64_t> routes;  // (engine, reason)
  std::atomic<uint64_t> failovers{0}, client_disconnects{0}, no_engine{0};
  std::map<std::string, uint64_t> handoffs;  // prefill/decode, by outcome
  std::map<std::pair<std::string, std::string>, uint64_t> resolutions;  // (name, outcome)
  std::atomic<uint64_t> added_us_sum{0}, added_count{0};
  // The added latency (request read to engine chosen) by bucket, in µs.
  static constexpr uint64_t kAddedBoundsUs[] = {25,   50,   100,   250,   500,   1000,
                                                2500, 5000, 10000, 25000, 100000};
  std::atomic<uint64_t> added_buckets[std::size(kAddedBoundsUs) + 1] = {};

  void Added(uint64_t us) {
    added_us_sum += us;
    added_count++;
    size_t i = 0;
    while (i < std::size(kAddedBoundsUs) && us > kAddedBoundsUs[i]) ++i;
    added_buckets[i]++;
  }

  void Request(const std::string& endpoint, int status) {
    std::lock_guard lk(mu);
    requests[{endpoint, status}]++;
  }
  void Route(const std::string& engine, const std::string& reason) {
    std::lock_guard lk(mu);
    routes[{engine, reason}]++;
  }
  void Handoff(const std::string& outcome) {
    std::lock_guard lk(mu);
    handoffs[outcome]++;
  }
  void Resolution(const std::string& name, bool ok) {
    std::lock_guard lk(mu);
    resolutions[{name, ok ? "ok" : "failed"}]++;
  }
};

// Which engines a choice is among: those that decode (every request's
// answer comes from one) or the prefill engines.
enum class Want { kDecode, kPrefill };
bool Serves(const router::VllmSourceSpec& spec, Want want) {
  return want == Want::kPrefill ? spec.role == router::EngineRole::kPrefill
                                : spec.role != router::EngineRole::kPrefill;
}

// How one try at an engine ended.
enum class Tried { kDone, kRetry, kClientGone };

}  // namespace

// The engines serving now: a snapshot, replaced whole when one joins or
// leaves; a request holds the engines it uses.
struct Fleet {
  std::vector<std::shared_ptr<Engine>> engines;
};

struct Frontend::Impl {
  FrontendOptions options;
  // One io_context per thread; connections are dealt round-robin. Declared
  // first of what uses them: the engines' pooled connections (in `fleet`)
  // are destroyed before their io_contexts.
  std::vector<std::unique_ptr<net::io_context>> loops;
  // Each loop runs until stopped, whether or not it has connections yet.
  std::vector<net::executor_work_guard<Executor>> keep_running;
  std::unique_ptr<TextModel> text;
  std::unique_ptr<router::EmbeddedRouter> router;
  std::unique_ptr<DeletionCostUpdater> deletion_costs;  // --deletion-cost-selector
  uint64_t namespace_id = 0;
  std::mutex fleet_mu;
  std::shared_ptr<const Fleet> fleet = std::make_shared<Fleet>();  // guarded by fleet_mu
  // The tokens routes expected engines to compute, over the requests routed:
  // the price of a request another frontend queued.
  std::atomic<uint64_t> uncached_tokens_seen{0}, prompts_seen{0};
  // A handoff's kv_request_id: this frontend's random prefix and a count.
  const std::string handoff_prefix = absl::StrCat(absl::Hex(
      (uint64_t{std::random_device{}()} << 32) | std::random_device{}(), absl::kZeroPad16));
  std::atomic<uint64_t> handoff_ids{0};
  Counters counters;
  std::optional<Acceptor> acceptor;
  size_t next_loop = 0;
  std::vector<std::thread> threads;
  uint64_t started_unix = 0;
  int port = 0;

  // --- choosing an engine ---------------------------------------------

  std::shared_ptr<const Fleet> Snapshot() {
    std::lock_guard lk(fleet_mu);
    return fleet;
  }

  struct Choice {
    std::shared_ptr<Engine> engine;
    std::string explain;
    uint64_t uncached = 0;  // prompt tokens the engine would compute (router's estimate)
  };

  bool HasPrefillEngines() {
    const std::shared_ptr<const Fleet> f = Snapshot();
    return std::any_of(f->engines.begin(), f->engines.end(),
                       [](const auto& e) { return Serves(e->spec, Want::kPrefill); });
  }

  Choice Choose(const Prepared& p, const std::set<Engine*>& tried, Want want = Want::kDecode) {
    const int64_t now = NowMs();
    const std::shared_ptr<const Fleet> f = Snapshot();
    Choice c;
    router::RouteQuery q;
    q.namespace_id = namespace_id;
    q.prompt = router::RouteQuery::Prompt::kTokens;
    q.tokens = p.tokens;
    q.max_candidates = static_cast<uint32_t>(std::max<size_t>(1, f->engines.size()));
    // The router chooses among the engines this request can be sent to: the
    // route's load and pending blocks go where the request goes.
    std::vector<std::string> exclude;
    for (const auto& e : f->engines) {
      if (tried.count(e.get()) || !e->Usable(now) || !Serves(e->spec, want)) {
        exclude.push_back(e->spec.id);
      }
    }
    q.exclude = exclude;
    auto routed = router->Route(q);
    auto find = [&](const std::string& id) -> std::shared_ptr<Engine> {
      for (const auto& e : f->engines) {
        if (e->spec.id == id) return e;
      }
      return nullptr;
    };
    if (routed.ok()) {
      // The router's choice first: the route, its load and its pending
      // blocks are counted on that worker.
      for (const router::RouteCandidate* cp : routed->ChosenFirst()) {
        const router::RouteCandidate& cand = *cp;
        std::shared_ptr<Engine> e = find(cand.worker_id);
        if (e == nullptr || tried.count(e.get()) || !e->Usable(now) || !Serves(e->spec, want)) {
          continue;
        }
        const bool first = cand.worker_id == routed->worker_id;
        const std::string reason = first ? ReasonName(routed->reason) : "failover";
        c.engine = std::move(e);
        c.explain =
            absl::StrCat("engine=", cand.worker_id, "; gpu_blocks=", cand.gpu_blocks,
                         "; store_blocks=", cand.store_blocks, "; load_tokens=", cand.load_tokens,
                         "; cost=", cand.cost, "; reason=", reason);
        c.uncached = cand.prefill_tokens;
        counters.Route(cand.worker_id, reason);
        return c;
      }
    }
    // No route (no engine has said hello yet, or every candidate is down or
    // tried): the usable engine with the fewest requests in flight.
    c.uncached = p.prompt_tokens;
    for (const auto& e : f->engines) {
      if (tried.count(e.get()) || !e->Usable(now) || !Serves(e->spec, want)) continue;
      if (c.engine == nullptr || e->in_flight.load() < c.engine->in_flight.load()) {
        c.engine = e;
      }
    }
    // None usable: an engine whose health check fails (slow, or gone) but
    // which failed no request lately is still worth a try before a 503.
    bool unhealthy = false;
    if (c.engine == nullptr) {
      for (const auto& e : f->engines) {
        if (tried.count(e.get()) || e->down_until_ms.load() > now || !Serves(e->spec, want)) {
          continue;
        }
        if (c.engine == nullptr || e->in_flight.load() < c.engine->in_flight.load()) {
          c.engine = e;
          unhealthy = true;
        }
      }
    }
    if (c.engine != nullptr) {
      const std::string why = unhealthy     ? "unhealthy_fallback"
                              : routed.ok() ? "least_loaded_fallback"
                                            : "no_route";
      c.explain =
          absl::StrCat("engine=", c.engine->spec.id, "; gpu_blocks=0; store_blocks=0",
                       "; in_flight=", c.engine->in_flight.load(), "; reason=", why,
                       routed.ok() ? "" : absl::StrCat(" (", routed.status().message(), ")"));
      counters.Route(c.engine->spec.id, why);
    }
    return c;
  }

  // Tells the router what this frontend knows of an engine's load: the
  // tokens it expects the engine to compute for the requests it sent there
  // and has no answer to yet, and (for other frontends' requests) what
  // vLLM says waits beyond those, priced at the mean of those tokens here;
  // the prompt tokens of the requests it is decoding, at decode_weight
  // (each is a sequence every step of the next prefill shares: with no
  // prefix to match, this is what spreads streams as least-connections
  // would); vLLM's running requests; its free KV pages.
  // Told at once when `now` or none was told for kPushEvery (a burst of
  // answers is one update: each costs the router's write lock), else with
  // the next update or the engine's heartbeat (each second). The router
  // counts what it routed until the engine's next update, which holds it.
  static constexpr int64_t kPushEveryUs = 2000;
  void PushLoad(Engine& e, bool now) {
    router::SourceLoad load;
    const int64_t in_flight = std::max<int64_t>(0, e.in_flight.load());
    const uint64_t prompts = prompts_seen.load();
    const double mean_uncached =
        prompts > 0 ? static_cast<double>(uncached_tokens_seen.load()) / prompts : 0;
    std::lock_guard lk(e.mu);
    if (!e.events) return;
    const int64_t waiting = std::max<int64_t>(0, e.waiting_tokens.load());
    const int64_t decoding = std::max<int64_t>(0, e.decoding_tokens.load());
    load.queued_prefill_tokens =
        static_cast<uint64_t>(waiting) + static_cast<uint64_t>(e.foreign_waiting * mean_uncached) +
        static_cast<uint64_t>(options.decode_weight * static_cast<double>(decoding));
    load.running_requests =
        static_cast<uint32_t>(std::max<double>(e.vllm.running, static_cast<double>(in_flight)));
    if (e.vllm.kv_usage >= 0 && e.vllm.gpu_blocks > 0) {
      load.free_gpu_pages =
          static_cast<uint64_t>((1.0 - e.vllm.kv_usage) * static_cast<double>(e.vllm.gpu_blocks));
    }
    const int64_t t =
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch())
            .count();
    const bool tell = now || t - e.last_push_us >= kPushEveryUs;
    if (tell) e.last_push_us = t;
    e.events->SetLoad(load, tell);
  }

  // --- the fleet ----------------------------------------------------------

  void AddEngine(const router::VllmSourceSpec& spec, int dns_pool) {
    auto e = std::make_shared<Engine>();
    e->spec = spec;
    e->dns_pool = dns_pool;
    const size_t colon = spec.endpoint.rfind(':');
    e->host = spec.endpoint.substr(0, colon);
    e->port = spec.endpoint.substr(colon + 1);
    if (!spec.events.empty()) {
      e->events = std::make_unique<router::VllmEventSource>(spec, &router->core());
    }
    {
      std::lock_guard lk(fleet_mu);
      auto next = std::make_shared<Fleet>(*fleet);
      next->engines.push_back(e);
      fleet = std::move(next);
    }
    if (dns_pool >= 0) {
      Log("frontend", "engine ", spec.id, " joined the fleet (DNS ",
          options.dns[static_cast<size_t>(dns_pool)].spec.endpoint, ", role ",
          router::EngineRoleName(spec.role), ")");
    }
    net::co_spawn(loops[0]->get_executor(), HealthLoop(e), net::detached);
  }

  // The engine leaves routing and the index now; requests it serves finish.
  void RemoveEngine(const std::shared_ptr<Engine>& e, const std::string& why) {
    {
      std::lock_guard lk(fleet_mu);
      auto next = std::make_shared<Fleet>();
      for (const auto& other : fleet->engines) {
        if (other != e) next->engines.push_back(other);
      }
      fleet = std::move(next);
    }
    std::unique_ptr<router::VllmEventSource> events;
    {
      std::lock_guard lk(e->mu);
      e->removed = true;
      events = std::move(e->events);
      e->idle.clear();
    }
    events.reset();  // its thread ends: no event or heartbeat after this
    const bool indexed = router->core().RemoveSource(e->spec.id);
    Log("frontend", "engine ", e->spec.id, " left the fleet (", why, ")",
        indexed ? "; its blocks left the index" : "");
  }

  // One resolution of pool `index`'s name: its engines join and leave to
  // match it. An address already in the fleet (another pool's, or a static
  // engine) is not added twice.
  void SyncDns(size_t index, const std::set<std::string>& addresses, const std::string& port) {
    const FrontendOptions::DnsPool& pool = options.dns[index];
    const std::shared_ptr<const Fleet> f = Snapshot();
    std::set<std::string> have;
    for (const auto& e : f->engines) {
      if (e->dns_pool == static_cast<int>(index) && addresses.count(e->host) == 0) {
        RemoveEngine(e, absl::StrCat("gone from DNS ", pool.spec.endpoint));
      } else {
        have.insert(e->spec.id);
      }
    }
    for (const std::string& a : addresses) {
      router::VllmSourceSpec spec = pool.spec;
      spec.id = absl::StrCat(a, ":", port);
      spec.endpoint = spec.id;
      if (have.count(spec.id)) continue;
      spec.events = pool.events_port == 0 ? "" : absl::StrCat("tcp://", a, ":", pool.events_port);
      spec.replay = pool.replay_port == 0 ? "" : absl::StrCat("tcp://", a, ":", pool.replay_port);
      AddEngine(spec, static_cast<int>(index));
    }
  }

  Task<> DnsLoop(size_t index) {
    auto exec = co_await net::this_coro::executor;
    Timer timer(exec);
    Resolver resolver(exec);
    const std::string& name = options.dns[index].spec.endpoint;
    const size_t colon = name.rfind(':');
    const std::string host = name.substr(0, colon);
    const std::string port = name.substr(colon + 1);
    bool failing = false;
    for (;;) {
      ErrorCode ec;
      auto results =
          co_await resolver.async_resolve(tcp::v4(), host, port, net::redirect_error(kAwait, ec));
      if (ec) {
        if (!failing) {
          Log("frontend", "cannot resolve ", host, " (", ec.message(),
              "); the fleet stays as it is until it resolves");
        }
        failing = true;
        counters.Resolution(name, false);
      } else {
        failing = false;
        counters.Resolution(name, true);
        std::set<std::string> addresses;
        for (const auto& r : results) addresses.insert(r.endpoint().address().to_string());
        SyncDns(index, addresses, port);
      }
      timer.expires_after(std::chrono::milliseconds(options.dns_interval_ms));
      co_await timer.async_wait(net::redirect_error(kAwait, ec));
      if (ec) co_return;
    }
  }

  void MarkDown(Engine& e, const std::string& why) {
    e.failures++;
    e.down_until_ms = NowMs() + static_cast<int64_t>(options.down_ms);
    Log("frontend", "engine ", e.spec.id, " (", e.spec.endpoint, ") skipped for ", options.down_ms,
        " ms: ", why);
  }

  // --- upstream connections -------------------------------------------

  Task<std::unique_ptr<Stream>> Connect(Engine& e, ErrorCode& ec) {
    auto exec = co_await net::this_coro::executor;
    Resolver resolver(exec);
    auto results = co_await resolver.async_resolve(e.host, e.port, net::redirect_error(kAwait, ec));
    if (ec) co_return nullptr;
    auto s = std::make_unique<Stream>(exec);
    s->expires_after(std::chrono::milliseconds(options.connect_timeout_ms));
    co_await s->async_connect(results, net::redirect_error(kAwait, ec));
    if (ec) co_return nullptr;
    s->socket().set_option(tcp::no_delay(true));
    co_return s;
  }

  // An idle connection older than this is dropped, not reused: uvicorn
  // (vLLM's server) closes keep-alive connections idle for 5 s, and a
  // request sent on one it is closing fails and must be sent again.
  static constexpr auto kPoolIdle = std::chrono::seconds(4);

  std::shared_ptr<Stream> Pooled(Engine& e) {
    std::lock_guard lk(e.mu);
    if (e.idle.size() <= t_loop) return nullptr;
    std::vector<Engine::Idle>& idle = e.idle[t_loop];
    const auto now = Clock::now();
    // The newest are last; everything before an expired one is older still.
    for (size_t i = idle.size(); i > 0; --i) {
      if (now - idle[i - 1].since > kPoolIdle) {
        idle.erase(idle.begin(), idle.begin() + static_cast<long>(i));
        break;
      }
    }
    if (idle.empty()) return nullptr;
    auto s = std::move(idle.back().stream);
    idle.pop_back();
    return s;
  }

  // Each thread keeps its share of the engine's idle connections.
  void ReturnToPool(Engine& e, std::shared_ptr<Stream> s) {
    std::lock_guard lk(e.mu);
    if (e.idle.size() <= t_loop) e.idle.resize(t_loop + 1);
    std::vector<Engine::Idle>& idle = e.idle[t_loop];
    const size_t share = std::max<size_t>(1, options.idle_per_engine / loops.size());
    if (idle.size() < share) idle.push_back({std::move(s), Clock::now()});
  }

  // --- one try at an engine -------------------------------------------

  // Watches the client's socket while the engine works: a peer that closed
  // (readable with nothing to read) closes the upstream connection, which
  // cancels what waits on it and tells vLLM to abort the request. Runs on
  // the client's thread, as the exchange does; a plain handler, not a
  // coroutine (one per request).
  struct Watch {
    std::weak_ptr<Stream> upstream;  // the connection in use now
    bool gone = false;
    bool done = false;  // the try ended: a late wake-up touches nothing
  };
  enum class Peeked { kThere, kQuiet, kGone };
  // Whether the client is gone now, without waiting: only an end of
  // stream, or an error, is a client gone; bytes are its next request.
  static Peeked Peek(Stream* client) {
    char byte;
    const ssize_t n = ::recv(client->socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return Peeked::kThere;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Peeked::kQuiet;
    return Peeked::kGone;
  }
  static void WatchClient(Stream* client, std::shared_ptr<Watch> watch) {
    // Asio's reactor is edge-triggered and a wait is never tried at once:
    // a client that closed before this wait began (while its request was
    // read or routed) raises no new edge, so it is looked for first.
    switch (Peek(client)) {
      case Peeked::kThere:
        return;  // its next request: it is still there
      case Peeked::kGone:
        watch->gone = true;
        return;
      case Peeked::kQuiet:
        break;
    }
    client->socket().async_wait(tcp::socket::wait_read, [client, watch](const ErrorCode& ec) {
      if (ec || watch->done) return;  // cancelled: the exchange ended first
      // Readiness can be stale (the epoll edge of bytes the request's read
      // already took): Peek tells.
      switch (Peek(client)) {
        case Peeked::kThere:
          return;
        case Peeked::kQuiet:
          WatchClient(client, watch);
          return;
        case Peeked::kGone:
          break;
      }
      watch->gone = true;
      ErrorCode ignored;
      if (auto up = watch->upstream.lock()) up->socket().close(ignored);
    });
  }

  // The client's answer header: the engine's status (set by the caller),
  // content type and cache control, and the route's explanation.
  template <class Body, class Upstream>
  static void AnswerHeader(http::response<Body>& res, const Upstream& upstream,
                           const std::string& explain, bool keep_alive) {
    res.set(http::field::server, "kvtier-frontend");
    for (auto field : {http::field::content_type, http::field::cache_control}) {
      auto it = upstream.find(field);
      if (it != upstream.end()) res.set(field, it->value());
    }
    res.set("x-kvtier-route", explain);
    res.keep_alive(keep_alive);
  }

  // Unstreamed answers up to this size are forwarded whole, in one write.
  static constexpr uint64_t kWholeAnswerBytes = 4 << 20;
  // Longest event held back for its end (an event stream forwards whole
  // events; vLLM's are a few hundred bytes, more with logprobs).
  static constexpr size_t kMaxEventBytes = 1 << 20;

  // One request sent to an engine, as its load: until the engine answers,
  // the prompt tokens the route expected it to compute wait in its prefill
  // queue (a prefix hit waits as its uncached tail, not its whole prompt:
  // the engine's own prefill work); once answered, the whole prompt is a
  // sequence it decodes.
  struct Ticket {
    int64_t prompt_tokens = 0;
    int64_t uncached = 0;
    bool answered = false;
  };
  // The load it tells from here holds the request: the router counted its
  // route only until then (the load the engine's source repeats each
  // second is this one, not one from before it was sent).
  Ticket Charge(Engine& e, const Prepared& p, uint64_t uncached) {
    Ticket t{static_cast<int64_t>(p.prompt_tokens),
             static_cast<int64_t>(std::min<uint64_t>(uncached, p.prompt_tokens)), false};
    e.requests++;
    e.in_flight++;
    e.waiting_tokens += t.uncached;
    e.waiting_requests++;
    PushLoad(e, false);
    return t;
  }
  // Its answer began: its prefill is done, it decodes.
  void Answered(Engine& e, Ticket* t) {
    if (t->answered) return;
    t->answered = true;
    e.waiting_tokens -= t->uncached;
    e.waiting_requests--;
    e.decoding_tokens += t->prompt_tokens;
    PushLoad(e, false);
  }
  // Its exchange with the engine ended, answered or not.
  void Finish(Engine& e, Ticket* t) {
    e.in_flight--;
    if (!t->answered) {
      e.waiting_tokens -= t->uncached;
      e.waiting_requests--;
    } else {
      e.decoding_tokens -= t->prompt_tokens;
      if (options.decode_weight <= 0) return;  // no load the router sees changed
    }
    PushLoad(e, false);
  }

  // The client is watched from the first byte sent upstream: one that
  // leaves while the engine computes (before its answer starts) cancels
  // the request too. The watcher ends with the try.
  Task<Tried> Forward(Engine& e, const Prepared& p, const std::string& explain, Stream& client,
                      bool keep_alive, bool* client_keep, Ticket* ticket) {
    auto watch = std::make_shared<Watch>();
    WatchClient(&client, watch);
    const Tried t =
        co_await ForwardWatched(e, p, explain, client, keep_alive, client_keep, ticket, watch);
    watch->done = true;
    ErrorCode ignored;
    client.socket().cancel(ignored);
    co_return t;
  }

  static http::request<http::string_body> EngineRequest(const Engine& e, const std::string& path,
                                                        const std::string& body) {
    http::request<http::string_body> req{http::verb::post, path, 11};
    req.set(http::field::host, e.spec.endpoint);
    req.set(http::field::content_type, "application/json");
    req.set(http::field::user_agent, "kvtier-frontend");
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();
    return req;
  }

  // Sends `req` to the engine on a pooled connection and reads its
  // answer's header (`whole`: the whole answer) into `parser`, `up` the
  // connection it came on. A pooled connection the engine closed while
  // idle fails at once: one fresh connection is tried before the engine
  // is blamed (skipped for --down, `what` naming the exchange in the log).
  enum class Sent { kOk, kFailed, kClientGone };
  template <class Body>
  Task<Sent> Send(Engine& e, const http::request<http::string_body>& req, bool whole,
                  uint64_t body_limit, beast::flat_buffer& ubuf,
                  std::optional<http::response_parser<Body>>& parser, std::shared_ptr<Stream>& up,
                  Watch& watch, const char* what) {
    ErrorCode ec;
    for (int fresh = 0; fresh < 2; ++fresh) {
      if (watch.gone) co_return Sent::kClientGone;  // before a connection is taken
      parser.emplace();
      parser->body_limit(body_limit);
      ubuf.clear();
      auto pooled = fresh == 0 ? Pooled(e) : nullptr;
      const bool reused = pooled != nullptr;
      if (reused) {
        up = std::move(pooled);
      } else {
        auto made = co_await Connect(e, ec);
        if (!made) {
          MarkDown(e, absl::StrCat("connect: ", ec.message()));
          co_return Sent::kFailed;
        }
        up = std::move(made);
      }
      watch.upstream = up;
      if (watch.gone) co_return Sent::kClientGone;
      up->expires_after(std::chrono::milliseconds(options.upstream_timeout_ms));
      co_await http::async_write(*up, req, net::redirect_error(kAwait, ec));
      if (!ec && whole) {
        co_await http::async_read(*up, ubuf, *parser, net::redirect_error(kAwait, ec));
      } else if (!ec) {
        co_await http::async_read_header(*up, ubuf, *parser, net::redirect_error(kAwait, ec));
      }
      if (watch.gone) co_return Sent::kClientGone;
      if (!ec) co_return Sent::kOk;
      if (reused) continue;
      MarkDown(e, absl::StrCat(what, ": ", ec.message()));
      co_return Sent::kFailed;
    }
    co_return Sent::kFailed;
  }

  Task<Tried> ForwardWatched(Engine& e, const Prepared& p, const std::string& explain,
                             Stream& client, bool keep_alive, bool* client_keep, Ticket* ticket,
                             std::shared_ptr<Watch> watch) {
    ErrorCode ec;
    std::shared_ptr<Stream> up;
    const http::request<http::string_body> req = EngineRequest(e, p.path, p.body);
    beast::flat_buffer ubuf;
    std::optional<http::response_parser<http::buffer_body>> parser;
    const uint64_t unlimited = std::numeric_limits<std::uint64_t>::max();
    const Sent sent = co_await Send(e, req, false, unlimited, ubuf, parser, up, *watch, "request");
    if (sent == Sent::kClientGone) co_return Tried::kClientGone;
    if (sent == Sent::kFailed) co_return Tried::kRetry;
    const unsigned status = parser->get().result_int();
    if (status >= 500) {
      MarkDown(e, absl::StrCat("answered ", status));
      co_return Tried::kRetry;  // the connection is dropped with `up`
    }
    // An SSE event is a few hundred bytes: 4 KiB holds many, and a held
    // stream costs its coroutine frame, this buffer included.
    char chunk[4096];
    // A whole answer of known length (vLLM's unstreamed responses; not an
    // event stream) is read first and goes to the client in one write: one
    // send, as it came.
    const auto length = parser->content_length();
    const auto type = parser->get().find(http::field::content_type);
    const bool events =
        type != parser->get().end() && type->value().starts_with("text/event-stream");
    if (!parser->chunked() && !events && length && *length <= kWholeAnswerBytes) {
      Answered(e, ticket);  // a whole answer comes once the engine is done
      std::string body;
      body.reserve(*length);
      ErrorCode rec;
      while (!parser->is_done() && !rec) {
        parser->get().body().data = chunk;
        parser->get().body().size = sizeof(chunk);
        up->expires_after(std::chrono::milliseconds(options.upstream_timeout_ms));
        co_await http::async_read_some(*up, ubuf, *parser, net::redirect_error(kAwait, rec));
        if (rec == http::error::need_buffer) rec = {};
        body.append(chunk, sizeof(chunk) - parser->get().body().size);
      }
      if (watch->gone) co_return Tried::kClientGone;
      if (!parser->is_done()) {  // nothing reached the client: another engine may answer
        MarkDown(e, absl::StrCat("answer cut short: ", rec.message()));
        co_return Tried::kRetry;
      }
      http::response<http::string_body> res{static_cast<http::status>(status), 11};
      AnswerHeader(res, parser->get(), explain, keep_alive);
      res.body() = std::move(body);
      res.prepare_payload();
      client.expires_after(std::chrono::milliseconds(options.client_timeout_ms));
      co_await http::async_write(client, res, net::redirect_error(kAwait, ec));
      client.expires_never();
      if (ec) {
        counters.client_disconnects++;
        *client_keep = false;
        co_return Tried::kClientGone;
      }
      if (!watch->gone && parser->get().keep_alive()) {
        up->expires_never();
        ReturnToPool(e, std::move(up));
      }
      co_return Tried::kDone;
    }
    // A stream: from here the client has bytes, chunk by chunk as the engine
    // writes them; no other engine is tried.
    http::response<http::empty_body> res{static_cast<http::status>(status), 11};
    AnswerHeader(res, parser->get(), explain, keep_alive);
    res.chunked(true);
    http::response_serializer<http::empty_body> sr{res};
    co_await http::async_write_header(client, sr, net::redirect_error(kAwait, ec));
    Tried outcome = Tried::kDone;
    // An event stream goes to the client in whole events. A read of the
    // engine's backlog (a stream the frontend fell behind on) can end
    // mid-event, and a client that parses each read on its own misreads
    // the event cut in two: vLLM's own `vllm bench serve` strips every
    // read, so "data:" at a read's end and " {...}" at the next one's start
    // become "data:{...}", which it fails to parse. What follows the last
    // event's end waits here for the rest of its event (never a whole
    // event; all of it past kMaxEventBytes, or at the stream's end).
    std::string carry;
    while (!ec && !parser->is_done()) {
      parser->get().body().data = chunk;
      parser->get().body().size = sizeof(chunk);
      up->expires_after(std::chrono::milliseconds(options.upstream_timeout_ms));
      ErrorCode rec;
      co_await http::async_read_some(*up, ubuf, *parser, net::redirect_error(kAwait, rec));
      if (rec == http::error::need_buffer) rec = {};
      std::string_view got(chunk, sizeof(chunk) - parser->get().body().size);
      size_t from_carry = 0;  // the head of carry that `got` is, sent below
      if (events && (!carry.empty() || SseEventsEnd(got) != got.size())) {
        carry.append(got);
        from_carry = SseEventsEnd(carry);
        if (rec || parser->is_done() || carry.size() > kMaxEventBytes) from_carry = carry.size();
        got = std::string_view(carry).substr(0, from_carry);
      }
      if (!got.empty()) {
        // vLLM sends a stream's header at once, its first event with the
        // first token: until then the prompt waits in its prefill queue (a
        // keep-alive comment, --sse-keep-alive-interval, is no answer).
        if (!ticket->answered && (!events || got.find("data:") != std::string_view::npos)) {
          Answered(e, ticket);
        }
        // A client that stops reading is cut after the client timeout,
        // freeing the engine's connection.
        client.expires_after(std::chrono::milliseconds(options.client_timeout_ms));
        auto piece = http::make_chunk(net::buffer(got.data(), got.size()));
        co_await net::async_write(client, piece, net::redirect_error(kAwait, ec));
      }
      carry.erase(0, from_carry);
      if (rec && !ec) {
        // The client left (the watcher closed the engine's connection: an
        // SSE client may close once it read [DONE]), or the engine failed
        // mid-response: then the client's stream ends short (no last
        // chunk), which it sees as an error, not as a whole answer.
        if (!watch->gone) {
          Log("frontend", "engine ", e.spec.id, " failed mid-response: ", rec.message());
          e.failures++;
        }
        *client_keep = false;
        outcome = watch->gone ? Tried::kClientGone : Tried::kDone;
        break;
      }
    }
    ErrorCode ignored;
    if (ec || watch->gone) {
      counters.client_disconnects++;
      *client_keep = false;
      up->socket().close(ignored);
      co_return Tried::kClientGone;
    }
    if (outcome != Tried::kDone || !parser->is_done()) {
      *client_keep = false;
      co_return outcome;
    }
    auto last = http::make_chunk_last();
    co_await net::async_write(client, last, net::redirect_error(kAwait, ec));
    client.expires_never();
    if (ec) *client_keep = false;
    if (parser->get().keep_alive()) {
      up->expires_never();
      ReturnToPool(e, std::move(up));
    }
    co_return Tried::kDone;
  }

  // --- prefill/decode ----------------------------------------------------

  // One whole unstreamed exchange with an engine (a prefill): the status
  // (0: no answer: the engine is skipped for --down, as is one answering
  // 5xx) and the answer's body in `out`. The client is watched meanwhile.
  Task<unsigned> Exchange(Engine& e, const std::string& path, const std::string& body,
                          std::string* out, std::shared_ptr<Watch> watch) {
    std::shared_ptr<Stream> up;
    const http::request<http::string_body> req = EngineRequest(e, path, body);
    beast::flat_buffer ubuf;
    std::optional<http::response_parser<http::string_body>> parser;
    const uint64_t limit = kWholeAnswerBytes;
    const Sent sent = co_await Send(e, req, true, limit, ubuf, parser, up, *watch, "prefill");
    if (sent != Sent::kOk) co_return 0u;
    const unsigned status = parser->get().result_int();
    *out = std::move(parser->get().body());
    if (status >= 500) {
      MarkDown(e, absl::StrCat("prefill answered ", status));
    } else if (parser->get().keep_alive()) {
      up->expires_never();
      ReturnToPool(e, std::move(up));
    }
    co_return status;
  }

  // The prompt computed on a prefill engine (chosen by prefix, in GPU and
  // store, and queue) for a decode engine: the decode's kv_transfer_params,
  // or nullopt when no prefill engine could do it (then the decode engine
  // computes the prompt itself: a failed handoff costs time, never a
  // request). `*note` explains it for the route header; `*client_gone`:
  // the client left meanwhile (the prefill was cancelled with it).
  Task<std::optional<nlohmann::json>> Prefill(const Prepared& p, Stream& client, std::string* note,
                                              bool* client_gone) {
    const std::set<Engine*> none;
    Choice c = Choose(p, none, Want::kPrefill);
    if (c.engine == nullptr) {
      counters.Handoff("no_prefill_engine");
      *note = "; prefill=none";
      co_return std::nullopt;
    }
    const std::shared_ptr<Engine> held = c.engine;
    Engine& e = *held;
    Ticket ticket = Charge(e, p, c.uncached);
    auto watch = std::make_shared<Watch>();
    WatchClient(&client, watch);
    std::string answer;
    const std::string kv_request_id =
        absl::StrCat("kvtier-", handoff_prefix, "-", handoff_ids.fetch_add(1) + 1);
    const std::string body = PrefillBody(p, kv_request_id);
    const unsigned status = co_await Exchange(e, p.path, body, &answer, watch);
    watch->done = true;
    ErrorCode ignored;
    client.socket().cancel(ignored);
    Finish(e, &ticket);
    if (watch->gone) {
      *client_gone = true;
      counters.Handoff("client_gone");
      co_return std::nullopt;
    }
    std::optional<nlohmann::json> params;
    Handoff handoff;
    if (status == 200) handoff = HandoffOf(answer, kv_request_id);
    if (status == 200 && handoff.kind != Handoff::kNotSent) params = handoff.params;
    if (status == 200 && !params) {
      // It prefilled but handed nothing on (its store did not answer):
      // requests go colocated until it is tried again.
      MarkDown(e, absl::StrCat("prefill answered without a handoff (", handoff.why, ")"));
    }
    if (!params) {
      counters.Handoff("prefill_failed");
      Log("frontend", "prefill on ", e.spec.id, " gave no handoff (status ", status,
          "): the decode engine computes the prompt");
      *note = absl::StrCat("; prefill=", e.spec.id, " (failed: ", status, ")");
      co_return std::nullopt;
    }
    counters.Handoff("handed_off");
    *note = absl::StrCat("; prefill=", e.spec.id, "; handoff_blocks=",
                         handoff.kind == Handoff::kFence
                             ? absl::StrCat((*params)["kvtier"].value("blocks", int64_t{0}))
                             : std::string("prompt"));
    co_return params;
  }

  // --- the client's side ----------------------------------------------

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
    std::set<Engine*> tried;
    bool client_keep = keep_alive;
    // With prefill engines, a long uncached prompt is prefilled there first
    // and the decode engine sent it with the handoff's params.
    Prepared handed;
    const Prepared* send = &p;
    std::string prefill_note;
    for (uint32_t attempt = 0; attempt < options.max_attempts; ++attempt) {
      Choice c = Choose(p, tried);
      if (c.engine == nullptr) break;
      if (attempt == 0) {
        uncached_tokens_seen += c.uncached;
        prompts_seen++;
      }
      if (attempt == 0 && p.disaggregable && c.uncached > options.pd_threshold &&
          HasPrefillEngines()) {
        bool gone = false;
        auto params = co_await Prefill(p, client, &prefill_note, &gone);
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
        counters.Added(static_cast<uint64_t>(us));
      }
      const std::shared_ptr<Engine> held = c.engine;  // lives while it serves
      Engine& e = *held;
      // After a handoff the decode engine loads the prompt's KV rather
      // than computing it: its prefill queue gains nothing.
      Ticket ticket = Charge(e, p, send == &handed ? 0 : c.uncached);
      const std::string explain = absl::StrCat(c.explain, prefill_note, "; attempt=", attempt + 1);
      if (options.log_routes) Log("route", explain, "; prompt_tokens=", p.prompt_tokens);
      Tried t = co_await Forward(e, *send, explain, client, keep_alive, &client_keep, &ticket);
      Finish(e, &ticket);
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

  std::string Metrics() {
    std::string out;
    absl::StrAppend(&out, "# TYPE kvtier_frontend_requests_total counter\n");
    {
      std::lock_guard lk(counters.mu);
      for (const auto& [k, v] : counters.requests) {
        absl::StrAppend(&out, "kvtier_frontend_requests_total{endpoint=\"", k.first, "\",code=\"",
                        k.second, "\"} ", v, "\n");
      }
      absl::StrAppend(&out, "# TYPE kvtier_frontend_routes_total counter\n");
      for (const auto& [k, v] : counters.routes) {
        absl::StrAppend(&out, "kvtier_frontend_routes_total{engine=\"", k.first, "\",reason=\"",
                        k.second, "\"} ", v, "\n");
      }
    }
    {
      std::lock_guard lk(counters.mu);
      absl::StrAppend(&out, "# TYPE kvtier_frontend_handoffs_total counter\n");
      for (const auto& [outcome, v] : counters.handoffs) {
        absl::StrAppend(&out, "kvtier_frontend_handoffs_total{outcome=\"", outcome, "\"} ", v,
                        "\n");
      }
    }
    absl::StrAppend(&out, "# TYPE kvtier_frontend_failovers_total counter\n",
                    "kvtier_frontend_failovers_total ", counters.failovers.load(), "\n",
                    "# TYPE kvtier_frontend_client_disconnects_total counter\n",
                    "kvtier_frontend_client_disconnects_total ", counters.client_disconnects.load(),
                    "\n", "# TYPE kvtier_frontend_no_engine_total counter\n",
                    "kvtier_frontend_no_engine_total ", counters.no_engine.load(), "\n",
                    "# TYPE kvtier_frontend_added_seconds histogram\n");
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= std::size(Counters::kAddedBoundsUs); ++i) {
      cumulative += counters.added_buckets[i].load();
      const std::string le = i < std::size(Counters::kAddedBoundsUs)
                                 ? absl::StrCat(Counters::kAddedBoundsUs[i] / 1e6)
                                 : std::string("+Inf");
      absl::StrAppend(&out, "kvtier_frontend_added_seconds_bucket{le=\"", le, "\"} ", cumulative,
                      "\n");
    }
    absl::StrAppend(&out, "kvtier_frontend_added_seconds_sum ",
                    static_cast<double>(counters.added_us_sum.load()) / 1e6, "\n",
                    "kvtier_frontend_added_seconds_count ", counters.added_count.load(), "\n");
    const std::shared_ptr<const Fleet> f = Snapshot();
    const auto& engines = f->engines;
    absl::StrAppend(&out, "# TYPE kvtier_frontend_engines gauge\n", "kvtier_frontend_engines ",
                    engines.size(), "\n");
    absl::StrAppend(&out, "# TYPE kvtier_frontend_engine_up gauge\n");
    const int64_t now = NowMs();
    for (auto& e : engines) {
      absl::StrAppend(&out, "kvtier_frontend_engine_up{engine=\"", e->spec.id, "\"} ",
                      e->Usable(now) ? 1 : 0, "\n");
    }
    absl::StrAppend(&out, "# TYPE kvtier_frontend_in_flight gauge\n");
    for (auto& e : engines) {
      absl::StrAppend(&out, "kvtier_frontend_in_flight{engine=\"", e->spec.id, "\"} ",
                      e->in_flight.load(), "\n");
    }
    // Each engine's KV event stream (router/vllm_events.h), as the router's
    // GetRouterStats names the counters.
    absl::StrAppend(&out, "# TYPE kvtier_frontend_vllm_events_total counter\n");
    for (auto& e : engines) {
      std::lock_guard lk(e->mu);
      if (!e->events) continue;
      e->events->stats().ForEach([&](const char* name, uint64_t v) {
        absl::StrAppend(&out, "kvtier_frontend_vllm_events_total{engine=\"", e->spec.id,
                        "\",counter=\"", name, "\"} ", v, "\n");
      });
    }
    // What each engine's own /metrics said at the last health check.
    absl::StrAppend(&out, "# TYPE kvtier_frontend_engine_load gauge\n");
    for (auto& e : engines) {
      std::lock_guard lk(e->mu);
      if (!e->vllm.seen) continue;
      absl::StrAppend(&out, "kvtier_frontend_engine_load{engine=\"", e->spec.id,
                      "\",gauge=\"running\"} ", e->vllm.running, "\n",
                      "kvtier_frontend_engine_load{engine=\"", e->spec.id, "\",gauge=\"waiting\"} ",
                      e->vllm.waiting, "\n");
      if (e->vllm.kv_usage >= 0) {
        absl::StrAppend(&out, "kvtier_frontend_engine_load{engine=\"", e->spec.id,
                        "\",gauge=\"kv_usage\"} ", e->vllm.kv_usage, "\n");
      }
    }
    // What the fleet loses with each engine: the prompt tokens of the
    // blocks only it holds (what its pod's deletion cost is kept at).
    absl::StrAppend(&out, "# TYPE kvtier_frontend_engine_sole_tokens gauge\n");
    {
      std::map<std::string, uint64_t> sole;
      for (const auto& s : router->core().Sources()) sole[s.source_id] = s.sole_blocks;
      for (auto& e : engines) {
        absl::StrAppend(&out, "kvtier_frontend_engine_sole_tokens{engine=\"", e->spec.id, "\"} ",
                        sole[e->spec.id] * e->spec.block_tokens, "\n");
      }
    }
    if (deletion_costs) absl::StrAppend(&out, deletion_costs->Metrics());
    absl::StrAppend(&out, "# TYPE kvtier_frontend_engine_health_checks_total counter\n");
    for (auto& e : engines) {
      absl::StrAppend(&out, "kvtier_frontend_engine_health_checks_total{engine=\"", e->spec.id,
                      "\"} ", e->health_checks.load(), "\n");
    }
    {
      std::lock_guard lk(counters.mu);
      absl::StrAppend(&out, "# TYPE kvtier_frontend_dns_resolutions_total counter\n");
      for (const auto& [k, v] : counters.resolutions) {
        absl::StrAppend(&out, "kvtier_frontend_dns_resolutions_total{name=\"", k.first,
                        "\",outcome=\"", k.second, "\"} ", v, "\n");
      }
    }
    absl::StrAppend(&out, "# TYPE kvtier_frontend_engine_failures_total counter\n");
    for (auto& e : engines) {
      absl::StrAppend(&out, "kvtier_frontend_engine_failures_total{engine=\"", e->spec.id, "\"} ",
                      e->failures.load(), "\n");
    }
    return out;
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
        const std::shared_ptr<const Fleet> f = Snapshot();
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
        res.body() = Metrics();
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

  // --- engine health ---------------------------------------------------

  static constexpr int kHealthFailures = 2;

  // GET `path` on a connection of its own: the body of a 200, or nothing.
  Task<std::optional<std::string>> Get(Engine& e, std::string path) {
    ErrorCode ec;
    auto s = co_await Connect(e, ec);
    if (!s) co_return std::nullopt;
    http::request<http::empty_body> req{http::verb::get, path, 11};
    req.set(http::field::host, e.spec.endpoint);
    s->expires_after(
        std::chrono::milliseconds(std::max<uint64_t>(2000, options.health_interval_ms)));
    co_await http::async_write(*s, req, net::redirect_error(kAwait, ec));
    if (ec) co_return std::nullopt;
    beast::flat_buffer b;
    http::response_parser<http::string_body> parser;
    parser.body_limit(16 << 20);
    co_await http::async_read(*s, b, parser, net::redirect_error(kAwait, ec));
    if (ec || parser.get().result_int() != 200) co_return std::nullopt;
    co_return std::move(parser.get().body());
  }

  Task<> HealthLoop(std::shared_ptr<Engine> e) {
    Timer timer(co_await net::this_coro::executor);
    while (!e->removed) {
      std::string health = "/health";
      const bool answered = (co_await Get(*e, health)).has_value();
      // One slow answer (an engine busy with a long prefill) is not a
      // failure: two in a row are. A refused request marks it down anyway.
      e->health_failures = answered ? 0 : e->health_failures + 1;
      const bool ok = answered || e->health_failures < kHealthFailures;
      if (answered) {
        std::string metrics = "/metrics";
        std::optional<std::string> body = co_await Get(*e, metrics);
        VllmLoad load = body ? ParseVllmMetrics(*body) : VllmLoad{};
        // Every request of ours vLLM counts as waiting is one we have no
        // answer to yet: what it counts beyond those is other frontends'.
        const double ours = static_cast<double>(std::max<int64_t>(0, e->waiting_requests.load()));
        {
          std::lock_guard lk(e->mu);
          e->vllm = load;
          e->foreign_waiting = std::max(0.0, load.waiting - ours);
        }
        PushLoad(*e, true);
      }
      e->health_checks++;
      const bool was = e->healthy.exchange(ok);
      if (was != ok) {
        Log("frontend", "engine ", e->spec.id, " (", e->spec.endpoint, ") is ",
            ok ? "healthy again" : "failing its health check");
        std::lock_guard lk(e->mu);
        if (e->removed) co_return;
        if (ok) {
          // Its events feed the router again (a hello and a resync).
          if (!e->spec.events.empty()) {
            e->events = std::make_unique<router::VllmEventSource>(e->spec, &router->core());
          }
        } else {
          // Its heartbeats stop: the router drops its blocks at its deadline.
          e->events.reset();
          e->idle.clear();
        }
      }
      timer.expires_after(std::chrono::milliseconds(options.health_interval_ms));
      ErrorCode ec;
      co_await timer.async_wait(net::redirect_error(kAwait, ec));
      if (ec) co_return;
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
  net::co_spawn(first, raw->Accept(), net::detached);
  for (const auto& spec : o.engines) raw->AddEngine(spec, -1);
  for (size_t i = 0; i < o.dns.size(); ++i) net::co_spawn(first, raw->DnsLoop(i), net::detached);
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
}

int Frontend::port() const { return impl_->port; }

std::string Frontend::router_address() const { return impl_->router->address(); }

}  // namespace kvtier::frontend
