// What kvtier-frontend counts, and its Prometheus exposition (built at
// scrape time with kvtier's MetricsBuilder from the counters, the fleet and
// the router's sources; docs/frontend.md lists the series).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/metric_family.h>

#include "common/histogram.h"
#include "frontend/fleet.h"
#include "router/router_core.h"

namespace kvtier::frontend {

class DeletionCostUpdater;

struct Counters {
  std::mutex mu;
  std::map<std::pair<std::string, int>, uint64_t> requests;        // (endpoint, status)
  std::map<std::pair<std::string, std::string>, uint64_t> routes;  // (engine, reason)
  std::atomic<uint64_t> failovers{0}, client_disconnects{0}, no_engine{0}, streams_cut{0};
  // Back-off rounds (every engine tried again), requests the queue refused
  // (429), and those waiting in it now.
  std::atomic<uint64_t> retries{0}, queue_refused{0};
  std::atomic<int64_t> queued{0};
  std::map<std::string, uint64_t> handoffs;  // prefill/decode, by outcome
  std::map<std::pair<std::string, std::string>, uint64_t> resolutions;  // (name, outcome)
  // Client connections open, requests being served (read, not yet
  // answered whole), and the bytes of request bodies held.
  std::atomic<int64_t> connections{0}, requests_in_flight{0};
  std::atomic<uint64_t> body_bytes_in_flight{0};
  // The added latency: request read to engine chosen.
  LatencyHistogram added;

  void Request(const std::string& endpoint, int status) {
    std::lock_guard lk(mu);
    requests[{endpoint, status}]++;
  }
  void Route(const std::string& engine, const std::string& reason) {
    std::lock_guard lk(mu);
    routes[{engine, reason}]++;
  }
  // An engine left the fleet: its series go (a pod's IP is not reused by
  // the same engine; series kept for every pod that ever served would grow
  // without end).
  void Forget(const std::string& engine) {
    std::lock_guard lk(mu);
    std::erase_if(routes, [&](const auto& kv) { return kv.first.first == engine; });
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

// The frontend's series: `counters`, each engine of `fleet` (up, in
// flight, its KV event stream, its vLLM load, the tokens only it holds per
// `core`, its health checks and failures), and `costs` when set.
std::vector<prometheus::MetricFamily> CollectMetrics(Counters& counters, const FleetView& fleet,
                                                     router::RouterCore& core,
                                                     const DeletionCostUpdater* costs);
// CollectMetrics' series and the process's own, as Prometheus text.
std::string RenderMetrics(Counters& counters, const FleetView& fleet, router::RouterCore& core,
                          const DeletionCostUpdater* costs);

}  // namespace kvtier::frontend
