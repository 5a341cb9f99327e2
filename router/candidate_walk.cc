#include "router/candidate_walk.h"

#include <algorithm>
#include <limits>

#include "router/cost.h"

namespace kvtier::router {

namespace {

struct Pick {
  double cost;
  uint64_t load, rank;
  SourceNum num;
  BlockSplit blocks;
};

// The walk's state: the cheapest kept so far, the least loaded, the
// highest load seen, and the thresholds the hot loop tests.
class Walk {
 public:
  explicit Walk(const WalkInput& in)
      : in_(in),
        m_(*in.match),
        load_(in.board->load.data()),
        id_hash_(in.board->id_hash.data()),
        occupancy_(in.board->occupancy.data()),
        lw_(in.load_weight),
        keep_(in.keep),
        request_hash_(in.request_hash) {}

  WalkResult Run();

 private:
  // A worker's price before its load: where it gets the prompt's blocks,
  // their cost, and the occupancy price times the tokens placed.
  struct Price {
    BlockSplit split;
    double base = 0;
    double placed_cost = 0;
  };
  Price PriceOf(const BlockSplit& b) const {
    const PromptPrice p = PricePrompt(in_.prompt_tokens, in_.block_tokens, b, in_.prices);
    return {b, p.cost, in_.occupancy.price_per_token * static_cast<double>(p.placed)};
  }
  // The occupancy term of `num` at `p` (a lower bound of 0 holds for
  // every worker: the walk's load-order stops stay valid).
  double OccupancyOf(SourceNum num, const Price& p) const {
    return p.placed_cost * in_.occupancy.Excess(occupancy_[num]);
  }
  // The current price: that of workers holding `depth` blocks on their GPU.
  void SetDepth(uint32_t depth) { price_ = PriceOf({depth, 0, 0, m_.StoreRun(depth)}); }
  uint64_t LoadAt(SourceNum num) const {
    return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(load_[num]))
        .load(std::memory_order_relaxed);
  }
  void Admit(SourceNum num, const BlockSplit& blocks, uint64_t load, double cost);
  // Where a worker holding `depth` blocks of the prompt (as far as the
  // match says: the blocks it holds, then those pending on it) has them.
  // The pending ones it will compute onto its GPU.
  BlockSplit SplitOf(SourceNum num, uint32_t depth) const {
    const uint32_t held = OffGpuBlocks::FirstPast(0, depth, [&](uint32_t i) {
      return !in_.index->Has(PrefixIndex::Fingerprint(BlockKey{in_.ns, in_.chain[i]}), num);
    });
    const OffGpuBlocks::Split at = in_.off_gpu->Locate(in_.ns, in_.chain, num, held);
    return {at.gpu + (depth - held), at.cpu, held - at.gpu - at.cpu, m_.StoreRun(depth)};
  }
  // Looks at one worker holding `depth` blocks, the current price's: one
  // holding some of its blocks off its GPU is priced where it holds them
  // (never below the current price, so the load-order stops stay valid).
  void LookAt(SourceNum num, uint32_t depth) {
    if (depth == 0 || in_.off_gpu == nullptr || in_.off_gpu->Count(num) == 0) {
      Look(num, price_);
    } else {
      Look(num, PriceOf(SplitOf(num, depth)));
    }
  }
  // Looks at one worker at price `p`.
  void Look(SourceNum num, const Price& p) {
    const uint64_t load = LoadAt(num);
    max_load_ = std::max(max_load_, load);
    const double cost = p.base + lw_ * static_cast<double>(load) + OccupancyOf(num, p);
    if (load > reject_load_ && cost > reject_cost_) return;
    Admit(num, p.split, load, cost);
  }
  // The workers not named in the match that `member` accepts, at `depth`.
  template <class Member>
  void WalkCold(uint32_t depth, Member member, const std::vector<uint8_t>& hit);
  void ResolveMaxLoad();

  const WalkInput& in_;
  const PrefixMatch& m_;
  // The hot loop's inputs, by value.
  const uint64_t* const load_;
  const uint64_t* const id_hash_;
  const double* const occupancy_;
  const double lw_;
  const size_t keep_;
  const uint64_t request_hash_;
  absl::InlinedVector<Pick, 8> top_;  // cheapest first
  Pick least_{0, ~uint64_t{0}, 0, 0, {}};
  bool have_least_ = false;
  uint64_t max_load_ = 0;
  Price price_;  // the current depth's (SetDepth)
  // A worker costlier than the keep-th cheapest and busier than the least
  // loaded so far is out: the hot loop tests just that.
  double reject_cost_ = std::numeric_limits<double>::infinity();
  uint64_t reject_load_ = ~uint64_t{0};
  uint64_t reject_rank_ = 0;  // top_.back().rank once the list is full
  bool walked_all_ = true;
};

void Walk::Admit(SourceNum num, const BlockSplit& blocks, uint64_t load, double cost) {
  if (!in_.exclude.empty() &&
      std::find(in_.exclude.begin(), in_.exclude.end(), num) != in_.exclude.end()) {
    return;
  }
  // A worker met twice (in two groups: only where holes break the
  // invariant) is kept once in the list.
  if (!m_.groups.empty()) {
    for (const Pick& t : top_) {
      if (t.num == num) return;
    }
  }
  const Pick p{cost, load, RendezvousRank(request_hash_, id_hash_[num]), num, blocks};
  if (load <= least_.load && (!have_least_ || load < least_.load || p.rank > least_.rank)) {
    least_ = p;
    have_least_ = true;
    reject_load_ = load;
  }
  auto cheaper = [](const Pick& a, const Pick& b) {
    return a.cost != b.cost ? a.cost < b.cost : a.rank > b.rank;
  };
  if (top_.size() == keep_) {
    if (!cheaper(p, top_.back())) return;
    top_.pop_back();
  }
  top_.insert(std::upper_bound(top_.begin(), top_.end(), p, cheaper), p);
  if (top_.size() == keep_) {
    reject_cost_ = top_.back().cost;
    reject_rank_ = top_.back().rank;
  }
}

// In load order: once a worker's load as of the last sort is both costlier
// than the cheapest kept and above the least loaded, so is everyone's after
// it (loads only grew since, but for the lowered ones, looked at apart).
template <class Member>
void Walk::WalkCold(uint32_t depth, Member member, const std::vector<uint8_t>& hit) {
  SetDepth(depth);
  const double lw = lw_;
  const Fleet& fleet = *in_.fleet;
  for (SourceNum num : fleet.lowered) {
    if (!hit[num] && member(num)) LookAt(num, depth);
  }
  const uint8_t* lowered = in_.board->lowered.data();
  const auto& order = fleet.order;
  for (size_t i = 0; i < order.size(); ++i) {
    const auto [was, num] = order[i];
    if (was > reject_load_ && in_.stop_early &&
        price_.base + lw * static_cast<double>(was) > reject_cost_) {
      walked_all_ = false;
      break;
    }
    if (!hit[num] && !lowered[num] && member(num)) LookAt(num, depth);
    // A run of ties (an idle fleet's cold workers): while the least loaded
    // and the keep-th cheapest both sit at load L and its cost, and any
    // higher load costs more, a worker at L gets in only with a higher rank
    // and a busier one not at all. That takes one hash per worker; anything
    // else goes back to the loop above.
    if (!m_.groups.empty() || !have_least_ || top_.size() != keep_) continue;
    const uint64_t tie = reject_load_;
    const double tie_cost = price_.base + lw * static_cast<double>(tie);
    if (tie_cost != reject_cost_ ||
        !(price_.base + lw * static_cast<double>(tie + 1) > reject_cost_)) {
      continue;
    }
    uint64_t rank_to_beat = std::min(least_.rank, reject_rank_);
    size_t j = i + 1;
    for (; j < order.size(); ++j) {
      const SourceNum other = order[j].second;
      if (order[j].first > tie) break;  // (not looked at: the loop above takes it)
      if (hit[other] || lowered[other]) continue;
      const uint64_t load = LoadAt(other);
      max_load_ = std::max(max_load_, load);
      if (load > tie) continue;
      if (load < tie) break;
      if (RendezvousRank(request_hash_, id_hash_[other]) <= rank_to_beat) continue;
      // A worker whose pages are fuller costs more than the tie: it can
      // still be the least loaded (Admit sorts that out), never the cheapest.
      Admit(other, price_.split, load, tie_cost + OccupancyOf(other, price_));
      if (reject_load_ != tie || reject_cost_ != tie_cost) {
        ++j;
        break;
      }
      rank_to_beat = std::min(least_.rank, reject_rank_);
    }
    i = j - 1;
  }
}

// The balance guard compares the highest load with the lowest: the bound
// decides it unless the spread might exceed the threshold, when the loads
// not looked at are read.
void Walk::ResolveMaxLoad() {
  if (walked_all_) return;
  const Fleet& fleet = *in_.fleet;
  const uint64_t bound = fleet.Bound();
  const uint64_t least_load = have_least_ ? least_.load : 0;
  const SourceNum owner = fleet.BoundOwner();
  if (owner < in_.board->load.size() && LoadAt(owner) >= bound) {
    max_load_ = std::max(max_load_, LoadAt(owner));  // the bound is someone's load: exact
  } else if (in_.balance_threshold_tokens > 0 &&
             bound - std::min(bound, least_load) > in_.balance_threshold_tokens) {
    // Decide asks only whether the spread passes the threshold: stop
    // reading once it does.
    for (SourceNum num : fleet.nums) {
      if (max_load_ - std::min(max_load_, least_load) > in_.balance_threshold_tokens) break;
      max_load_ = std::max(max_load_, LoadAt(num));
    }
  } else {
    max_load_ = std::max(max_load_, bound);  // within the threshold either way
  }
}

WalkResult Walk::Run() {
  // (Blocks are keyed with their namespace: only the request's workers hold them.)
  uint32_t base_depth = ~0u;
  for (const auto& [num, depth] : m_.gpu_depth) {
    if (depth != base_depth) {
      base_depth = depth;
      SetDepth(depth);
    }
    LookAt(num, depth);
  }
  // Each group of workers too many to name (a prefix most of the fleet
  // holds) is walked at its depth, then the workers holding nothing of the
  // prompt. With groups the cold walk always runs: their counts are exact
  // only when the invariant holds, and a worker skipped here would never be
  // weighed.
  walked_all_ = m_.groups.empty();
  const bool all_named = m_.groups.empty() && m_.gpu_depth.size() >= in_.fleet->nums.size();
  if (!all_named) {
    // (A thread_local is reached through a wrapper call on every use: the
    // walk uses a plain reference.)
    thread_local std::vector<uint8_t> hit_marks;
    std::vector<uint8_t>& hit = hit_marks;
    if (hit.size() < in_.num_limit) hit.resize(in_.num_limit, 0);
    for (const auto& [num, depth] : m_.gpu_depth) hit[num] = 1;
    const PrefixIndex& index = *in_.index;
    for (const auto& g : m_.groups) {
      WalkCold(
          g.depth, [&](SourceNum num) { return index.InGroup(g, num); }, hit);
    }
    WalkCold(
        0,
        [&](SourceNum num) {
          for (const auto& g : m_.groups) {
            if (index.InGroup(g, num)) return false;
          }
          return true;
        },
        hit);
    for (const auto& [num, depth] : m_.gpu_depth) hit[num] = 0;
  }
  ResolveMaxLoad();
  WalkResult r;
  r.max_load = max_load_;
  for (const Pick& p : top_) r.picks.push_back({p.num, p.blocks, p.load});
  if (have_least_ &&
      std::none_of(top_.begin(), top_.end(), [&](const Pick& p) { return p.num == least_.num; })) {
    r.picks.push_back({least_.num, least_.blocks, least_.load});
  }
  return r;
}

}  // namespace

WalkResult WalkCandidates(const WalkInput& in) { return Walk(in).Run(); }

}  // namespace kvtier::router
