#include "frontend/fleet.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "frontend/load.h"
#include "frontend/metrics.h"
#include "frontend/pool.h"
#include "frontend/token_check.h"

namespace kvtier::frontend {

bool Serves(const router::VllmSourceSpec& spec, Want want) {
  return want == Want::kPrefill ? spec.role == router::EngineRole::kPrefill
                                : spec.role != router::EngineRole::kPrefill;
}

Fleet::Fleet(const FrontendOptions& options, router::RouterCore* core, LoadBook* load,
             Counters* counters, Executor health, const std::vector<ServedModel>* models)
    : options_(options),
      core_(core),
      load_(load),
      counters_(counters),
      health_(health),
      models_(models) {}

void Fleet::Start() {
  for (const auto& spec : options_.engines) Add(spec, -1);
  for (size_t i = 0; i < options_.dns.size(); ++i) {
    net::co_spawn(health_, DnsLoop(i), net::detached);
  }
}

void Fleet::Close() {
  for (const auto& e : Snapshot()->engines) {
    std::unique_ptr<router::VllmEventSource> events;
    {
      std::lock_guard lk(e->mu);
      e->removed = true;
      events = std::move(e->events);
      e->idle.clear();
    }
  }
}

std::shared_ptr<const FleetView> Fleet::Snapshot() const {
  std::lock_guard lk(mu_);
  return view_;
}

bool Fleet::HasPrefillEngines() const {
  const std::shared_ptr<const FleetView> f = Snapshot();
  return std::any_of(f->engines.begin(), f->engines.end(),
                     [](const auto& e) { return Serves(e->spec, Want::kPrefill); });
}

void Fleet::MarkDown(Engine& e, const std::string& why) const {
  e.failures++;
  e.down_until_ms = NowMs() + static_cast<int64_t>(options_.down_ms);
  Log("frontend", "engine ", e.spec.id, " (", e.spec.endpoint, ") skipped for ", options_.down_ms,
      " ms: ", why);
}

void Fleet::AnswerFailed(Engine& e, const std::string& why) const {
  const uint32_t in_a_row = ++e.failed_in_a_row;
  if (in_a_row < options_.breaker_errors) {
    e.failures++;
    Log("frontend", "engine ", e.spec.id, " ", why, "; the request goes to another");
    return;
  }
  // Open; once --down passes, one more failure opens it again at once
  // (half-open), and a whole answer closes it.
  e.failed_in_a_row = options_.breaker_errors - 1;
  MarkDown(e, absl::StrCat(why, ", ", in_a_row, " answers in a row"));
}

void Fleet::Add(const router::VllmSourceSpec& spec, int dns_pool) {
  auto e = std::make_shared<Engine>();
  e->spec = spec;
  e->dns_pool = dns_pool;
  const size_t colon = spec.endpoint.rfind(':');
  e->host = spec.endpoint.substr(0, colon);
  e->port = spec.endpoint.substr(colon + 1);
  if (!spec.events.empty()) e->events = std::make_unique<router::VllmEventSource>(spec, core_);
  {
    std::lock_guard lk(mu_);
    auto next = std::make_shared<FleetView>(*view_);
    next->engines.push_back(e);
    view_ = std::move(next);
  }
  if (dns_pool >= 0) {
    Log("frontend", "engine ", spec.id, " joined the fleet (DNS ",
        options_.dns[static_cast<size_t>(dns_pool)].spec.endpoint, ", role ",
        router::EngineRoleName(spec.role), ")");
  }
  net::co_spawn(health_, HealthLoop(e), net::detached);
}

// The engine leaves routing and the index now; requests it serves finish.
void Fleet::Remove(const std::shared_ptr<Engine>& e, const std::string& why) {
  {
    std::lock_guard lk(mu_);
    auto next = std::make_shared<FleetView>();
    for (const auto& other : view_->engines) {
      if (other != e) next->engines.push_back(other);
    }
    view_ = std::move(next);
  }
  std::unique_ptr<router::VllmEventSource> events;
  {
    std::lock_guard lk(e->mu);
    e->removed = true;
    events = std::move(e->events);
    e->idle.clear();
  }
  events.reset();  // its thread ends: no event or heartbeat after this
  const bool indexed = core_->RemoveSource(e->spec.id);
  counters_->Forget(e->spec.id);
  Log("frontend", "engine ", e->spec.id, " left the fleet (", why, ")",
      indexed ? "; its blocks left the index" : "");
}

// One resolution of pool `index`'s name: its engines join and leave to
// match it. An address already in the fleet (another pool's, or a static
// engine) is not added twice.
void Fleet::SyncDns(size_t index, const std::set<std::string>& addresses, const std::string& port) {
  const FrontendOptions::DnsPool& pool = options_.dns[index];
  const std::shared_ptr<const FleetView> f = Snapshot();
  std::set<std::string> have;
  for (const auto& e : f->engines) {
    if (e->dns_pool == static_cast<int>(index) && addresses.count(e->host) == 0) {
      Remove(e, absl::StrCat("gone from DNS ", pool.spec.endpoint));
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
    Add(spec, static_cast<int>(index));
  }
}

Task<> Fleet::DnsLoop(size_t index) {
  auto exec = co_await net::this_coro::executor;
  Timer timer(exec);
  Resolver resolver(exec);
  const std::string& name = options_.dns[index].spec.endpoint;
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
      counters_->Resolution(name, false);
    } else {
      failing = false;
      counters_->Resolution(name, true);
      std::set<std::string> addresses;
      for (const auto& r : results) addresses.insert(r.endpoint().address().to_string());
      SyncDns(index, addresses, port);
    }
    timer.expires_after(std::chrono::milliseconds(options_.dns_interval_ms));
    co_await timer.async_wait(net::redirect_error(kAwait, ec));
    if (ec) co_return;
  }
}

Task<std::optional<std::string>> Fleet::Get(Engine& e, std::string path) const {
  auto got = co_await Fetch(e, http::verb::get, std::move(path), std::string());
  if (!got || got->first != 200) co_return std::nullopt;
  co_return std::move(got->second);
}

Task<std::optional<std::pair<unsigned, std::string>>> Fleet::Fetch(Engine& e, http::verb verb,
                                                                   std::string path,
                                                                   std::string body) const {
  ErrorCode ec;
  auto s = co_await Connect(e, options_.connect_timeout_ms, ec);
  if (!s) co_return std::nullopt;
  http::request<http::string_body> req{verb, path, 11};
  req.set(http::field::host, e.spec.endpoint);
  if (!body.empty()) {
    req.set(http::field::content_type, "application/json");
    req.body() = std::move(body);
  }
  req.prepare_payload();
  s->expires_after(
      std::chrono::milliseconds(std::max<uint64_t>(2000, options_.health_interval_ms)));
  co_await http::async_write(*s, req, net::redirect_error(kAwait, ec));
  if (ec) co_return std::nullopt;
  beast::flat_buffer b;
  http::response_parser<http::string_body> parser;
  parser.body_limit(16 << 20);
  co_await http::async_read(*s, b, parser, net::redirect_error(kAwait, ec));
  if (ec) co_return std::nullopt;
  co_return std::make_pair(parser.get().result_int(), std::move(parser.get().body()));
}

// One slow answer (an engine busy with a long prefill) is not a failure:
// this many in a row are. A refused request marks it down anyway.
constexpr int kHealthFailures = 2;

Task<> Fleet::HealthLoop(std::shared_ptr<Engine> e) {
  Timer timer(co_await net::this_coro::executor);
  while (!e->removed) {
    std::string health = "/health";
    const bool answered = (co_await Get(*e, health)).has_value();
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
      load_->Push(*e, true);
      if (!e->tokens_checked && models_ != nullptr) co_await CheckTokens(*e);
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
          e->events = std::make_unique<router::VllmEventSource>(e->spec, core_);
        }
      } else {
        // Its heartbeats stop: the router drops its blocks at its deadline.
        e->events.reset();
        e->idle.clear();
      }
    }
    timer.expires_after(std::chrono::milliseconds(options_.health_interval_ms));
    ErrorCode ec;
    co_await timer.async_wait(net::redirect_error(kAwait, ec));
    if (ec) co_return;
  }
}

Task<> Fleet::CheckTokens(Engine& e) {
  const ServedModel* model = nullptr;
  for (const ServedModel& m : *models_) {
    if (m.namespace_id == e.spec.namespace_id) model = &m;
  }
  if (model == nullptr || model->text == nullptr) co_return;
  for (const TokenProbe& probe : TokenProbes(*model->text)) {
    std::string path = "/tokenize";
    std::string body = probe.Request(model->name);
    auto answer = co_await Fetch(e, http::verb::post, path, body);
    if (!answer) co_return;  // no answer: tried again at the next health check
    e.tokens_checked = true;
    const TokenProbe::Compared c = answer->first == 200
                                       ? probe.Compare(answer->second)
                                       : TokenProbe::Compared{TokenProbe::Compared::kNoIds,
                                                              absl::StrCat("HTTP ", answer->first)};
    if (c.kind == TokenProbe::Compared::kNoIds) {
      Log("frontend", "engine ", e.spec.id, " has no vLLM /tokenize (", c.why,
          "): its tokenizer is not compared with the frontend's");
      co_return;
    }
    if (c.kind == TokenProbe::Compared::kDiffers) {
      e.refused = true;
      Log("frontend", "engine ", e.spec.id,
          " is refused: its token ids differ from the frontend's (", c.why,
          "); the frontend sends token ids, so that engine would compute other prompts. "
          "Give the frontend the engine's own tokenizer files (--model)");
      co_return;
    }
  }
}

}  // namespace kvtier::frontend
