#include "frontend/choice.h"

#include "absl/strings/str_cat.h"

namespace kvtier::frontend {

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

Choice Choose(router::RouterCore& core, uint64_t namespace_id, const FleetView& fleet,
              const std::vector<uint32_t>& tokens, uint64_t prompt_tokens, uint64_t variant,
              const std::set<const Engine*>& tried, Want want, Counters& counters, int64_t now) {
  Choice c;
  auto open = [&](const Engine& e) {
    return !tried.count(&e) && e.Usable(now) && Serves(e.spec, want) &&
           e.spec.namespace_id == namespace_id;
  };
  router::RouteQuery q;
  q.namespace_id = namespace_id;
  q.prompt = router::RouteQuery::Prompt::kTokens;
  q.tokens = tokens;
  q.variant = variant;
  q.max_candidates = static_cast<uint32_t>(std::max<size_t>(1, fleet.engines.size()));
  // The router chooses among the engines this request can be sent to: the
  // route's load and pending blocks go where the request goes.
  std::vector<std::string> exclude;
  for (const auto& e : fleet.engines) {
    if (!open(*e)) exclude.push_back(e->spec.id);
  }
  q.exclude = exclude;
  auto routed = core.Route(q);
  auto find = [&](const std::string& id) -> std::shared_ptr<Engine> {
    for (const auto& e : fleet.engines) {
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
      if (e == nullptr || !open(*e)) continue;
      const bool first = cand.worker_id == routed->worker_id;
      const std::string reason = first ? ReasonName(routed->reason) : "failover";
      c.engine = std::move(e);
      c.explain = absl::StrCat(
          "engine=", cand.worker_id, "; gpu_blocks=", cand.gpu_blocks,
          cand.cpu_blocks + cand.disk_blocks > 0
              ? absl::StrCat("; cpu_blocks=", cand.cpu_blocks, "; disk_blocks=", cand.disk_blocks)
              : "",
          "; store_blocks=", cand.store_blocks, "; load_tokens=", cand.load_tokens,
          "; cost=", cand.cost, "; reason=", reason);
      c.uncached = cand.prefill_tokens;
      counters.Route(cand.worker_id, reason);
      return c;
    }
  }
  // No route (no engine has said hello yet, or every candidate is down or
  // tried): the usable engine with the fewest requests in flight.
  c.uncached = prompt_tokens;
  for (const auto& e : fleet.engines) {
    if (!open(*e)) continue;
    if (c.engine == nullptr || e->in_flight.load() < c.engine->in_flight.load()) c.engine = e;
  }
  // None usable: an engine whose health check fails (slow, or gone) but
  // which failed no request lately is still worth a try before a 503.
  bool unhealthy = false;
  if (c.engine == nullptr) {
    for (const auto& e : fleet.engines) {
      if (tried.count(e.get()) || e->refused.load() || e->down_until_ms.load() > now ||
          !Serves(e->spec, want) || e->spec.namespace_id != namespace_id) {
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
    c.explain = absl::StrCat("engine=", c.engine->spec.id, "; gpu_blocks=0; store_blocks=0",
                             "; in_flight=", c.engine->in_flight.load(), "; reason=", why,
                             routed.ok() ? "" : absl::StrCat(" (", routed.status().message(), ")"));
    counters.Route(c.engine->spec.id, why);
  }
  return c;
}

}  // namespace kvtier::frontend
