#include "router/wire.h"

#include "common/rpc/proto_convert.h"

namespace kvtier::router {

namespace {

std::vector<BlockHash> Hashes(const google::protobuf::RepeatedPtrField<v1::BlockHash>& hs) {
  std::vector<BlockHash> out;
  out.reserve(hs.size());
  for (const auto& h : hs) out.push_back(kvtier::FromProto(h));
  return out;
}

v1::RouteReason ToWire(Reason r) {
  switch (r) {
    case Reason::kLowestCost:
      return v1::ROUTE_LOWEST_COST;
    case Reason::kTieBreak:
      return v1::ROUTE_TIE_BREAK;
    case Reason::kBalanceGuard:
      return v1::ROUTE_BALANCE_GUARD;
    case Reason::kSampled:
      return v1::ROUTE_SAMPLED;
  }
  return v1::ROUTE_REASON_UNSPECIFIED;
}

}  // namespace

SourceKind FromWire(v1::SourceKind kind) {
  switch (kind) {
    case v1::SOURCE_WORKER:
      return SourceKind::kWorker;
    case v1::SOURCE_STORE:
      return SourceKind::kStore;
    default:
      return SourceKind::kUnspecified;
  }
}

v1::SourceKind ToWire(SourceKind kind) {
  switch (kind) {
    case SourceKind::kWorker:
      return v1::SOURCE_WORKER;
    case SourceKind::kStore:
      return v1::SOURCE_STORE;
    case SourceKind::kUnspecified:
      break;
  }
  return v1::SOURCE_KIND_UNSPECIFIED;
}

SourceHello FromWire(const v1::Hello& h) {
  return SourceHello{h.source_id(),    FromWire(h.kind()), h.endpoint(),
                     h.namespace_id(), h.block_tokens(),   h.epoch()};
}

SourceLoad FromWire(const v1::Heartbeat& hb) {
  SourceLoad l;
  l.running_requests = hb.running_requests();
  l.queued_prefill_tokens = hb.queued_prefill_tokens();
  l.free_gpu_pages = hb.free_gpu_pages();
  l.prefill_tokens_per_s = hb.prefill_tokens_per_s();
  for (const auto& t : hb.fetch()) {
    l.fetch.push_back({t.tier(), t.blocks(), t.bytes_per_s(), t.us_per_block(), t.queue_depth()});
  }
  l.arrived_request_ids.assign(hb.arrived_request_ids().begin(), hb.arrived_request_ids().end());
  l.draining = hb.draining();
  return l;
}

void ToWire(const SourceLoad& l, v1::Heartbeat* out) {
  out->set_running_requests(l.running_requests);
  out->set_queued_prefill_tokens(l.queued_prefill_tokens);
  out->set_free_gpu_pages(l.free_gpu_pages);
  out->set_prefill_tokens_per_s(l.prefill_tokens_per_s);
  for (const auto& t : l.fetch) {
    auto* o = out->add_fetch();
    o->set_tier(t.tier);
    o->set_blocks(t.blocks);
    o->set_bytes_per_s(t.bytes_per_s);
    o->set_us_per_block(t.us_per_block);
    o->set_queue_depth(t.queue_depth);
  }
  out->mutable_arrived_request_ids()->Add(l.arrived_request_ids.begin(),
                                          l.arrived_request_ids.end());
  out->set_draining(l.draining);
}

SourceMessage FromWire(const v1::SourceMessage& m) {
  switch (m.message_case()) {
    case v1::SourceMessage::kHello:
      return FromWire(m.hello());
    case v1::SourceMessage::kHeartbeat:
      return FromWire(m.heartbeat());
    case v1::SourceMessage::kSnapshot: {
      const auto& c = m.snapshot();
      return SnapshotChunk{c.seq(), c.namespace_id(), Hashes(c.hashes()), c.last()};
    }
    case v1::SourceMessage::kEvent: {
      const auto& e = m.event();
      BlockEvent out;
      out.seq = e.seq();
      switch (e.event_case()) {
        case v1::KvEvent::kStored:
          out.kind = BlockEvent::Kind::kStored;
          out.namespace_id = e.stored().namespace_id();
          out.hashes = Hashes(e.stored().hashes());
          break;
        case v1::KvEvent::kRemoved:
          out.kind = BlockEvent::Kind::kRemoved;
          out.namespace_id = e.removed().namespace_id();
          out.hashes = Hashes(e.removed().hashes());
          break;
        case v1::KvEvent::kCleared:
          out.kind = BlockEvent::Kind::kCleared;
          break;
        default:
          break;  // kNone: rejected by the core
      }
      return out;
    }
    default:
      return std::monostate{};
  }
}

void ToWire(const RouterCommand& c, v1::RouterCommand* out) {
  if (c.kind == RouterCommand::Kind::kSnapshotRequest) {
    out->mutable_snapshot_request()->set_reason(c.reason);
  } else {
    out->mutable_event_rejected()->set_seq(c.seq);
    out->mutable_event_rejected()->set_reason(c.reason);
  }
}

RouteQuery FromWire(const v1::RouteRequest& req) {
  RouteQuery q;
  q.namespace_id = req.namespace_id();
  q.prompt_tokens = req.prompt_tokens();
  q.max_candidates = req.max_candidates();
  q.dry_run = req.dry_run();
  q.request_id = req.request_id();
  q.variant = req.variant();
  if (req.prompt_case() == v1::RouteRequest::kTokens) {
    q.prompt = RouteQuery::Prompt::kTokens;
    const auto& ids = req.tokens().ids();
    q.tokens = std::span<const uint32_t>(ids.data(), ids.size());
  } else if (req.prompt_case() == v1::RouteRequest::kHashes) {
    q.prompt = RouteQuery::Prompt::kHashes;
    const auto& hs = req.hashes().hashes();
    q.hashes = ChainView(&hs, hs.size(), [](const void* ctx, size_t i) {
      using List = google::protobuf::RepeatedPtrField<v1::BlockHash>;
      return kvtier::FromProto((*static_cast<const List*>(ctx))[static_cast<int>(i)]);
    });
  }
  return q;
}

void ToWire(const RouteResult& r, v1::RouteResponse* out) {
  out->set_worker_id(r.worker_id);
  out->set_endpoint(r.endpoint);
  out->set_gpu_hit_blocks(r.gpu_blocks);
  out->set_cpu_hit_blocks(r.cpu_blocks);
  out->set_disk_hit_blocks(r.disk_blocks);
  out->set_store_hit_blocks(r.store_blocks);
  if (r.store_end) out->set_store_end_blocks(*r.store_end);
  out->set_prefill_tokens(r.prefill_tokens);
  out->set_reason(ToWire(r.reason));
  out->set_block_tokens(r.block_tokens);
  auto* b = out->mutable_fetch_basis();
  b->set_fetch_cost(r.fetch.fetch_cost);
  b->set_measured(r.fetch.measured);
  b->set_store_id(r.fetch.store_id);
  b->set_store_us_per_block(r.fetch.store_us_per_block);
  b->set_store_queue_depth(r.fetch.store_queue_depth);
  b->set_prefill_tokens_per_s(r.fetch.prefill_tokens_per_s);
  for (const auto& c : r.candidates) {
    auto* o = out->add_candidates();
    o->set_worker_id(c.worker_id);
    o->set_gpu_blocks(c.gpu_blocks);
    o->set_store_blocks(c.store_blocks);
    o->set_prefill_tokens(c.prefill_tokens);
    o->set_load_tokens(c.load_tokens);
    o->set_cost(c.cost);
    o->set_fetch_cost(c.fetch_cost);
    o->set_occupancy(c.occupancy);
    o->set_cpu_blocks(c.cpu_blocks);
    o->set_disk_blocks(c.disk_blocks);
  }
}

void ToWire(const SourceInfo& i, v1::SourceInfo* out) {
  out->set_source_id(i.source_id);
  out->set_kind(ToWire(i.kind));
  out->set_endpoint(i.endpoint);
  out->set_namespace_id(i.namespace_id);
  out->set_indexed_blocks(i.indexed_blocks);
  ToWire(i.load, out->mutable_load());
  out->set_routed_tokens_since_heartbeat(i.routed_tokens_since_heartbeat);
  out->set_last_seen_ms(i.last_seen_ms);
  out->set_epoch(i.epoch);
  out->set_last_seq(i.last_seq);
  out->set_resyncing(i.resyncing);
  out->set_connected(i.connected);
  out->set_sole_blocks(i.sole_blocks);
  out->set_sole_recompute_seconds(i.sole_recompute_seconds);
}

void ToWire(const RouterStats& s, v1::GetRouterStatsResponse* out) {
  out->set_indexed_blocks(s.indexed_blocks);
  out->set_indexed_replicas(s.indexed_replicas);
  out->set_sources(s.sources);
  out->set_events_applied(s.events_applied);
  out->set_events_duplicate(s.events_duplicate);
  out->set_events_rejected(s.events_rejected);
  out->set_snapshots_requested(s.snapshots_requested);
  out->set_snapshots_applied(s.snapshots_applied);
  out->set_sources_expired(s.sources_expired);
  out->set_unknown_removals(s.unknown_removals);
  auto& d = *out->mutable_decisions();
  d["lowest_cost"] = s.lowest_cost;
  d["tie_break"] = s.tie_break;
  d["balance_guard"] = s.balance_guard;
  d["sampled"] = s.sampled;
  d["unavailable"] = s.unavailable;
}

}  // namespace kvtier::router
