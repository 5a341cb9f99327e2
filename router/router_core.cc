#include "router/router_core.h"

#include <xxhash.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>

#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_key.h"
#include "common/log.h"
#include "common/rpc/proto_convert.h"

namespace kvtier::router {

absl::Status RouterOptions::Validate() const {
  if (heartbeat_deadline_ms == 0) {
    return absl::InvalidArgumentError("flag --heartbeat-deadline must be above 0");
  }
  if (!(knobs.fetch_cost >= 0)) return absl::InvalidArgumentError("flag --fetch-cost must be >= 0");
  if (!(knobs.load_weight >= 0)) {
    return absl::InvalidArgumentError("flag --load-weight must be >= 0");
  }
  if (!(knobs.temperature >= 0)) {
    return absl::InvalidArgumentError("flag --temperature must be >= 0");
  }
  return absl::OkStatus();
}

namespace {

v1::RouterCommand Rejected(uint64_t seq, const std::string& reason) {
  v1::RouterCommand c;
  c.mutable_event_rejected()->set_seq(seq);
  c.mutable_event_rejected()->set_reason(reason);
  return c;
}

const char* KindName(v1::SourceKind k) { return k == v1::SOURCE_STORE ? "store" : "worker"; }

}  // namespace

RouterCore::RouterCore(RouterOptions options) : options_(options) {}

absl::Status RouterCore::Hello(const v1::Hello& h, std::vector<v1::RouterCommand>* commands) {
  if (h.source_id().empty() || h.source_id().size() > 256) {
    return absl::InvalidArgumentError("hello: source_id must be 1..256 bytes");
  }
  if (h.kind() != v1::SOURCE_WORKER && h.kind() != v1::SOURCE_STORE) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello from ", h.source_id(), ": kind must be SOURCE_WORKER or SOURCE_STORE"));
  }
  if (h.kind() == v1::SOURCE_WORKER) {
    if (h.endpoint().empty() || h.endpoint().size() > 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("hello from worker ", h.source_id(), ": endpoint must be 1..256 bytes"));
    }
    if (h.namespace_id() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("hello from worker ", h.source_id(), ": namespace_id is missing"));
    }
    if (h.block_tokens() < limits::kMinBlockTokens || h.block_tokens() > limits::kMaxBlockTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("hello from worker ", h.source_id(), ": block_tokens must be ",
                       limits::kMinBlockTokens, "..", limits::kMaxBlockTokens));
    }
  }
  std::unique_lock lk(mu_);
  auto it = sources_.find(h.source_id());
  if (it == sources_.end()) {
    auto s = std::make_unique<Source>();
    if (free_nums_.empty()) {
      s->num = static_cast<SourceNum>(by_num_.size());
      by_num_.push_back(nullptr);
    } else {
      s->num = free_nums_.back();
      free_nums_.pop_back();
    }
    s->hello = h;
    s->id_hash = WorkerIdHash(h.source_id());
    s->last_seen = Clock::now();
    by_num_[s->num] = s.get();
    Source& ref = *s;
    sources_.emplace(h.source_id(), std::move(s));
    JoinFleet(ref);
    Log("router", "source ", h.source_id(), " (", KindName(h.kind()), ", ", h.endpoint(),
        ", namespace ", NamespaceName(h.namespace_id()), ", epoch ", h.epoch(), ") registered");
    RequestSnapshot(ref, "unknown source", commands);
    return absl::OkStatus();
  }
  Source& s = *it->second;
  s.last_seen = Clock::now();
  bool same_role = s.hello.kind() == h.kind() && s.hello.namespace_id() == h.namespace_id() &&
                   s.hello.block_tokens() == h.block_tokens();
  if (s.hello.epoch() != h.epoch() || !same_role) {
    const char* why = s.hello.epoch() != h.epoch() ? "new epoch" : "new role";
    Log("router", "source ", h.source_id(), " restarted (epoch ", s.hello.epoch(), " -> ",
        h.epoch(), "); its blocks are cleared");
    ClearSource(s);
    LeaveFleet(s);
    s.hello = h;
    s.last_seq = 0;
    JoinFleet(s);
    RequestSnapshot(s, why, commands);
    return absl::OkStatus();
  }
  s.hello.set_endpoint(h.endpoint());
  return absl::OkStatus();
}

void RouterCore::Connected(const std::string& id, bool up) {
  std::unique_lock lk(mu_);
  auto it = sources_.find(id);
  if (it != sources_.end()) it->second->streams += up ? 1 : -1;
}

void RouterCore::RequestSnapshot(Source& s, const std::string& reason,
                                 std::vector<v1::RouterCommand>* commands) {
  s.resyncing = true;
  s.snapshot.clear();
  counters_.snapshots_requested++;
  v1::RouterCommand c;
  c.mutable_snapshot_request()->set_reason(reason);
  commands->push_back(std::move(c));
}

void RouterCore::ClearSource(Source& s) {
  if (s.indexed > 0) index_.RemoveSource(s.num);
  s.indexed = 0;
}

void RouterCore::JoinFleet(Source& s) {
  if (s.num >= load_.size()) {
    load_.resize(s.num + 1, 0);
    id_hash_.resize(s.num + 1, 0);
    lowered_.resize(s.num + 1, 0);
  }
  load_[s.num] = s.load.queued_prefill_tokens() + s.routed_since_heartbeat.load();
  id_hash_[s.num] = s.id_hash;
  if (s.hello.kind() == v1::SOURCE_STORE) {
    index_.SetStore(s.num, true);
    store_nums_.push_back(s.num);
    UpdateStoreFetch();
    return;
  }
  Fleet& f = fleets_[s.hello.namespace_id()];
  s.slot = f.nums.size();
  f.nums.push_back(s.num);
  RebuildOrder(f);
}

void RouterCore::RebuildOrder(Fleet& f) {
  f.order.clear();
  f.max_load_bound = 0;
  for (SourceNum n : f.nums) {
    f.order.emplace_back(load_[n], n);
    if (load_[n] >= f.max_load_bound) {
      f.max_load_bound = load_[n];
      f.max_load_owner = n;
    }
  }
  std::sort(f.order.begin(), f.order.end());
  for (SourceNum n : f.lowered) lowered_[n] = 0;
  f.lowered.clear();
}

void RouterCore::SetPrefillRate(Source& s, double tokens_per_s) {
  if (!(tokens_per_s > 0) || !std::isfinite(tokens_per_s)) tokens_per_s = 0;
  Fleet& f = fleets_[s.hello.namespace_id()];
  if (s.prefill_tokens_per_s > 0) {
    f.prefill_sum -= s.prefill_tokens_per_s;
    f.prefill_count--;
  }
  s.prefill_tokens_per_s = tokens_per_s;
  if (tokens_per_s > 0) {
    f.prefill_sum += tokens_per_s;
    f.prefill_count++;
  }
  if (f.prefill_count == 0) f.prefill_sum = 0;  // no drift from rounding
}

void RouterCore::UpdateStoreFetch() {
  slowest_store_ = {};
  for (SourceNum num : store_nums_) {
    const Source& s = *by_num_[num];
    double us = 0, blocks = 0;
    uint32_t depth = 0;
    for (const auto& t : s.load.fetch()) {
      if (t.blocks() == 0 || !(t.us_per_block() >= 0) || !std::isfinite(t.us_per_block())) continue;
      us += t.us_per_block() * static_cast<double>(t.blocks());
      blocks += static_cast<double>(t.blocks());
      depth = std::max(depth, t.queue_depth());
    }
    if (blocks == 0) continue;
    if (us / blocks > slowest_store_.us_per_block) {
      slowest_store_ = {s.hello.source_id(), us / blocks, depth};
    }
  }
}

void RouterCore::LeaveFleet(Source& s) {
  if (s.hello.kind() == v1::SOURCE_STORE) {
    index_.SetStore(s.num, false);
    store_nums_.erase(std::find(store_nums_.begin(), store_nums_.end(), s.num));
    UpdateStoreFetch();  // a shard that left no longer counts
    return;
  }
  SetPrefillRate(s, 0);
  auto it = fleets_.find(s.hello.namespace_id());
  Fleet& f = it->second;
  const SourceNum moved = f.nums.back();
  f.nums[s.slot] = moved;
  by_num_[moved]->slot = s.slot;
  f.nums.pop_back();
  lowered_[s.num] = 0;
  if (f.nums.empty()) {
    fleets_.erase(it);
  } else {
    RebuildOrder(f);
  }
}

absl::Status RouterCore::Handle(const std::string& id, const v1::SourceMessage& m,
                                std::vector<v1::RouterCommand>* commands) {
  if (m.message_case() == v1::SourceMessage::kHello) return Hello(m.hello(), commands);
  std::unique_lock lk(mu_);
  auto it = sources_.find(id);
  if (it == sources_.end()) {
    return absl::NotFoundError(
        absl::StrCat("source ", id, " is not registered (send hello first)"));
  }
  Source& s = *it->second;
  s.last_seen = Clock::now();
  switch (m.message_case()) {
    case v1::SourceMessage::kEvent:
      ApplyEvent(s, m.event(), commands);
      return absl::OkStatus();
    case v1::SourceMessage::kHeartbeat: {
      s.load = m.heartbeat();
      // Routes too recent to have reached the worker stay counted.
      uint64_t inflight = 0;
      {
        std::lock_guard rl(s.routes_mu);
        const auto cutoff = Clock::now() - std::chrono::milliseconds(options_.inflight_ms);
        while (!s.recent_routes.empty() && s.recent_routes.front().first < cutoff) {
          s.recent_routes.pop_front();
        }
        for (const auto& [when, tokens] : s.recent_routes) inflight += tokens;
      }
      s.routed_since_heartbeat = inflight;
      if (s.hello.kind() == v1::SOURCE_STORE) {
        UpdateStoreFetch();
      } else {
        const uint64_t before = load_[s.num];
        load_[s.num] = s.load.queued_prefill_tokens() + inflight;
        Fleet& f = fleets_.at(s.hello.namespace_id());
        if (load_[s.num] >= f.max_load_bound) {
          f.max_load_bound = load_[s.num];
          f.max_load_owner = s.num;
        }
        if (load_[s.num] < before && !lowered_[s.num]) {
          lowered_[s.num] = 1;
          f.lowered.push_back(s.num);
          // Past a sixteenth of the fleet, sorting afresh is cheaper.
          if (f.lowered.size() > 64 + f.nums.size() / 16) RebuildOrder(f);
        }
        SetPrefillRate(s, s.load.prefill_tokens_per_s());
      }
      return absl::OkStatus();
    }
    case v1::SourceMessage::kSnapshot:
      ApplySnapshotChunk(s, m.snapshot(), commands);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("message from ", id, " carries no hello, event, heartbeat or snapshot"));
  }
}

void RouterCore::ApplyEvent(Source& s, const v1::KvEvent& e,
                            std::vector<v1::RouterCommand>* commands) {
  if (s.resyncing) return;  // the snapshot will cover it
  if (e.seq() <= s.last_seq) {
    counters_.duplicate++;
    return;
  }
  if (e.seq() != s.last_seq + 1) {
    RequestSnapshot(s, absl::StrCat("sequence gap: expected ", s.last_seq + 1, ", got ", e.seq()),
                    commands);
    return;
  }
  s.last_seq = e.seq();
  auto reject = [&](const std::string& why) {
    counters_.rejected++;
    commands->push_back(Rejected(e.seq(), why));
  };
  auto check = [&](uint64_t ns, int count) -> bool {
    if (s.hello.kind() == v1::SOURCE_WORKER && ns != s.hello.namespace_id()) {
      reject(absl::StrCat("event ", e.seq(), " names namespace ", NamespaceName(ns), " but worker ",
                          s.hello.source_id(), " serves namespace ",
                          NamespaceName(s.hello.namespace_id())));
      return false;
    }
    if (count == 0 || static_cast<size_t>(count) > kMaxEventHashes) {
      reject(absl::StrCat("event ", e.seq(), " carries ", count, " hashes (allowed 1..",
                          kMaxEventHashes, ")"));
      return false;
    }
    return true;
  };
  switch (e.event_case()) {
    case v1::KvEvent::kStored:
      if (!check(e.stored().namespace_id(), e.stored().hashes_size())) return;
      for (const auto& h : e.stored().hashes()) {
        s.indexed += index_.Add(BlockKey{e.stored().namespace_id(), FromProto(h)}, s.num);
      }
      break;
    case v1::KvEvent::kRemoved:
      if (!check(e.removed().namespace_id(), e.removed().hashes_size())) return;
      for (const auto& h : e.removed().hashes()) {
        if (index_.Remove(BlockKey{e.removed().namespace_id(), FromProto(h)}, s.num)) {
          --s.indexed;
        } else {
          counters_.unknown_removals++;
        }
      }
      break;
    case v1::KvEvent::kCleared:
      ClearSource(s);
      break;
    default:
      reject(absl::StrCat("event ", e.seq(), " is empty (no stored, removed or cleared)"));
      return;
  }
  counters_.applied++;
}

void RouterCore::ApplySnapshotChunk(Source& s, const v1::SnapshotChunk& c,
                                    std::vector<v1::RouterCommand>* commands) {
  if (c.hashes_size() > static_cast<int>(kMaxEventHashes) ||
      (s.hello.kind() == v1::SOURCE_WORKER && c.hashes_size() > 0 &&
       c.namespace_id() != s.hello.namespace_id())) {
    counters_.rejected++;
    RequestSnapshot(s,
                    absl::StrCat("snapshot chunk refused (wrong namespace or over ",
                                 kMaxEventHashes, " hashes)"),
                    commands);
    return;
  }
  s.resyncing = true;
  for (const auto& h : c.hashes()) {
    s.snapshot.push_back(PrefixIndex::Fingerprint(BlockKey{c.namespace_id(), FromProto(h)}));
  }
  if (!c.last()) return;
  if (s.indexed > 0) {
    // What the source no longer holds goes (one pass over the index).
    absl::flat_hash_set<uint64_t> fresh(s.snapshot.begin(), s.snapshot.end());
    s.indexed -= index_.RemoveSource(s.num, &fresh);
  }
  for (uint64_t fp : s.snapshot) s.indexed += index_.Add(fp, s.num);
  s.snapshot.clear();
  s.snapshot.shrink_to_fit();
  s.last_seq = c.seq();
  s.resyncing = false;
  counters_.snapshots_applied++;
}

absl::StatusOr<RouteResult> RouterCore::Route(const v1::RouteRequest& req) {
  if (req.max_candidates() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("route: max_candidates is ", req.max_candidates(), " (allowed 0..1024)"));
  }
  const size_t shown =
      req.max_candidates() > 0 ? req.max_candidates() : options_.default_candidates;
  std::shared_lock lk(mu_);
  auto fleet_it = fleets_.find(req.namespace_id());
  if (fleet_it == fleets_.end()) {
    counters_.unavailable++;
    return absl::UnavailableError(absl::StrCat("no live worker serves namespace ",
                                               NamespaceName(req.namespace_id()), " (",
                                               sources_.size(), " sources registered)"));
  }
  const Fleet& fleet = fleet_it->second;
  const uint32_t bt = by_num_[fleet.nums[0]]->hello.block_tokens();
  // A chain of hashes is read in place: a match probes only ~log n of them.
  ChainView chain;
  std::vector<BlockHash> hashed;
  uint64_t prompt_tokens = 0;
  if (req.prompt_case() == v1::RouteRequest::kHashes) {
    const auto& hs = req.hashes().hashes();
    auto tokens = HashedPromptTokens(hs.size(), req.prompt_tokens(), bt, "route");
    if (!tokens.ok()) return tokens.status();
    prompt_tokens = *tokens;
    chain = ChainView(&hs, hs.size(), [](const void* ctx, size_t i) {
      using Hashes = google::protobuf::RepeatedPtrField<v1::BlockHash>;
      return FromProto((*static_cast<const Hashes*>(ctx))[static_cast<int>(i)]);
    });
  } else {
    auto prompt = PromptFromRequest(req, req.namespace_id(), bt, "route");
    if (!prompt.ok()) return prompt.status();
    hashed = std::move(prompt->chain);
    prompt_tokens = prompt->prompt_tokens;
    chain = ChainView(hashed);
  }
  uint64_t request_hash = 0;
  if (chain.empty()) {
    // A prompt shorter than one block has no chain to key the sampling on.
    const auto& ids = req.tokens().ids();
    request_hash = XXH3_64bits(ids.data(), ids.size() * sizeof(uint32_t));
  }

  PrefixMatch match;
  if (options_.linear_match) {
    index_.MatchLinear(req.namespace_id(), chain, &match);
  } else {
    index_.Match(req.namespace_id(), chain, &match, /*groups=*/!options_.scan_all_workers);
  }
  if (!chain.empty()) {
    const BlockHash h = chain[match.deepest >= 0 ? match.deepest : chain.size() - 1];
    request_hash = h.hi ^ (h.lo * 0x9E3779B97F4A7C15ull);
  }
  // Every worker is weighed, in one pass over those holding part of the
  // prompt and one over the rest (skipped when every worker holds some).
  // Workers at the same depth differ only in load, so the pass keeps just
  // the `keep` cheapest (the highest rendezvous rank first among equals:
  // the tie-break's winner is among them), the least loaded (the balance
  // guard's pick) and the highest load; Decide then chooses among those.
  CostKnobs k = options_.knobs;
  // Sampling draws among a fixed number of the cheapest, whatever the
  // response lists, so a request is routed the same way by every caller.
  const size_t keep = k.temperature > 0 ? kSampledCandidates : std::max<size_t>(shown, 1);
  // Fetching priced from measurement when there is one: the slowest store
  // shard's time per block against the namespace's prefill rate.
  FetchBasis basis{k.fetch_cost, false, {}, 0, 0, 0};
  if (slowest_store_.us_per_block > 0 && fleet.prefill_count > 0) {
    basis.prefill_tokens_per_s = fleet.prefill_sum / fleet.prefill_count;
    basis.store_id = slowest_store_.id;
    basis.store_us_per_block = slowest_store_.us_per_block;
    basis.store_queue_depth = slowest_store_.queue_depth;
    basis.fetch_cost = std::min(
        kMaxFetchCost, slowest_store_.us_per_block * 1e-6 * basis.prefill_tokens_per_s / bt);
    basis.measured = true;
    k.fetch_cost = basis.fetch_cost;
  }
  struct Pick {
    double cost;
    uint64_t load, rank;
    SourceNum num;
    uint32_t depth;
  };
  absl::InlinedVector<Pick, 8> top;  // cheapest first
  Pick least{0, ~uint64_t{0}, 0, 0, 0};
  bool have_least = false;
  uint64_t max_load = 0;
  uint32_t base_depth = ~0u;
  double base = 0;
  // A worker costlier than the `keep`-th cheapest and busier than the least
  // loaded so far is out: the hot loop tests just that.
  double reject_cost = std::numeric_limits<double>::infinity();
  uint64_t reject_load = ~uint64_t{0};
  uint64_t reject_rank = 0;  // top.back().rank once the list is full
  auto admit = [&](SourceNum num, uint32_t depth, uint64_t load, double cost) {
    // A worker met twice (in two groups: only where holes break the
    // invariant) is kept once in the list.
    if (!match.groups.empty()) {
      for (const Pick& t : top) {
        if (t.num == num) return;
      }
    }
    const Pick p{cost, load, RendezvousRank(request_hash, id_hash_[num]), num, depth};
    if (load <= least.load && (!have_least || load < least.load || p.rank > least.rank)) {
      least = p;
      have_least = true;
      reject_load = load;
    }
    auto cheaper = [](const Pick& a, const Pick& b) {
      return a.cost != b.cost ? a.cost < b.cost : a.rank > b.rank;
    };
    if (top.size() == keep) {
      if (!cheaper(p, top.back())) return;
      top.pop_back();
    }
    top.insert(std::upper_bound(top.begin(), top.end(), p, cheaper), p);
    if (top.size() == keep) {
      reject_cost = top.back().cost;
      reject_rank = top.back().rank;
    }
  };
  auto base_at = [&](uint32_t depth) {  // the cost of the prompt's blocks at a depth
    const uint64_t cached = std::min<uint64_t>(uint64_t{depth} * bt, prompt_tokens);
    const uint64_t fetched =
        std::min<uint64_t>(uint64_t{match.StoreRun(depth)} * bt, prompt_tokens - cached);
    return static_cast<double>(prompt_tokens - cached - fetched) +
           k.fetch_cost * static_cast<double>(fetched);
  };
  const double lw = k.load_weight;
  const bool stop_early = !options_.scan_all_workers;
  auto load_at = [&](SourceNum num) {
    return std::atomic_ref<uint64_t>(load_[num]).load(std::memory_order_relaxed);
  };
  // (Blocks are keyed with their namespace: only the request's workers hold them.)
  for (const auto& [num, depth] : match.gpu_depth) {
    if (depth != base_depth) {
      base_depth = depth;
      base = base_at(depth);
    }
    const uint64_t load = load_at(num);
    max_load = std::max(max_load, load);
    const double cost = base + lw * static_cast<double>(load);
    if (cost > reject_cost && load > reject_load) continue;
    admit(num, depth, load, cost);
  }
  // The rest in load order: once a worker's load as of the last sort is
  // both costlier than the cheapest kept and above the least loaded, so is
  // everyone's after it (loads only grew since, but for the lowered ones,
  // looked at apart). Each group of workers too many to name (a prefix most
  // of the fleet holds) is walked that way at its depth, then the workers
  // holding nothing of the prompt.
  bool walked_all = match.groups.empty();
  // With groups the cold walk always runs: their counts are exact only when
  // the invariant holds, and a worker skipped here would never be weighed.
  // It stops at the first worker above the least loaded found so far.
  const bool all_named = match.groups.empty() && match.gpu_depth.size() >= fleet.nums.size();
  if (!all_named) {
    // (A thread_local is reached through a wrapper call on every use: the
    // walk's loop uses a plain reference.)
    thread_local std::vector<uint8_t> hit_marks;
    std::vector<uint8_t>& hit = hit_marks;
    if (hit.size() < by_num_.size()) hit.resize(by_num_.size(), 0);
    for (const auto& [num, depth] : match.gpu_depth) hit[num] = 1;
    auto walk = [&](uint32_t depth, auto&& member) {
      base = base_at(depth);
      auto look = [&](SourceNum num) {
        const uint64_t load = load_at(num);
        max_load = std::max(max_load, load);
        const double cost = base + lw * static_cast<double>(load);
        if (load > reject_load && cost > reject_cost) return;
        admit(num, depth, load, cost);
      };
      for (SourceNum num : fleet.lowered) {
        if (!hit[num] && member(num)) look(num);
      }
      const uint8_t* lowered = lowered_.data();
      const auto& order = fleet.order;
      for (size_t i = 0; i < order.size(); ++i) {
        const auto [was, num] = order[i];
        if (was > reject_load && stop_early && base + lw * static_cast<double>(was) > reject_cost) {
          walked_all = false;
          break;
        }
        if (!hit[num] && !lowered[num] && member(num)) look(num);
        // A run of ties (an idle fleet's cold workers): while the least
        // loaded and the keep-th cheapest both sit at load L and its cost,
        // and any higher load costs more, a worker at L gets in only with a
        // higher rank and a busier one not at all. That takes one hash per
        // worker; anything else goes back to the loop above.
        if (!match.groups.empty() || !have_least || top.size() != keep) continue;
        const uint64_t tie = reject_load;
        const double tie_cost = base + lw * static_cast<double>(tie);
        if (tie_cost != reject_cost || !(base + lw * static_cast<double>(tie + 1) > reject_cost)) {
          continue;
        }
        uint64_t rank_to_beat = std::min(least.rank, reject_rank);
        size_t j = i + 1;
        for (; j < order.size(); ++j) {
          const SourceNum other = order[j].second;
          if (order[j].first > tie) break;  // (not looked at: the loop above takes it)
          if (hit[other] || lowered[other]) continue;
          const uint64_t load = load_at(other);
          max_load = std::max(max_load, load);
          if (load > tie) continue;
          if (load < tie) break;
          if (RendezvousRank(request_hash, id_hash_[other]) <= rank_to_beat) continue;
          admit(other, depth, load, tie_cost);
          if (reject_load != tie || reject_cost != tie_cost) {
            ++j;
            break;
          }
          rank_to_beat = std::min(least.rank, reject_rank);
        }
        i = j - 1;
      }
    };
    for (const auto& g : match.groups) {
      walk(g.depth, [&](SourceNum num) { return index_.InGroup(g, num); });
    }
    {
      walk(0, [&](SourceNum num) {
        for (const auto& g : match.groups) {
          if (index_.InGroup(g, num)) return false;
        }
        return true;
      });
    }
    for (const auto& [num, depth] : match.gpu_depth) hit[num] = 0;
  }
  // The balance guard compares the highest load with the lowest: the bound
  // decides it unless the spread might exceed the threshold, when the
  // loads not looked at are read.
  if (!walked_all) {
    const uint64_t bound = std::atomic_ref<uint64_t>(const_cast<uint64_t&>(fleet.max_load_bound))
                               .load(std::memory_order_relaxed);
    const uint64_t least_load = have_least ? least.load : 0;
    const SourceNum owner = std::atomic_ref<uint32_t>(const_cast<uint32_t&>(fleet.max_load_owner))
                                .load(std::memory_order_relaxed);
    if (owner < load_.size() && load_at(owner) >= bound) {
      max_load = std::max(max_load, load_at(owner));  // the bound is someone's load: exact
    } else if (k.balance_threshold_tokens > 0 &&
               bound - std::min(bound, least_load) > k.balance_threshold_tokens) {
      // Decide asks only whether the spread passes the threshold: stop
      // reading once it does.
      for (SourceNum num : fleet.nums) {
        if (max_load - std::min(max_load, least_load) > k.balance_threshold_tokens) break;
        max_load = std::max(max_load, load_at(num));
      }
    } else {
      max_load = std::max(max_load, bound);  // within the threshold either way
    }
  }
  std::vector<Candidate> cands;
  cands.reserve(top.size() + 1);
  auto add = [&](const Pick& p) {
    Candidate c;
    c.worker_id = by_num_[p.num]->hello.source_id();
    c.id_hash = id_hash_[p.num];
    c.num = p.num;
    c.gpu_blocks = p.depth;
    c.store_blocks = match.StoreRun(p.depth);
    c.load_tokens = p.load;
    cands.push_back(c);
  };
  for (const Pick& p : top) add(p);
  if (have_least &&
      std::none_of(top.begin(), top.end(), [&](const Pick& p) { return p.num == least.num; })) {
    add(least);
  }
  // Deciding and adding the request to its worker's load is one step among
  // concurrent routes: each decides on the loads the others left (a burst
  // decided on the same loads would all go to the same worker). The
  // candidates' loads are read again under the lock; the search above
  // needs none.
  std::unique_lock decide(decide_mu_);
  if (!req.dry_run()) {
    for (Candidate& c : cands) {
      c.load_tokens = std::atomic_ref<uint64_t>(load_[c.num]).load(std::memory_order_relaxed);
      max_load = std::max(max_load, c.load_tokens);
    }
  }
  Decision d = Decide(k, prompt_tokens, bt, request_hash, cands, max_load);
  RouteResult r;
  const Candidate& best = cands[d.chosen];
  Source* chosen = by_num_[best.num];
  // A dry run (kvctl route) explains a decision without making it: the
  // worker's load and the decision counters stay as they were.
  if (!req.dry_run()) {
    chosen->routed_since_heartbeat += best.prefill_tokens;
    if (options_.inflight_ms > 0) {
      std::lock_guard rl(chosen->routes_mu);
      chosen->recent_routes.emplace_back(Clock::now(), best.prefill_tokens);
      // Bounded: a worker whose heartbeats stopped keeps no more than this.
      if (chosen->recent_routes.size() > 4096) chosen->recent_routes.pop_front();
    }
    const uint64_t now_load = std::atomic_ref<uint64_t>(load_[best.num])
                                  .fetch_add(best.prefill_tokens, std::memory_order_relaxed) +
                              best.prefill_tokens;
    std::atomic_ref<uint64_t> bound(const_cast<uint64_t&>(fleet.max_load_bound));
    for (uint64_t b = bound.load(std::memory_order_relaxed); b < now_load;) {
      if (bound.compare_exchange_weak(b, now_load, std::memory_order_relaxed)) {
        std::atomic_ref<uint32_t>(const_cast<uint32_t&>(fleet.max_load_owner))
            .store(best.num, std::memory_order_relaxed);
        break;
      }
    }
  }
  decide.unlock();
  r.worker_id = best.worker_id;
  r.endpoint = chosen->hello.endpoint();
  r.gpu_blocks = best.gpu_blocks;
  r.store_blocks = best.store_blocks;
  r.prefill_tokens = best.prefill_tokens;
  r.block_tokens = bt;
  r.reason = d.reason;
  r.fetch = basis;
  if (!req.dry_run()) {
    switch (d.reason) {
      case Reason::kLowestCost:
        counters_.lowest_cost++;
        break;
      case Reason::kTieBreak:
        counters_.tie_break++;
        break;
      case Reason::kBalanceGuard:
        counters_.balance_guard++;
        break;
      case Reason::kSampled:
        counters_.sampled++;
        break;
    }
  }
  // The chosen worker first if sampling or the balance guard passed over
  // cheaper ones, then the cheapest.
  auto show = [&](const Candidate& c) {
    r.candidates.push_back(RouteCandidate{std::string(c.worker_id), c.gpu_blocks, c.store_blocks,
                                          c.load_tokens, c.prefill_tokens, k.fetch_cost, c.cost});
  };
  const bool chosen_shown = d.chosen < shown;
  for (size_t i = 0; i < cands.size() && r.candidates.size() < shown; ++i) {
    if (!chosen_shown && r.candidates.size() + 1 == shown) {
      show(cands[d.chosen]);
      break;
    }
    show(cands[i]);
  }
  return r;
}

void RouterCore::RemoveSourceLocked(const std::string& id) {
  auto it = sources_.find(id);
  if (it == sources_.end()) return;
  Source& s = *it->second;
  ClearSource(s);
  LeaveFleet(s);
  by_num_[s.num] = nullptr;
  free_nums_.push_back(s.num);
  sources_.erase(it);
}

size_t RouterCore::ExpireSources(Clock::time_point now) {
  std::unique_lock lk(mu_);
  std::vector<std::string> dead;
  const auto deadline = std::chrono::milliseconds(options_.heartbeat_deadline_ms);
  for (const auto& [id, s] : sources_) {
    if (now - s->last_seen > deadline) dead.push_back(id);
  }
  for (const auto& id : dead) {
    Log("router", "source ", id, " missed its heartbeat deadline (", options_.heartbeat_deadline_ms,
        " ms); dropped with ", sources_.at(id)->indexed, " blocks");
    RemoveSourceLocked(id);
    counters_.expired++;
  }
  return dead.size();
}

std::vector<v1::SourceInfo> RouterCore::Sources() const {
  std::shared_lock lk(mu_);
  std::vector<v1::SourceInfo> out;
  auto now = Clock::now();
  for (const auto& [id, s] : sources_) {
    v1::SourceInfo i;
    i.set_source_id(id);
    i.set_kind(s->hello.kind());
    i.set_endpoint(s->hello.endpoint());
    i.set_namespace_id(s->hello.namespace_id());
    i.set_indexed_blocks(s->indexed);
    *i.mutable_load() = s->load;
    i.set_routed_tokens_since_heartbeat(s->routed_since_heartbeat.load());
    i.set_last_seen_ms(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - s->last_seen).count()));
    i.set_epoch(s->hello.epoch());
    i.set_last_seq(s->last_seq);
    i.set_resyncing(s->resyncing);
    i.set_connected(s->streams > 0);
    out.push_back(std::move(i));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.source_id() < b.source_id(); });
  return out;
}

v1::GetRouterStatsResponse RouterCore::Stats() const {
  v1::GetRouterStatsResponse r;
  {
    std::shared_lock lk(mu_);
    r.set_indexed_blocks(index_.blocks());
    r.set_indexed_replicas(index_.replicas());
    r.set_sources(sources_.size());
  }
  r.set_events_applied(counters_.applied);
  r.set_events_duplicate(counters_.duplicate);
  r.set_events_rejected(counters_.rejected);
  r.set_snapshots_requested(counters_.snapshots_requested);
  r.set_snapshots_applied(counters_.snapshots_applied);
  r.set_sources_expired(counters_.expired);
  r.set_unknown_removals(counters_.unknown_removals);
  auto& d = *r.mutable_decisions();
  d["lowest_cost"] = counters_.lowest_cost;
  d["tie_break"] = counters_.tie_break;
  d["balance_guard"] = counters_.balance_guard;
  d["sampled"] = counters_.sampled;
  d["unavailable"] = counters_.unavailable;
  return r;
}

size_t RouterCore::IndexMemoryBytes() const {
  std::shared_lock lk(mu_);
  return index_.MemoryBytes();
}

}  // namespace kvtier::router
