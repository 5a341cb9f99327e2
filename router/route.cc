// RouterCore::Route: the prompt's chain, its match in the index, the fetch
// price, the candidate walk (router/candidate_walk.h) and the decision
// (router/cost.h), which adds the request to the chosen worker's load.
#include <xxhash.h>

#include <algorithm>
#include <mutex>
#include <shared_mutex>

#include "absl/strings/str_cat.h"
#include "router/router_core.h"

namespace kvtier::router {

absl::StatusOr<RouteResult> RouterCore::Route(const RouteQuery& q) {
  if (q.max_candidates > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("route: max_candidates is ", q.max_candidates, " (allowed 0..1024)"));
  }
  const size_t shown = q.max_candidates > 0 ? q.max_candidates : options_.default_candidates;
  std::shared_lock lk(mu_);
  auto fleet_it = fleets_.find(q.namespace_id);
  if (fleet_it == fleets_.end()) {
    counters_.unavailable++;
    return absl::UnavailableError(absl::StrCat("no live worker serves namespace ",
                                               NamespaceName(q.namespace_id), " (", sources_.size(),
                                               " sources registered)"));
  }
  Fleet& fleet = fleet_it->second;
  const uint32_t bt = sources_.ByNum(fleet.nums[0])->hello.block_tokens;
  // A chain of hashes is read in place: a match probes only ~log n of them.
  ChainView chain;
  std::vector<BlockHash> hashed;
  uint64_t prompt_tokens = 0;
  switch (q.prompt) {
    case RouteQuery::Prompt::kHashes: {
      auto tokens = HashedPromptTokens(q.hashes.size(), q.prompt_tokens, bt, "route");
      if (!tokens.ok()) return tokens.status();
      prompt_tokens = *tokens;
      chain = q.hashes;
      break;
    }
    case RouteQuery::Prompt::kTokens: {
      auto prompt = ChainFromTokens(q.namespace_id, q.tokens, bt, "route", q.variant);
      if (!prompt.ok()) return prompt.status();
      hashed = std::move(prompt->chain);
      prompt_tokens = prompt->prompt_tokens;
      chain = ChainView(hashed);
      break;
    }
    case RouteQuery::Prompt::kNone:
      return absl::InvalidArgumentError("route: the prompt is empty (give tokens or hashes)");
  }
  uint64_t request_hash = 0;
  if (chain.empty()) {
    // A prompt shorter than one block has no chain to key the sampling on.
    request_hash = XXH3_64bits(q.tokens.data(), q.tokens.size() * sizeof(uint32_t));
  }
  PrefixMatch match;
  if (options_.linear_match) {
    index_.MatchLinear(q.namespace_id, chain, &match);
  } else {
    index_.Match(q.namespace_id, chain, &match, /*groups=*/!options_.scan_all_workers);
  }
  if (options_.pending_ms > 0) {
    pending_.Deepen(q.namespace_id, chain, PendingRoutes::StrideFor(bt), index_, &match,
                    Clock::now());
  }
  if (!chain.empty()) {
    // The prompt's last block names the whole prompt: prompts that share a
    // prefix (a system prompt every worker holds) and differ after it
    // spread over the workers tied on that prefix.
    const BlockHash h = chain[chain.size() - 1];
    request_hash = h.hi ^ (h.lo * 0x9E3779B97F4A7C15ull);
  }
  CostKnobs k = options_.knobs;
  // Fetching priced from measurement when there is one: the slowest store
  // shard's time per block against the namespace's prefill rate.
  FetchBasis basis{k.fetch_cost, false, {}, 0, 0, 0};
  if (slowest_store_.us_per_block > 0 && fleet.prefill_count > 0) {
    basis.prefill_tokens_per_s = fleet.MeanPrefillRate();
    basis.store_id = slowest_store_.id;
    basis.store_us_per_block = slowest_store_.us_per_block;
    basis.store_queue_depth = slowest_store_.queue_depth;
    basis.fetch_cost = std::min(
        kMaxFetchCost, slowest_store_.us_per_block * 1e-6 * basis.prefill_tokens_per_s / bt);
    basis.measured = true;
    k.fetch_cost = basis.fetch_cost;
  }
  // Pages a store can give back are what the occupancy term prices (none
  // while it knows no store), at occupancy_weight fetches a token, a fetch
  // at most the configured fetch cost: a measured one above it (an idle
  // store's fetches include their lease's release delay: 1.35 was seen on
  // loopback) would make an idle worker a little fuller than the mean cost
  // more than another's queue of thousands of tokens.
  OccupancyTerm occupancy;
  if (StoresKnown()) {
    occupancy.price_per_token =
        k.occupancy_weight * std::min(k.fetch_cost, options_.knobs.fetch_cost);
    occupancy.fleet_mean = fleet.MeanOccupancy();
  }
  WalkInput in;
  in.index = &index_;
  in.match = &match;
  in.fleet = &fleet;
  in.board = &board_;
  in.num_limit = sources_.NumLimit();
  in.block_tokens = bt;
  in.prompt_tokens = prompt_tokens;
  in.prices = {k.fetch_cost, k.cpu_fetch_cost, k.disk_fetch_cost};
  in.off_gpu = off_gpu_.size() > 0 ? &off_gpu_ : nullptr;
  in.ns = q.namespace_id;
  in.chain = chain;
  in.load_weight = k.load_weight;
  in.occupancy = occupancy;
  in.balance_threshold_tokens = k.balance_threshold_tokens;
  // Sampling draws among a fixed number of the cheapest, whatever the
  // response lists, so a request is routed the same way by every caller.
  in.keep = k.temperature > 0 ? kSampledCandidates : std::max<size_t>(shown, 1);
  in.stop_early = !options_.scan_all_workers;
  in.request_hash = request_hash;
  absl::InlinedVector<SourceNum, 4> excluded;
  for (const std::string& id : q.exclude) {
    if (const Source* s = sources_.Find(id); s != nullptr) excluded.push_back(s->num);
  }
  excluded.insert(excluded.end(), draining_.begin(), draining_.end());
  in.exclude = excluded;
  const WalkResult walk = WalkCandidates(in);
  if (walk.picks.empty()) {
    counters_.unavailable++;
    return absl::UnavailableError(absl::StrCat("no live worker serves namespace ",
                                               NamespaceName(q.namespace_id), " but the ",
                                               excluded.size(), " excluded or draining"));
  }
  RouteResult r =
      Decide(q, chain, fleet, k, occupancy, match, walk, prompt_tokens, bt, request_hash, shown);
  r.fetch = basis;
  return r;
}

RouteResult RouterCore::Decide(const RouteQuery& q, const ChainView& chain, Fleet& fleet,
                               const CostKnobs& k, const OccupancyTerm& occupancy,
                               const PrefixMatch& match, const WalkResult& walk,
                               uint64_t prompt_tokens, uint32_t bt, uint64_t request_hash,
                               size_t shown) {
  std::vector<Candidate> cands;
  cands.reserve(walk.picks.size());
  for (const WalkPick& p : walk.picks) {
    Candidate c;
    c.worker_id = sources_.ByNum(p.num)->hello.source_id;
    c.id_hash = board_.id_hash[p.num];
    c.num = p.num;
    c.blocks = p.blocks;
    c.load_tokens = p.load;
    c.occupancy = board_.occupancy[p.num];
    cands.push_back(c);
  }
  uint64_t max_load = walk.max_load;
  // Deciding and adding the request to its worker's load is one step among
  // concurrent routes: each decides on the loads the others left (a burst
  // decided on the same loads would all go to the same worker). The
  // candidates' loads are read again under the lock; the walk needs none.
  std::unique_lock decide(decide_mu_);
  if (!q.dry_run) {
    for (Candidate& c : cands) {
      c.load_tokens = board_.Load(c.num);
      max_load = std::max(max_load, c.load_tokens);
    }
  }
  const Decision d = router::Decide(k, prompt_tokens, bt, request_hash, cands, max_load, occupancy);
  const Candidate& best = cands[d.chosen];
  Source* chosen = sources_.ByNum(best.num);
  // A dry run (kvctl route) explains a decision without making it: the
  // worker's load and the decision counters stay as they were.
  if (!q.dry_run) {
    chosen->routed_since_heartbeat += best.prefill_tokens;
    if (options_.inflight_ms > 0 || q.request_id != 0) {
      chosen->NoteRoute(Clock::now(), best.prefill_tokens, q.request_id);
    }
    fleet.RaiseBound(best.num, board_.AddRouted(best.num, best.prefill_tokens));
    // Past what it holds or has pending: blocks pending already are not
    // refreshed, so a route that is never run cannot keep them alive.
    if (options_.pending_ms > 0 && best.blocks.held() < chain.size()) {
      pending_.Add(q.namespace_id, best.num, chain, best.blocks.held(),
                   PendingRoutes::StrideFor(bt), Clock::now());
    }
  }
  decide.unlock();
  RouteResult r;
  r.worker_id = best.worker_id;
  r.endpoint = chosen->hello.endpoint;
  r.gpu_blocks = best.blocks.gpu;
  r.cpu_blocks = best.blocks.cpu;
  r.disk_blocks = best.blocks.disk;
  r.store_blocks = best.blocks.store;
  if (StoresKnown()) {
    uint32_t end = 0;
    for (const auto& [at, run] : match.store_runs) {
      if (run > 0) end = std::max(end, at + run);
    }
    r.store_end = end;
  }
  r.prefill_tokens = best.prefill_tokens;
  r.block_tokens = bt;
  r.reason = d.reason;
  if (!q.dry_run) {
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
  // The cheapest `shown`, cheapest first, the chosen one among them: in the
  // last place if sampling or the balance guard passed over all of those.
  auto show = [&](const Candidate& c) {
    r.candidates.push_back(RouteCandidate{std::string(c.worker_id), c.blocks.gpu, c.blocks.store,
                                          c.load_tokens, c.prefill_tokens, k.fetch_cost, c.cost,
                                          c.occupancy, c.blocks.cpu, c.blocks.disk});
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

}  // namespace kvtier::router
