#include "router/router_core.h"

#include <cmath>
#include <mutex>
#include <shared_mutex>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier::router {

absl::Status RouterOptions::Validate() const {
  if (heartbeat_deadline_ms == 0) {
    return absl::InvalidArgumentError("flag --heartbeat-deadline must be above 0");
  }
  if (!(knobs.fetch_cost >= 0)) return absl::InvalidArgumentError("flag --fetch-cost must be >= 0");
  if (!(knobs.load_weight >= 0)) {
    return absl::InvalidArgumentError("flag --load-weight must be >= 0");
  }
  if (!(knobs.occupancy_weight >= 0)) {
    return absl::InvalidArgumentError("flag --occupancy-weight must be >= 0");
  }
  if (!(knobs.cpu_fetch_cost >= 0) || !(knobs.disk_fetch_cost >= 0)) {
    return absl::InvalidArgumentError("flags --cpu-fetch-cost and --disk-fetch-cost must be >= 0");
  }
  if (!(knobs.temperature >= 0)) {
    return absl::InvalidArgumentError("flag --temperature must be >= 0");
  }
  if (pending_ms > 60000) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --pending is ", pending_ms, " ms (allowed 0..60000)"));
  }
  return absl::OkStatus();
}

namespace {

// INVALID_ARGUMENT for a hello the router cannot register.
absl::Status CheckHello(const SourceHello& h) {
  if (h.source_id.empty() || h.source_id.size() > 256) {
    return absl::InvalidArgumentError("hello: source_id must be 1..256 bytes");
  }
  if (h.kind != SourceKind::kWorker && h.kind != SourceKind::kStore) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello from ", h.source_id, ": kind must be SOURCE_WORKER or SOURCE_STORE"));
  }
  if (h.kind != SourceKind::kWorker) return absl::OkStatus();
  if (h.endpoint.empty() || h.endpoint.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello from worker ", h.source_id, ": endpoint must be 1..256 bytes"));
  }
  if (h.namespace_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello from worker ", h.source_id, ": namespace_id is missing"));
  }
  if (h.block_tokens < limits::kMinBlockTokens || h.block_tokens > limits::kMaxBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello from worker ", h.source_id, ": block_tokens must be ",
                     limits::kMinBlockTokens, "..", limits::kMaxBlockTokens));
  }
  return absl::OkStatus();
}

}  // namespace

RouterCore::RouterCore(RouterOptions options)
    : options_(options), pending_(std::chrono::milliseconds(options.pending_ms)) {}

absl::Status RouterCore::Hello(const SourceHello& h, std::vector<RouterCommand>* commands) {
  if (absl::Status s = CheckHello(h); !s.ok()) return s;
  std::unique_lock lk(mu_);
  Source* existing = sources_.Find(h.source_id);
  if (existing == nullptr) {
    Source& s = sources_.Add(h, Clock::now());
    JoinFleet(s);
    Log("router", "source ", h.source_id, " (", SourceKindName(h.kind), ", ", h.endpoint,
        ", namespace ", NamespaceName(h.namespace_id), ", epoch ", h.epoch, ") registered");
    RequestSnapshot(s, "unknown source", commands);
    return absl::OkStatus();
  }
  Source& s = *existing;
  s.last_seen = Clock::now();
  const bool same_role = s.hello.kind == h.kind && s.hello.namespace_id == h.namespace_id &&
                         s.hello.block_tokens == h.block_tokens;
  if (s.hello.epoch != h.epoch || !same_role) {
    const char* why = s.hello.epoch != h.epoch ? "new epoch" : "new role";
    Log("router", "source ", h.source_id, " restarted (epoch ", s.hello.epoch, " -> ", h.epoch,
        "); its blocks are cleared");
    ClearSource(s);
    LeaveFleet(s);
    s.hello = h;
    s.last_seq = 0;
    JoinFleet(s);
    RequestSnapshot(s, why, commands);
    return absl::OkStatus();
  }
  s.hello.endpoint = h.endpoint;
  return absl::OkStatus();
}

void RouterCore::Connected(const std::string& id, bool up) {
  std::unique_lock lk(mu_);
  Source* s = sources_.Find(id);
  if (s == nullptr) return;
  s->streams += up ? 1 : -1;
  // A draining worker whose last stream closed has left (it saved what it
  // meant to; the store's own events index that): its blocks go now, not
  // at the heartbeat deadline.
  if (!up && s->streams == 0 && s->hello.kind == SourceKind::kWorker && s->load.draining) {
    Log("router", "worker ", id, " drained and left; dropped with ", s->indexed, " blocks");
    RemoveSourceLocked(id);
  }
}

void RouterCore::RequestSnapshot(Source& s, const std::string& reason,
                                 std::vector<RouterCommand>* commands) {
  s.resyncing = true;
  s.snapshot.clear();
  counters_.snapshots_requested++;
  commands->push_back({RouterCommand::Kind::kSnapshotRequest, 0, reason});
}

void RouterCore::ClearSource(Source& s) {
  if (s.indexed > 0) index_.RemoveSource(s.num);
  s.indexed = 0;
  off_gpu_.RemoveSource(s.num);
  pending_.Forget(s.num);
}

void RouterCore::JoinFleet(Source& s) {
  board_.Ensure(s.num);
  board_.load[s.num] = s.load.queued_prefill_tokens + s.routed_since_heartbeat.load();
  board_.id_hash[s.num] = s.id_hash;
  board_.occupancy[s.num] = 0;
  if (s.hello.kind == SourceKind::kStore) {
    index_.SetStore(s.num, true);
    store_nums_.push_back(s.num);
    UpdateStoreFetch();
    return;
  }
  s.slot = fleets_[s.hello.namespace_id].Join(s.num, board_);
}

void RouterCore::LeaveFleet(Source& s) {
  if (s.hello.kind == SourceKind::kStore) {
    index_.SetStore(s.num, false);
    store_nums_.erase(std::find(store_nums_.begin(), store_nums_.end(), s.num));
    UpdateStoreFetch();  // a shard that left no longer counts
    return;
  }
  SetPrefillRate(s, 0);
  pending_.Forget(s.num);
  auto it = fleets_.find(s.hello.namespace_id);
  const SourceNum moved = it->second.Leave(s.slot, s.num, board_);
  sources_.ByNum(moved)->slot = s.slot;
  if (it->second.nums.empty()) fleets_.erase(it);
}

void RouterCore::SetPrefillRate(Source& s, double tokens_per_s) {
  if (!(tokens_per_s > 0) || !std::isfinite(tokens_per_s)) tokens_per_s = 0;
  fleets_[s.hello.namespace_id].PrefillRateChanged(s.prefill_tokens_per_s, tokens_per_s);
  s.prefill_tokens_per_s = tokens_per_s;
}

void RouterCore::UpdateStoreFetch() {
  slowest_store_ = {};
  for (SourceNum num : store_nums_) {
    const Source& s = *sources_.ByNum(num);
    double us = 0, blocks = 0;
    uint32_t depth = 0;
    for (const auto& t : s.load.fetch) {
      if (t.blocks == 0 || !(t.us_per_block >= 0) || !std::isfinite(t.us_per_block)) continue;
      us += t.us_per_block * static_cast<double>(t.blocks);
      blocks += static_cast<double>(t.blocks);
      depth = std::max(depth, t.queue_depth);
    }
    if (blocks == 0) continue;
    if (us / blocks > slowest_store_.us_per_block) {
      slowest_store_ = {s.hello.source_id, us / blocks, depth};
    }
  }
}

absl::Status RouterCore::Handle(const std::string& id, const SourceMessage& m,
                                std::vector<RouterCommand>* commands) {
  if (const auto* hello = std::get_if<SourceHello>(&m)) return Hello(*hello, commands);
  std::unique_lock lk(mu_);
  Source* found = sources_.Find(id);
  if (found == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("source ", id, " is not registered (send hello first)"));
  }
  Source& s = *found;
  s.last_seen = Clock::now();
  if (const auto* e = std::get_if<BlockEvent>(&m)) {
    ApplyEvent(s, *e, commands);
  } else if (const auto* load = std::get_if<SourceLoad>(&m)) {
    Heartbeat(s, *load);
  } else if (const auto* chunk = std::get_if<SnapshotChunk>(&m)) {
    ApplySnapshotChunk(s, *chunk, commands);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("message from ", id, " carries no hello, event, heartbeat or snapshot"));
  }
  return absl::OkStatus();
}

void RouterCore::Heartbeat(Source& s, const SourceLoad& load) {
  s.load = load;
  s.heard_load = true;
  // Routes that have not reached the worker yet stay counted: those the
  // worker does not list as arrived, or without an id, those too recent.
  const auto now = Clock::now();
  const uint64_t inflight = s.InflightAfter(
      now - std::chrono::milliseconds(options_.inflight_ms),
      now - std::chrono::milliseconds(std::max<uint64_t>(options_.inflight_ms, kRouteArrivalMs)),
      load.arrived_request_ids);
  s.load.arrived_request_ids.clear();
  s.routed_since_heartbeat = inflight;
  if (s.hello.kind == SourceKind::kStore) {
    UpdateStoreFetch();
    return;
  }
  const auto at = std::find(draining_.begin(), draining_.end(), s.num);
  if (load.draining && at == draining_.end()) {
    draining_.push_back(s.num);
    Log("router", "worker ", s.hello.source_id, " is draining: no new routes go to it");
  } else if (!load.draining && at != draining_.end()) {
    draining_.erase(at);
  }
  const uint64_t before = board_.load[s.num];
  board_.load[s.num] = s.load.queued_prefill_tokens + inflight;
  UpdateOccupancy(s);
  fleets_.at(s.hello.namespace_id).LoadReported(s.num, before, board_);
  SetPrefillRate(s, s.load.prefill_tokens_per_s);
}

void RouterCore::UpdateOccupancy(Source& s) {
  if (s.hello.kind == SourceKind::kStore) return;
  // (Blocks it holds only off its GPU take no GPU page.)
  const double held = static_cast<double>(s.indexed - off_gpu_.Count(s.num));
  const double pages = held + static_cast<double>(s.load.free_gpu_pages);
  const double was = board_.occupancy[s.num];
  board_.occupancy[s.num] = pages > 0 ? held / pages : 0;
  fleets_.at(s.hello.namespace_id).OccupancyReported(was, board_.occupancy[s.num]);
}

void RouterCore::ApplyEvent(Source& s, const BlockEvent& e, std::vector<RouterCommand>* commands) {
  if (s.resyncing) return;  // the snapshot will cover it
  if (e.seq <= s.last_seq) {
    counters_.duplicate++;
    return;
  }
  if (e.seq != s.last_seq + 1) {
    RequestSnapshot(s, absl::StrCat("sequence gap: expected ", s.last_seq + 1, ", got ", e.seq),
                    commands);
    return;
  }
  s.last_seq = e.seq;
  auto reject = [&](const std::string& why) {
    counters_.rejected++;
    commands->push_back({RouterCommand::Kind::kEventRejected, e.seq, why});
  };
  if (e.kind == BlockEvent::Kind::kNone) {
    reject(absl::StrCat("event ", e.seq, " is empty (no stored, removed or cleared)"));
    return;
  }
  if (e.kind == BlockEvent::Kind::kCleared) {
    ClearSource(s);
    counters_.applied++;
    return;
  }
  if (s.hello.kind == SourceKind::kWorker && e.namespace_id != s.hello.namespace_id) {
    reject(absl::StrCat("event ", e.seq, " names namespace ", NamespaceName(e.namespace_id),
                        " but worker ", s.hello.source_id, " serves namespace ",
                        NamespaceName(s.hello.namespace_id)));
    return;
  }
  if (e.hashes.empty() || e.hashes.size() > limits::kMaxEventHashes) {
    reject(absl::StrCat("event ", e.seq, " carries ", e.hashes.size(), " hashes (allowed 1..",
                        limits::kMaxEventHashes, ")"));
    return;
  }
  if (e.kind == BlockEvent::Kind::kStored) {
    for (const BlockHash& h : e.hashes) {
      s.indexed += index_.Add(BlockKey{e.namespace_id, h}, s.num);
    }
  } else if (e.kind == BlockEvent::Kind::kMedium) {
    if (s.hello.kind != SourceKind::kWorker || e.medium > Medium::kDisk) {
      reject(absl::StrCat("event ", e.seq, " places blocks on medium ", static_cast<int>(e.medium),
                          ": only a worker's GPU, CPU or disk"));
      return;
    }
    // A block it does not hold (removed since) is on no medium of its.
    for (const BlockHash& h : e.hashes) {
      const uint64_t fp = PrefixIndex::Fingerprint(BlockKey{e.namespace_id, h});
      if (index_.Has(fp, s.num)) off_gpu_.Set(fp, s.num, e.medium);
    }
  } else {
    // A block it evicted is not pending there either.
    if (s.hello.kind == SourceKind::kWorker) pending_.Drop(e.namespace_id, s.num, e.hashes);
    const bool off_gpu = off_gpu_.Count(s.num) > 0;
    for (const BlockHash& h : e.hashes) {
      const uint64_t fp = PrefixIndex::Fingerprint(BlockKey{e.namespace_id, h});
      if (off_gpu) off_gpu_.Erase(fp, s.num);
      if (index_.Remove(fp, s.num)) {
        --s.indexed;
      } else {
        counters_.unknown_removals++;
      }
    }
  }
  counters_.applied++;
}

void RouterCore::ApplySnapshotChunk(Source& s, const SnapshotChunk& c,
                                    std::vector<RouterCommand>* commands) {
  if (c.hashes.size() > limits::kMaxEventHashes ||
      (s.hello.kind == SourceKind::kWorker && !c.hashes.empty() &&
       c.namespace_id != s.hello.namespace_id)) {
    counters_.rejected++;
    RequestSnapshot(s,
                    absl::StrCat("snapshot chunk refused (wrong namespace or over ",
                                 limits::kMaxEventHashes, " hashes)"),
                    commands);
    return;
  }
  s.resyncing = true;
  off_gpu_.RemoveSource(s.num);  // a snapshot puts every block on the GPU
  for (const BlockHash& h : c.hashes) {
    s.snapshot.push_back(PrefixIndex::Fingerprint(BlockKey{c.namespace_id, h}));
  }
  if (!c.last) return;
  if (s.indexed > 0) {
    // What the source no longer holds goes (one pass over the index).
    absl::flat_hash_set<uint64_t> fresh(s.snapshot.begin(), s.snapshot.end());
    s.indexed -= index_.RemoveSource(s.num, &fresh);
  }
  for (uint64_t fp : s.snapshot) s.indexed += index_.Add(fp, s.num);
  s.snapshot.clear();
  s.snapshot.shrink_to_fit();
  s.last_seq = c.seq;
  s.resyncing = false;
  counters_.snapshots_applied++;
  // What it holds is known now, not at its next heartbeat: a restarted
  // router would otherwise price a worker whose heartbeat came before its
  // snapshot as empty, and steer its prefixes elsewhere for a heartbeat.
  // (Before any heartbeat its free pages are unknown: it stays at 0.)
  if (s.heard_load) UpdateOccupancy(s);
}

void RouterCore::RemoveSourceLocked(const std::string& id) {
  Source* s = sources_.Find(id);
  if (s == nullptr) return;
  ClearSource(*s);
  LeaveFleet(*s);
  draining_.erase(std::remove(draining_.begin(), draining_.end(), s->num), draining_.end());
  sources_.Remove(id);
}

bool RouterCore::RemoveSource(const std::string& source_id) {
  std::unique_lock lk(mu_);
  if (sources_.Find(source_id) == nullptr) return false;
  RemoveSourceLocked(source_id);
  return true;
}

size_t RouterCore::ExpireSources(Clock::time_point now) {
  std::unique_lock lk(mu_);
  const auto dead = sources_.Silent(now, std::chrono::milliseconds(options_.heartbeat_deadline_ms));
  for (const auto& id : dead) {
    Log("router", "source ", id, " missed its heartbeat deadline (", options_.heartbeat_deadline_ms,
        " ms); dropped with ", sources_.Find(id)->indexed, " blocks");
    RemoveSourceLocked(id);
    counters_.expired++;
  }
  return dead.size();
}

std::vector<SourceInfo> RouterCore::Sources() const {
  std::shared_lock lk(mu_);
  std::vector<SourceInfo> out;
  const auto now = Clock::now();
  std::vector<uint64_t> sole;
  index_.SoleHeld(&sole);
  sources_.ForEach([&](const std::string& id, const Source& s) {
    SourceInfo i;
    i.source_id = id;
    i.kind = s.hello.kind;
    i.endpoint = s.hello.endpoint;
    i.namespace_id = s.hello.namespace_id;
    i.indexed_blocks = s.indexed;
    i.load = s.load;
    i.routed_tokens_since_heartbeat = s.routed_since_heartbeat.load();
    i.last_seen_ms = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - s.last_seen).count());
    i.epoch = s.hello.epoch;
    i.last_seq = s.last_seq;
    i.resyncing = s.resyncing;
    i.connected = s.streams > 0;
    if (s.hello.kind == SourceKind::kWorker && s.num < sole.size()) {
      i.sole_blocks = sole[s.num];
      if (s.load.prefill_tokens_per_s > 0) {
        i.sole_recompute_seconds =
            static_cast<double>(i.sole_blocks) * s.hello.block_tokens / s.load.prefill_tokens_per_s;
      }
    }
    out.push_back(std::move(i));
  });
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.source_id < b.source_id; });
  return out;
}

RouterStats RouterCore::Stats() const {
  RouterStats r;
  {
    std::shared_lock lk(mu_);
    r.indexed_blocks = index_.blocks();
    r.indexed_replicas = index_.replicas();
    r.sources = sources_.size();
  }
  r.events_applied = counters_.applied;
  r.events_duplicate = counters_.duplicate;
  r.events_rejected = counters_.rejected;
  r.snapshots_requested = counters_.snapshots_requested;
  r.snapshots_applied = counters_.snapshots_applied;
  r.sources_expired = counters_.expired;
  r.unknown_removals = counters_.unknown_removals;
  r.lowest_cost = counters_.lowest_cost;
  r.tie_break = counters_.tie_break;
  r.balance_guard = counters_.balance_guard;
  r.sampled = counters_.sampled;
  r.unavailable = counters_.unavailable;
  return r;
}

size_t RouterCore::IndexMemoryBytes() const {
  std::shared_lock lk(mu_);
  return index_.MemoryBytes() + off_gpu_.MemoryBytes();
}

}  // namespace kvtier::router
