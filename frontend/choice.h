// Choosing the engine a request goes to: the router's choice among the
// engines the request can be sent to (serving its model's namespace,
// usable, not tried, of the role wanted), then its other candidates in order; with no route, the
// usable engine with the fewest requests in flight; with none usable, an engine whose health check
// fails but which failed no request lately.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "frontend/fleet.h"
#include "frontend/metrics.h"
#include "router/router_core.h"

namespace kvtier::frontend {

struct Choice {
  std::shared_ptr<Engine> engine;  // nullptr: no engine can take the request
  std::string explain;             // the route header's text
  uint64_t uncached = 0;           // prompt tokens the engine would compute (router's estimate)
};

const char* ReasonName(router::Reason r);

// Each choice is counted in `counters` by engine and reason. `variant`: the
// request's LoRA adapter and cache salt (ChainVariant; 0 for neither).
Choice Choose(router::RouterCore& core, uint64_t namespace_id, const FleetView& fleet,
              const std::vector<uint32_t>& tokens, uint64_t prompt_tokens, uint64_t variant,
              const std::set<const Engine*>& tried, Want want, Counters& counters,
              int64_t now_ms = NowMs());

}  // namespace kvtier::frontend
