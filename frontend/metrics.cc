#include "frontend/metrics.h"

#include <prometheus/text_serializer.h>

#include "common/rpc/metrics.h"
#include "frontend/deletion_cost.h"

namespace kvtier::frontend {

std::vector<prometheus::MetricFamily> CollectMetrics(Counters& counters, const FleetView& fleet,
                                                     router::RouterCore& core,
                                                     const DeletionCostUpdater* costs) {
  MetricsBuilder m;
  {
    std::lock_guard lk(counters.mu);
    for (const auto& [k, v] : counters.requests) {
      m.Counter("kvtier_frontend_requests_total", "Requests answered, by endpoint and status.",
                static_cast<double>(v),
                {{"endpoint", k.first}, {"code", std::to_string(k.second)}});
    }
    for (const auto& [k, v] : counters.routes) {
      m.Counter("kvtier_frontend_routes_total", "Engines chosen, by engine and reason.",
                static_cast<double>(v), {{"engine", k.first}, {"reason", k.second}});
    }
    for (const auto& [outcome, v] : counters.handoffs) {
      m.Counter("kvtier_frontend_handoffs_total", "Prefill/decode handoffs, by outcome.",
                static_cast<double>(v), {{"outcome", outcome}});
    }
    for (const auto& [k, v] : counters.resolutions) {
      m.Counter("kvtier_frontend_dns_resolutions_total", "DNS resolutions of engine pools.",
                static_cast<double>(v), {{"name", k.first}, {"outcome", k.second}});
    }
  }
  m.Counter("kvtier_frontend_failovers_total", "Requests sent to another engine after a failure.",
            static_cast<double>(counters.failovers.load()));
  m.Counter("kvtier_frontend_retries_total",
            "Back-off rounds: every engine tried, the usable ones tried again.",
            static_cast<double>(counters.retries.load()));
  m.Counter("kvtier_frontend_queue_refused_total",
            "Requests answered 429: the queue was full or their wait timed out.",
            static_cast<double>(counters.queue_refused.load()));
  m.Gauge("kvtier_frontend_queued", "Requests waiting for a turn (--max-concurrent-requests).",
          static_cast<double>(counters.queued.load()));
  m.Counter("kvtier_frontend_client_disconnects_total", "Clients gone before their answer ended.",
            static_cast<double>(counters.client_disconnects.load()));
  m.Counter("kvtier_frontend_streams_cut_total",
            "Streams that ended short: their engine failed after their first event.",
            static_cast<double>(counters.streams_cut.load()));
  m.Counter("kvtier_frontend_no_engine_total", "Requests no engine could serve (503).",
            static_cast<double>(counters.no_engine.load()));
  m.Gauge("kvtier_frontend_connections", "Client connections open.",
          static_cast<double>(counters.connections.load()));
  m.Gauge("kvtier_frontend_requests_in_flight", "Requests read and not yet answered whole.",
          static_cast<double>(counters.requests_in_flight.load()));
  m.Gauge("kvtier_frontend_body_bytes_in_flight", "Bytes of the request bodies held.",
          static_cast<double>(counters.body_bytes_in_flight.load()));
  m.Histogram("kvtier_frontend_added_seconds", "Request read to engine chosen.",
              counters.added.Take());
  const auto& engines = fleet.engines;
  m.Gauge("kvtier_frontend_engines", "Engines in the fleet.", static_cast<double>(engines.size()));
  // What the fleet loses with each engine: the prompt tokens of the blocks
  // only it holds (what its pod's deletion cost is kept at).
  std::map<std::string, uint64_t> sole;
  for (const auto& s : core.Sources()) sole[s.source_id] = s.sole_blocks;
  const int64_t now = NowMs();
  for (const auto& e : engines) {
    const MetricsBuilder::Labels engine{{"engine", e->spec.id}};
    m.Gauge("kvtier_frontend_engine_up", "1 while the engine takes requests.",
            e->Usable(now) ? 1 : 0, engine);
    m.Gauge("kvtier_frontend_in_flight", "Requests sent to the engine, not ended.",
            static_cast<double>(e->in_flight.load()), engine);
    m.Gauge("kvtier_frontend_engine_sole_tokens", "Prompt tokens only this engine holds.",
            static_cast<double>(sole[e->spec.id] * e->spec.block_tokens), engine);
    m.Counter("kvtier_frontend_engine_health_checks_total", "Health checks ended.",
              static_cast<double>(e->health_checks.load()), engine);
    m.Counter("kvtier_frontend_engine_failures_total", "Requests the engine failed.",
              static_cast<double>(e->failures.load()), engine);
    std::lock_guard lk(e->mu);
    // Each engine's KV event stream (router/vllm_events.h), as the
    // router's GetRouterStats names the counters.
    if (e->events) {
      e->events->stats().ForEach([&](const char* name, uint64_t v) {
        m.Counter("kvtier_frontend_vllm_events_total", "The engine's KV events, by counter.",
                  static_cast<double>(v), {{"engine", e->spec.id}, {"counter", name}});
      });
    }
    // What the engine's own /metrics said at the last health check.
    if (e->vllm.seen) {
      const char* help = "The engine's own load gauges, last scraped.";
      m.Gauge("kvtier_frontend_engine_load", help, e->vllm.running,
              {{"engine", e->spec.id}, {"gauge", "running"}});
      m.Gauge("kvtier_frontend_engine_load", help, e->vllm.waiting,
              {{"engine", e->spec.id}, {"gauge", "waiting"}});
      if (e->vllm.kv_usage >= 0) {
        m.Gauge("kvtier_frontend_engine_load", help, e->vllm.kv_usage,
                {{"engine", e->spec.id}, {"gauge", "kv_usage"}});
      }
    }
  }
  if (costs != nullptr) costs->AddMetrics(m);
  return m.Take();
}

std::string RenderMetrics(Counters& counters, const FleetView& fleet, router::RouterCore& core,
                          const DeletionCostUpdater* costs) {
  std::vector<prometheus::MetricFamily> families = CollectMetrics(counters, fleet, core, costs);
  MetricsBuilder process;
  AddProcessMetrics(process);
  for (auto& f : process.Take()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvtier::frontend
