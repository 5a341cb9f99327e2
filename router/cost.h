// The routing decision (docs/router.md, "Cost"): per candidate worker, in
// prefill-token equivalents,
//   cost = tokens to compute + fetch_cost x tokens fetched from the store
//          + cpu_fetch_cost x tokens loaded from its own CPU tier
//          + disk_fetch_cost x tokens loaded from its own slower tier
//          + load_weight x (queued prefill tokens + tokens routed since its
//            last heartbeat)
//          + occupancy_weight x fetch_cost x tokens it must place in new
//            pages (loaded or computed) x how far the share of its pages
//            in use exceeds its fleet's mean (0 if it does not).
// The last term prices the pages a placement takes from a worker fuller
// than the others: with a store, a block a worker holds saves only a
// fetch, so a short shared prefix (a system prompt) must not pull every
// new session onto its holder while other workers' pages sit unused. With
// every worker as full as the rest it is 0.
// The cheapest wins. Ties go to a rendezvous hash of (the prompt's last
// block, worker id), stable across replicas and restarts. When the
// spread of load among candidates exceeds balance_threshold_tokens the
// least-loaded worker wins instead. temperature > 0 samples by cost with a
// seed drawn from the request, so replicas agree. Pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "common/block_key.h"

namespace kvtier::router {

struct CostKnobs {
  double fetch_cost = 0.1;                // per token fetched, relative to computing it
  double load_weight = 1.0;               // per queued token
  uint64_t balance_threshold_tokens = 0;  // 0: no balance guard
  double temperature = 0;                 // 0: deterministic
  // Per token placed in new pages on a worker whose pages are all in use
  // while its fleet's are all free, in fetches; scaled by how far its share
  // of pages in use exceeds the fleet's mean. 0: off. RouterCore::Route
  // turns it into an OccupancyTerm.
  double occupancy_weight = 4.0;
  // Per token a worker loads from an offloading tier of its own (vLLM's
  // CPU offloading; a slower one: disk, storage), relative to computing it.
  // A CPU tier's load is a host-to-device copy (~25 GB/s over PCIe, ~128 KiB
  // of KV a token for an 8B model: ~190k tokens/s against a prefill of ~10k
  // tokens/s: 0.05); an NVMe tier reads ~3 GB/s (0.4).
  double cpu_fetch_cost = 0.05;
  double disk_fetch_cost = 0.4;
};

// What the prices of loading a token are, relative to computing it.
struct FetchPrices {
  double store = 0, cpu = 0, disk = 0;
};

// Where a worker would get a prompt's blocks: `gpu` leading blocks on its
// GPU, the next `cpu` on its own CPU tier, the next `disk` on its slower
// tier, then `store` from the store, the rest computed.
struct BlockSplit {
  uint32_t gpu = 0, cpu = 0, disk = 0, store = 0;
  uint32_t held() const { return gpu + cpu + disk; }
};

// The tokens a worker computes for a prompt split so, and what the prompt
// costs it in all (computing plus loading; load and occupancy apart).
struct PromptPrice {
  uint64_t compute = 0;
  uint64_t placed = 0;  // tokens it must put in new GPU pages
  double cost = 0;
};
inline PromptPrice PricePrompt(uint64_t prompt, uint32_t bt, const BlockSplit& b,
                               const FetchPrices& p) {
  auto take = [&](uint32_t blocks, uint64_t& left) {
    const uint64_t t = std::min<uint64_t>(uint64_t{blocks} * bt, left);
    left -= t;
    return static_cast<double>(t);
  };
  uint64_t left = prompt;
  take(b.gpu, left);
  PromptPrice r;
  r.placed = left;
  const double cpu = take(b.cpu, left), disk = take(b.disk, left), store = take(b.store, left);
  r.compute = left;
  r.cost = static_cast<double>(left) + p.store * store + p.cpu * cpu + p.disk * disk;
  return r;
}

// The occupancy term of one route: a candidate placing `placed` tokens in
// new pages costs price_per_token x placed x how far its occupancy exceeds
// fleet_mean (never negative). A default term costs nothing.
struct OccupancyTerm {
  double price_per_token = 0;
  double fleet_mean = 0;
  double Excess(double occupancy) const { return std::max(0.0, occupancy - fleet_mean); }
  double Cost(uint64_t placed, double occupancy) const {
    return price_per_token * static_cast<double>(placed) * Excess(occupancy);
  }
};

struct Candidate {
  // Borrowed: valid while whoever built the candidate keeps the id alive.
  std::string_view worker_id;
  // WorkerIdHash(worker_id): the rendezvous tie-break's member hash.
  uint64_t id_hash = 0;
  uint32_t num = 0;  // the caller's number for the worker
  BlockSplit blocks;
  uint64_t load_tokens = 0;
  // The share of its GPU pages in use at its last heartbeat, 0..1.
  double occupancy = 0;
  // Filled by Decide:
  uint64_t prefill_tokens = 0;
  double cost = 0;
};

enum class Reason { kLowestCost, kTieBreak, kBalanceGuard, kSampled };

struct Decision {
  size_t chosen = 0;  // index into the candidates (after sorting by cost)
  Reason reason = Reason::kLowestCost;
};

// The member hash of a worker id for the rendezvous tie-break.
uint64_t WorkerIdHash(std::string_view worker_id);
// The rendezvous score of a worker for a request: the highest wins a tie.
inline uint64_t RendezvousRank(uint64_t request_hash, uint64_t id_hash) {
  return Mix64(request_hash ^ id_hash);
}

// Computes each candidate's cost, sorts candidates cheapest first (ties by
// id hash), and picks one. `candidates` may be a subset of the fleet as
// long as it holds every worker that could win: the balance guard then
// needs the fleet's highest load (fleet_max_load; the candidates' own
// highest counts too), and sampling draws among the candidates given.
// `occupancy` prices the pages each candidate places (knobs.occupancy_weight
// is read only through it).
// REQUIRES: !candidates.empty().
Decision Decide(const CostKnobs& knobs, uint64_t prompt_tokens, uint32_t block_tokens,
                uint64_t request_hash, std::vector<Candidate>& candidates,
                uint64_t fleet_max_load = 0, const OccupancyTerm& occupancy = {});

}  // namespace kvtier::router
