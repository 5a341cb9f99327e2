#include "router/service.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/tls.h"
#include "common/version.h"
#include "router/wire.h"

namespace kvtier::router {

grpc::Status RouterService::Authorize(const grpc::ServerContext& ctx, const v1::Hello& hello) {
  if (!auth_.authenticates()) return grpc::Status::OK;
  absl::Status s = auth_.Check(PeerCertificateNames(ctx), hello);
  if (s.ok()) return grpc::Status::OK;
  hellos_refused_.fetch_add(1, std::memory_order_relaxed);
  Log("router", "refused a hello from ", ctx.peer(), ": ", s.message());
  return ToGrpc(s);
}

grpc::Status RouterService::StreamEvents(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::RouterCommand, v1::SourceMessage>* stream) {
  v1::SourceMessage m;
  if (!stream->Read(&m)) return grpc::Status::OK;
  if (m.message_case() != v1::SourceMessage::kHello) {
    return grpc::Status(grpc::INVALID_ARGUMENT,
                        "the first message of an event stream must be a hello");
  }
  v1::Hello hello = m.hello();
  if (grpc::Status a = Authorize(*ctx, hello); !a.ok()) return a;
  std::vector<RouterCommand> commands;
  if (auto s = core_->Hello(FromWire(hello), &commands); !s.ok()) return ToGrpc(s);
  const std::string id = hello.source_id();
  core_->Connected(id, true);
  grpc::Status result = grpc::Status::OK;
  for (;;) {
    for (const auto& c : commands) {
      v1::RouterCommand w;
      ToWire(c, &w);
      stream->Write(w);
    }
    commands.clear();
    if (!stream->Read(&m)) break;
    if (m.message_case() == v1::SourceMessage::kHello) {
      if (m.hello().source_id() != id) {
        result = grpc::Status(grpc::INVALID_ARGUMENT,
                              absl::StrCat("a stream belongs to one source: opened as ", id,
                                           ", hello names ", m.hello().source_id()));
        break;
      }
      if (result = Authorize(*ctx, m.hello()); !result.ok()) break;
      hello = m.hello();
    }
    const SourceMessage message = FromWire(m);
    absl::Status s = core_->Handle(id, message, &commands);
    if (s.code() == absl::StatusCode::kNotFound) {
      // Dropped at heartbeat expiry while the stream stayed open: register again.
      s = core_->Hello(FromWire(hello), &commands);
      if (s.ok()) core_->Connected(id, true);
      if (s.ok()) s = core_->Handle(id, message, &commands);
    }
    if (!s.ok()) {
      result = ToGrpc(s);
      break;
    }
  }
  core_->Connected(id, false);
  return result;
}

grpc::Status RouterService::Publish(grpc::ServerContext* ctx, const v1::PublishRequest* req,
                                    v1::PublishResponse* resp) {
  if (req->messages_size() == 0 || req->messages(0).message_case() != v1::SourceMessage::kHello) {
    return grpc::Status(grpc::INVALID_ARGUMENT, "publish: the first message must be a hello");
  }
  const std::string id = req->messages(0).hello().source_id();
  std::vector<RouterCommand> commands;
  for (int i = 0; i < req->messages_size(); ++i) {
    const auto& m = req->messages(i);
    if (m.message_case() == v1::SourceMessage::kHello && m.hello().source_id() != id) {
      return grpc::Status(grpc::INVALID_ARGUMENT,
                          absl::StrCat("publish: message ", i, " is a hello of another source"));
    }
    if (m.message_case() == v1::SourceMessage::kHello) {
      if (grpc::Status a = Authorize(*ctx, m.hello()); !a.ok()) return a;
    }
    if (auto s = core_->Handle(id, FromWire(m), &commands); !s.ok()) {
      return ToGrpc(
          absl::Status(s.code(), absl::StrCat("publish: message ", i, ": ", s.message())));
    }
  }
  for (const auto& c : commands) ToWire(c, resp->add_commands());
  return grpc::Status::OK;
}

grpc::Status RouterService::Route(grpc::ServerContext* ctx, const v1::RouteRequest* req,
                                  v1::RouteResponse* resp) {
  auto start = std::chrono::steady_clock::now();
  auto r = core_->Route(FromWire(*req));
  route_latency_.Record(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                  std::chrono::steady_clock::now() - start)
                                                  .count()),
                        r.ok());
  if (!r.ok()) {
    // The router itself answered (an UNAVAILABLE of its own, such as no live
    // worker for the namespace, is not a router that could not be reached).
    ctx->AddTrailingMetadata(kAnsweredByServer, "router");
    return ToGrpc(r.status());
  }
  ToWire(*r, resp);
  return grpc::Status::OK;
}

std::vector<prometheus::MetricFamily> RouterService::CollectMetrics() {
  MetricsBuilder m;
  m.Gauge("kvtier_build_info", "1, labelled with this build's kvtier version", 1,
          {{"version", Version()}, {"component", "router"}});
  v1::GetRouterStatsResponse st;
  ToWire(core_->Stats(), &st);
  if (extra_stats_) extra_stats_(&st);
  for (const auto& [what, n] : st.vllm_events()) {
    m.Counter("kvtier_router_vllm_events_total",
              "vLLM KV-event subscribers: batches, events, blocks and faults by kind", n,
              {{"kind", what}});
  }
  m.Counter("kvtier_router_hellos_refused_total",
            "Hellos refused because the caller's certificate may not speak for the source",
            hellos_refused_.load(std::memory_order_relaxed));
  m.Gauge("kvtier_router_index_bytes_per_block", "Index memory per indexed block",
          st.indexed_blocks() ? static_cast<double>(core_->IndexMemoryBytes()) / st.indexed_blocks()
                              : 0);
  m.Gauge("kvtier_router_indexed_blocks", "Distinct (namespace, block) keys in the index",
          st.indexed_blocks());
  m.Gauge("kvtier_router_indexed_replicas", "(block, source) pairs in the index",
          st.indexed_replicas());
  m.Gauge("kvtier_router_index_bytes", "Approximate memory of the index",
          core_->IndexMemoryBytes());
  m.Counter("kvtier_router_events_total", "KV events by outcome", st.events_applied(),
            {{"outcome", "applied"}});
  m.Counter("kvtier_router_events_total", "KV events by outcome", st.events_duplicate(),
            {{"outcome", "duplicate"}});
  m.Counter("kvtier_router_events_total", "KV events by outcome", st.events_rejected(),
            {{"outcome", "rejected"}});
  m.Counter("kvtier_router_snapshots_requested_total", "Snapshots asked of sources",
            st.snapshots_requested());
  m.Counter("kvtier_router_snapshots_applied_total", "Snapshots applied", st.snapshots_applied());
  m.Counter("kvtier_router_sources_expired_total", "Sources dropped at heartbeat expiry",
            st.sources_expired());
  m.Counter("kvtier_router_unknown_removals_total", "Removals of blocks a source never stored",
            st.unknown_removals());
  for (const auto& [outcome, n] : st.decisions()) {
    m.Counter("kvtier_router_decisions_total", "Route decisions by outcome", n,
              {{"outcome", outcome}});
  }
  m.Histogram("kvtier_router_route_duration_seconds", "Latency of Route", route_latency_.Take());
  for (const auto& s : core_->Sources()) {
    MetricsBuilder::Labels l = {{"source", s.source_id}, {"kind", SourceKindName(s.kind)}};
    m.Gauge("kvtier_router_source_up", "1 while the source's stream is open", s.connected, l);
    m.Gauge("kvtier_router_source_last_seen_seconds", "Seconds since the source's last message",
            s.last_seen_ms / 1000.0, l);
    m.Gauge("kvtier_router_source_indexed_blocks", "Blocks indexed for the source",
            s.indexed_blocks, l);
    m.Gauge("kvtier_router_source_queued_prefill_tokens", "Queued prefill tokens (last heartbeat)",
            s.load.queued_prefill_tokens, l);
    if (s.kind == SourceKind::kWorker) {
      m.Gauge("kvtier_router_source_sole_blocks",
              "Blocks only this worker holds (no other worker, no store shard)", s.sole_blocks, l);
      m.Gauge("kvtier_router_source_draining", "1 while the worker says it is draining",
              s.load.draining ? 1 : 0, l);
    }
    if (s.kind == SourceKind::kWorker && s.load.prefill_tokens_per_s > 0) {
      m.Gauge("kvtier_router_source_prefill_tokens_per_second",
              "Prefill rate the worker reports (last heartbeat)", s.load.prefill_tokens_per_s, l);
    }
    for (const auto& t : s.load.fetch) {
      MetricsBuilder::Labels tl = l;
      tl["tier"] = t.tier;
      m.Gauge("kvtier_router_store_fetch_seconds_per_block",
              "A store shard's fetch time per block, per tier (last heartbeat)",
              t.us_per_block / 1e6, tl);
      m.Gauge("kvtier_router_store_fetch_queue_depth",
              "Fetches in flight at a store shard (last heartbeat)", t.queue_depth, tl);
    }
  }
  m.Gauge("kvtier_router_sources", "Live sources", st.sources());
  return m.Take();
}

grpc::Status RouterService::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                        v1::ListWorkersResponse* resp) {
  for (const auto& s : core_->Sources()) ToWire(s, resp->add_sources());
  return grpc::Status::OK;
}

grpc::Status RouterService::GetRouterStats(grpc::ServerContext*, const v1::GetRouterStatsRequest*,
                                           v1::GetRouterStatsResponse* resp) {
  ToWire(core_->Stats(), resp);
  resp->set_version(Version());
  if (extra_stats_) extra_stats_(resp);
  return grpc::Status::OK;
}

}  // namespace kvtier::router
