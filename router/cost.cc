#include "router/cost.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>

namespace kvtier::router {

uint64_t WorkerIdHash(std::string_view worker_id) {
  return XXH3_64bits(worker_id.data(), worker_id.size());
}

namespace {
// Among candidates[i] for i in picks, the one with the highest rendezvous score.
size_t Rendezvous(const std::vector<Candidate>& c, const std::vector<size_t>& picks,
                  uint64_t request_hash) {
  size_t best = picks[0];
  uint64_t best_score = RendezvousRank(request_hash, c[best].id_hash);
  for (size_t i = 1; i < picks.size(); ++i) {
    uint64_t s = RendezvousRank(request_hash, c[picks[i]].id_hash);
    if (s > best_score) {
      best = picks[i];
      best_score = s;
    }
  }
  return best;
}
}  // namespace

Decision Decide(const CostKnobs& k, uint64_t prompt_tokens, uint32_t block_tokens,
                uint64_t request_hash, std::vector<Candidate>& c, uint64_t fleet_max_load,
                const OccupancyTerm& occupancy) {
  const FetchPrices prices{k.fetch_cost, k.cpu_fetch_cost, k.disk_fetch_cost};
  for (auto& x : c) {
    const PromptPrice p = PricePrompt(prompt_tokens, block_tokens, x.blocks, prices);
    x.prefill_tokens = p.compute;
    x.cost = p.cost + k.load_weight * static_cast<double>(x.load_tokens) +
             occupancy.Cost(p.placed, x.occupancy);
  }
  std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) {
    return a.cost != b.cost ? a.cost < b.cost : a.id_hash < b.id_hash;
  });
  Decision d;
  if (k.balance_threshold_tokens > 0) {
    auto [lo, hi] = std::minmax_element(c.begin(), c.end(), [](const auto& a, const auto& b) {
      return a.load_tokens < b.load_tokens;
    });
    const uint64_t max_load = std::max(hi->load_tokens, fleet_max_load);
    if (max_load - lo->load_tokens > k.balance_threshold_tokens) {
      std::vector<size_t> least;
      for (size_t i = 0; i < c.size(); ++i) {
        if (c[i].load_tokens == lo->load_tokens) least.push_back(i);
      }
      d.chosen = Rendezvous(c, least, request_hash);
      d.reason = Reason::kBalanceGuard;
      return d;
    }
  }
  if (k.temperature > 0 && c.size() > 1) {
    // Boltzmann weights on cost, scaled by the prompt so the knob is unitless.
    double scale = k.temperature * std::max<double>(1.0, static_cast<double>(prompt_tokens));
    std::vector<double> w(c.size());
    double sum = 0;
    for (size_t i = 0; i < c.size(); ++i) sum += w[i] = std::exp(-(c[i].cost - c[0].cost) / scale);
    // A uniform draw in [0, 1) from the request hash: same request, same pick.
    double u = static_cast<double>(XXH3_64bits_withSeed(&request_hash, 8, 0x5eed) >> 11) *
               (1.0 / 9007199254740992.0);
    double acc = 0;
    d.chosen = c.size() - 1;
    for (size_t i = 0; i < c.size(); ++i) {
      acc += w[i] / sum;
      if (u < acc) {
        d.chosen = i;
        break;
      }
    }
    d.reason = Reason::kSampled;
    return d;
  }
  std::vector<size_t> tied;
  const double eps = 1e-9 * std::max(1.0, std::fabs(c[0].cost));
  for (size_t i = 0; i < c.size() && c[i].cost <= c[0].cost + eps; ++i) tied.push_back(i);
  if (tied.size() == 1) {
    d.chosen = 0;
    d.reason = Reason::kLowestCost;
  } else {
    d.chosen = Rendezvous(c, tied, request_hash);
    d.reason = Reason::kTieBreak;
  }
  return d;
}

}  // namespace kvtier::router
