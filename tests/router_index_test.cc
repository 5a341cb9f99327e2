#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "router/cost.h"
#include "router/prefix_index.h"

namespace kvtier::router {
namespace {

constexpr uint64_t kNs = 7;
BlockHash H(uint64_t i) { return BlockHash{i, i * 3}; }
std::vector<BlockHash> Chain(int n) {
  std::vector<BlockHash> c;
  for (int i = 0; i < n; ++i) c.push_back(H(i));
  return c;
}

// An index whose sources 100-109 are stores.
PrefixIndex NewIndex() {
  PrefixIndex idx;
  for (SourceNum s = 100; s < 110; ++s) idx.SetStore(s, true);
  return idx;
}

std::map<SourceNum, uint32_t> Depths(const PrefixMatch& m) {
  return std::map<SourceNum, uint32_t>(m.gpu_depth.begin(), m.gpu_depth.end());
}

TEST(PrefixIndex, AddRemoveCount) {
  PrefixIndex idx = NewIndex();
  EXPECT_TRUE(idx.Add({kNs, H(1)}, 1));
  EXPECT_FALSE(idx.Add({kNs, H(1)}, 1));
  EXPECT_TRUE(idx.Add({kNs, H(1)}, 2));
  for (SourceNum s = 3; s < 10; ++s) EXPECT_TRUE(idx.Add({kNs, H(1)}, s));  // spills inline space
  EXPECT_EQ(idx.blocks(), 1u);
  EXPECT_EQ(idx.replicas(), 9u);
  EXPECT_TRUE(idx.Remove({kNs, H(1)}, 5));
  EXPECT_FALSE(idx.Remove({kNs, H(1)}, 5));
  EXPECT_FALSE(idx.Remove({kNs, H(2)}, 1));  // never stored
  for (SourceNum s : {1, 2, 3, 4, 6, 7, 8, 9}) EXPECT_TRUE(idx.Remove({kNs, H(1)}, s));
  EXPECT_EQ(idx.blocks(), 0u);
  EXPECT_EQ(idx.replicas(), 0u);
}

TEST(PrefixIndex, LongestContiguousPrefixPerWorker) {
  PrefixIndex idx = NewIndex();
  for (int i = 0; i < 5; ++i) idx.Add({kNs, H(i)}, 1);  // worker 1: blocks 0-4
  for (int i = 0; i < 2; ++i) idx.Add({kNs, H(i)}, 2);  // worker 2: blocks 0-1
  for (int i = 1; i < 6; ++i) idx.Add({kNs, H(i)}, 3);  // worker 3: no block 0 -> depth 0
  idx.Add({kNs, H(3)}, 2);                              // a hole: does not count
  PrefixMatch m;
  idx.MatchLinear(kNs, Chain(8), &m);
  auto d = Depths(m);
  EXPECT_EQ(d[1], 5u);
  EXPECT_EQ(d[2], 2u);
  EXPECT_EQ(d.count(3), 0u);
  EXPECT_EQ(m.deepest, 4);
  // Galloping probes blocks 1, 3, 7, 5, 4, 6 and compares how many workers
  // hold each. Holes break the invariant it relies on, and the depths stay
  // within the documented bound (a worker reported with d blocks holds
  // block d - 1 and lacks block d): worker 2's hole at block 2 goes unseen
  // (depth 4), and worker 3, which lacks block 0, is taken for a worker
  // that held blocks 0-5 (depth 6). Their own lookups are exact.
  PrefixMatch g;
  idx.Match(kNs, Chain(8), &g);
  auto gd = Depths(g);
  EXPECT_EQ(gd[1], 5u);
  EXPECT_EQ(gd[2], 4u);
  EXPECT_EQ(gd[3], 6u);
  EXPECT_EQ(g.deepest, 5);
  // Other namespaces never match.
  idx.Match(kNs + 1, Chain(8), &m);
  EXPECT_TRUE(m.gpu_depth.empty());
  EXPECT_EQ(m.deepest, -1);
}

TEST(PrefixIndex, StoreRunsContinueAfterGpuPrefixes) {
  PrefixIndex idx = NewIndex();
  for (int i = 0; i < 2; ++i) idx.Add({kNs, H(i)}, 1);    // worker 1: 0-1
  for (int i = 0; i < 6; ++i) idx.Add({kNs, H(i)}, 100);  // store: 0-5
  PrefixMatch m;
  for (bool linear : {true, false}) {
    linear ? idx.MatchLinear(kNs, Chain(10), &m) : idx.Match(kNs, Chain(10), &m);
    EXPECT_EQ(Depths(m)[1], 2u);
    EXPECT_EQ(m.walked, 6u);
    EXPECT_EQ(m.StoreRun(2), 4u);  // worker 1 fetches blocks 2-5
    EXPECT_EQ(m.StoreRun(0), 6u);  // a cold worker fetches 0-5
    EXPECT_EQ(m.deepest, 5);
  }
  // A hole in the store's blocks (write-back stores hold the tails workers
  // evicted): the linear walk stops at it; galloping probes 1, 3 and 7,
  // all held, misses the hole at 6 and ends the run at the first probed
  // block no store holds (8). The worker's own lookup is exact: it would
  // load 2-5 and compute the rest.
  idx.Add({kNs, H(7)}, 100);
  idx.MatchLinear(kNs, Chain(10), &m);
  EXPECT_EQ(m.StoreRun(2), 4u);
  EXPECT_EQ(m.walked, 6u);
  idx.Match(kNs, Chain(10), &m);
  EXPECT_EQ(m.StoreRun(0), 8u);
  EXPECT_EQ(m.StoreRun(2), 6u);
  EXPECT_EQ(m.walked, 8u);
}

// The same answer as the linear walk, field for field.
void ExpectSameMatch(const PrefixMatch& a, const PrefixMatch& b, const std::string& what) {
  EXPECT_EQ(Depths(a), Depths(b)) << what;
  EXPECT_EQ(a.walked, b.walked) << what;
  EXPECT_EQ(a.deepest, b.deepest) << what;
  EXPECT_EQ(a.StoreRun(0), b.StoreRun(0)) << what;
  for (const auto& [s, depth] : b.gpu_depth)
    EXPECT_EQ(a.StoreRun(depth), b.StoreRun(depth)) << what;
}

TEST(PrefixIndex, GallopingProbesLogarithmicallyOnLongChains) {
  PrefixIndex idx = NewIndex();
  const int n = 2000;
  for (int i = 0; i < n; ++i) {
    if (i < 500) idx.Add({kNs, H(i)}, 1);
    if (i < 1500) idx.Add({kNs, H(i)}, 2);
    idx.Add({kNs, H(i)}, 3);
  }
  PrefixMatch lin, gal;
  idx.MatchLinear(kNs, Chain(n + 10), &lin);
  idx.Match(kNs, Chain(n + 10), &gal);
  ExpectSameMatch(gal, lin, "three depths");
  EXPECT_EQ(Depths(gal)[3], 2000u);
  EXPECT_GE(lin.probes, 2000u);
  EXPECT_LT(gal.probes, 200u) << "O(log n) per distinct depth, not one per block";
  // With no store registered the store's runs are not probed at all.
  const uint32_t workers_only = gal.probes;
  {
    PrefixIndex plain;
    for (int i = 0; i < n; ++i) {
      if (i < 500) plain.Add({kNs, H(i)}, 1);
      if (i < 1500) plain.Add({kNs, H(i)}, 2);
      plain.Add({kNs, H(i)}, 3);
    }
    PrefixMatch m;
    plain.Match(kNs, Chain(n + 10), &m);
    EXPECT_LT(m.probes, workers_only);
    EXPECT_EQ(Depths(m), Depths(gal));
  }
  // A store's runs gallop too.
  for (int i = 0; i < 1800; ++i) idx.Add({kNs, H(i)}, 100);
  idx.MatchLinear(kNs, Chain(n + 10), &lin);
  idx.Match(kNs, Chain(n + 10), &gal);
  ExpectSameMatch(gal, lin, "with a store");
  EXPECT_EQ(gal.StoreRun(500), 1300u);
  EXPECT_LT(gal.probes, workers_only + 100) << "three runs in O(log n) probes each";
}

// Probes go in batches (the gallop's first 16 positions, then eighths of an
// interval): prefixes and store runs longer than one batch reaches (past
// block 65,535) continue one probe at a time and still agree.
TEST(PrefixIndex, PrefixesAndRunsLongerThanOneBatchOfProbes) {
  PrefixIndex idx = NewIndex();
  const int n = 150000;
  for (int i = 0; i < n; ++i) {
    if (i < 70001) idx.Add({kNs, H(i)}, 1);
    if (i < 140003) idx.Add({kNs, H(i)}, 2);
    if (i >= 70001 && i < 139999) idx.Add({kNs, H(i)}, 100);
    if (i < 100000) idx.Add({kNs, H(i)}, 101);
  }
  PrefixMatch lin, gal;
  idx.MatchLinear(kNs, Chain(n), &lin);
  idx.Match(kNs, Chain(n), &gal);
  ExpectSameMatch(gal, lin, "long prefixes and runs");
  EXPECT_EQ(Depths(gal)[1], 70001u);
  EXPECT_EQ(Depths(gal)[2], 140003u);
  EXPECT_EQ(gal.StoreRun(0), 139999u);
  EXPECT_EQ(gal.StoreRun(70001), 139999u - 70001u);
  EXPECT_LT(gal.probes, 400u);
}

// Property: random holdings, every worker's blocks of the chain a prefix of
// it (engines fill front to back and evict from the tail), with removals
// from the tail, and the stores' blocks one segment (their union): both
// algorithms agree on every field. With holes (a hole in a worker's
// holdings, stores holding disjoint segments under write-back) they differ
// only as documented: a worker reported with depth d holds block d - 1
// and lacks block d; a store run is never below the true contiguous
// one, and the block that ends it is one no store holds.
TEST(PrefixIndex, GallopingAgreesWithTheLinearWalk) {
  std::mt19937_64 rng(20261123);
  for (int round = 0; round < 300; ++round) {
    PrefixIndex idx = NewIndex();
    const int n = 1 + static_cast<int>(rng() % 300);
    const bool holes = round % 3 == 2;
    const int workers = 1 + static_cast<int>(rng() % 12);
    std::vector<std::vector<bool>> held(workers + 1, std::vector<bool>(n, false));
    // Stores 100 and 101 hold segments of the chain (write-back: the tails
    // workers evicted), not prefixes.
    std::vector<bool> in_store(n, false);
    // Source 102 (the last "worker" below) is a store holding a prefix;
    // without holes the other two continue it.
    int seg_from = holes ? static_cast<int>(rng() % (n + 1)) : 0;
    int seg_to = seg_from + static_cast<int>(rng() % (n - seg_from + 1));
    for (SourceNum st : {100u, 101u}) {
      int from, to;
      if (holes) {
        from = static_cast<int>(rng() % (n + 1));
        to = from + static_cast<int>(rng() % (n - from + 1));
      } else {  // two overlapping parts of one segment
        from = seg_from + (st == 100 ? 0 : (seg_to - seg_from) / 2);
        to = st == 100 ? seg_from + (seg_to - seg_from + 1) / 2 + 1 : seg_to;
        to = std::min(to, seg_to);
      }
      for (int i = from; i < to; ++i) {
        idx.Add({kNs, H(i)}, st);
        in_store[i] = true;
      }
    }
    for (int w = 0; w <= workers; ++w) {
      const SourceNum s = w == workers ? 102 : static_cast<SourceNum>(w);
      const int depth = static_cast<int>(rng() % (n + 1));
      for (int i = 0; i < depth; ++i) {
        idx.Add({kNs, H(i)}, s);
        held[w][i] = true;
      }
      const int evict = depth > 0 ? static_cast<int>(rng() % (depth / 2 + 1)) : 0;
      for (int i = depth - evict; i < depth; ++i) {
        idx.Remove({kNs, H(i)}, s);
        held[w][i] = false;
      }
      if (holes && depth > 2) {
        const int hole = static_cast<int>(rng() % depth);
        idx.Remove({kNs, H(hole)}, s);
        held[w][hole] = false;
      }
    }
    for (int i = 0; i < n; ++i) in_store[i] = in_store[i] || held[workers][i];
    PrefixMatch lin, gal;
    idx.MatchLinear(kNs, Chain(n), &lin);
    idx.Match(kNs, Chain(n), &gal);
    const std::string what = "round " + std::to_string(round);
    EXPECT_EQ(Depths(gal).size(), gal.gpu_depth.size()) << what << ": a worker reported twice";
    if (!holes) {
      ExpectSameMatch(gal, lin, what);
      continue;
    }
    auto check_run = [&](uint32_t at) {
      uint32_t exact = 0;
      while (at + exact < static_cast<uint32_t>(n) && in_store[at + exact]) ++exact;
      const uint32_t run = gal.StoreRun(at);
      EXPECT_GE(run, exact) << what << " at " << at;
      if (at + run < static_cast<uint32_t>(n)) {
        EXPECT_FALSE(in_store[at + run]) << what;
      }
    };
    check_run(0);
    for (const auto& [s, d] : gal.gpu_depth) check_run(d);
    for (const auto& [s, d] : gal.gpu_depth) {
      ASSERT_LT(s, static_cast<SourceNum>(workers)) << what << ": a store reported as a worker";
      EXPECT_TRUE(held[s][d - 1]) << what << " source " << s << " depth " << d;
      if (d < static_cast<uint32_t>(n)) {
        EXPECT_FALSE(held[s][d]) << what << " source " << s << " depth " << d;
      }
    }
  }
}

// A prefix shared by more workers than PrefixIndex::kGroupFrom comes back
// as groups; expanded, they name the same workers at the same depths, and
// InGroup agrees with the holder lists (bitmaps past kBitsFrom holders).
TEST(PrefixIndex, SharedPrefixesComeBackAsGroupsOfTheSameWorkers) {
  PrefixIndex idx = NewIndex();
  std::mt19937_64 rng(3);
  std::map<SourceNum, int> depth;
  for (SourceNum w = 0; w < 400; ++w) {
    if (w >= 100 && w < 110) continue;  // stores are 100-109
    const int d = w % 7 == 0 ? 1 + static_cast<int>(rng() % 30) : 5;
    for (int i = 0; i < d; ++i) idx.Add({kNs, H(i)}, w);
    depth[w] = d;
  }
  for (int i = 0; i < 8; ++i) idx.Add({kNs, H(i)}, 101);  // a store holding 0-7
  PrefixMatch grouped, named;
  idx.Match(kNs, Chain(40), &grouped);
  idx.Match(kNs, Chain(40), &named, /*groups=*/false);
  ASSERT_FALSE(grouped.groups.empty());
  EXPECT_TRUE(named.groups.empty());
  EXPECT_EQ(grouped.walked, named.walked);
  EXPECT_EQ(grouped.StoreRun(5), named.StoreRun(5));
  for (const auto& g : grouped.groups) {
    uint32_t members = 0;
    for (SourceNum w = 0; w < 400; ++w) members += idx.InGroup(g, w);
    EXPECT_EQ(members, g.workers);
    EXPECT_FALSE(idx.InGroup(g, 101)) << "a store is never a group's worker";
  }
  idx.ExpandGroups(&grouped);
  EXPECT_EQ(Depths(grouped), Depths(named));
  // Evicting (from the tail) below the bitmap threshold keeps membership
  // right: the 20 workers left are named.
  for (auto& [w, d] : depth) {
    if (w >= 380) continue;
    while (d > 0) idx.Remove({kNs, H(--d)}, w);
  }
  PrefixMatch few;
  idx.Match(kNs, Chain(40), &few);
  EXPECT_TRUE(few.groups.empty());
  std::map<SourceNum, uint32_t> expect;
  for (const auto& [w, d] : depth) {
    if (d > 0) expect[w] = static_cast<uint32_t>(d);
  }
  EXPECT_EQ(Depths(few), expect);
}

TEST(PrefixIndex, MemoryIsReported) {
  PrefixIndex idx = NewIndex();
  for (uint64_t i = 0; i < 10000; ++i) idx.Add({kNs, H(i)}, 1);
  // A 16-byte slot and a control byte per bucket, at a load of 7/16..7/8.
  EXPECT_GE(idx.MemoryBytes(), 10000 * 17u);
  EXPECT_LE(idx.MemoryBytes(), 10000 * 40u);
  // Holders past two spill to a side list, counted too.
  const size_t before = idx.MemoryBytes();
  for (SourceNum s = 2; s < 10; ++s) idx.Add({kNs, H(1)}, s);
  EXPECT_GT(idx.MemoryBytes(), before);
  EXPECT_EQ(idx.replicas(), 10008u);
  // Dropping a source drops it everywhere, keeping what it is told to keep.
  absl::flat_hash_set<uint64_t> keep = {PrefixIndex::Fingerprint({kNs, H(5)})};
  EXPECT_EQ(idx.RemoveSource(1, &keep), 9999u);
  EXPECT_EQ(idx.blocks(), 2u);  // block 1 (sources 2-9) and block 5 (source 1)
  EXPECT_EQ(idx.RemoveSource(3), 1u);
  EXPECT_EQ(idx.replicas(), 8u);
}

Candidate C(std::string_view id, uint32_t gpu, uint32_t store, uint64_t load) {
  Candidate c;
  c.worker_id = id;
  c.id_hash = WorkerIdHash(id);
  c.blocks.gpu = gpu;
  c.blocks.store = store;
  c.load_tokens = load;
  return c;
}

TEST(Cost, HandComputedCases) {
  CostKnobs k;  // fetch 0.1, load 1.0
  // 1,000-token prompt, 16-token blocks.
  std::vector<Candidate> c = {C("a", 10, 0, 0), C("b", 0, 20, 0), C("c", 62, 0, 500)};
  auto d = Decide(k, 1000, 16, 42, c);
  // a: 1000-160 = 840. b: 1000-320 = 680 + 0.1*320 = 712. c: 1000-992 = 8 + 500 = 508.
  ASSERT_EQ(c[0].worker_id, "c");
  EXPECT_DOUBLE_EQ(c[0].cost, 508);
  EXPECT_EQ(c[0].prefill_tokens, 8u);
  EXPECT_DOUBLE_EQ(c[1].cost, 712);
  EXPECT_DOUBLE_EQ(c[2].cost, 840);
  EXPECT_EQ(d.chosen, 0u);
  EXPECT_EQ(d.reason, Reason::kLowestCost);
  // Cached blocks past the prompt's end count only up to it.
  std::vector<Candidate> full = {C("a", 100, 5, 0)};
  Decide(k, 1000, 16, 1, full);
  EXPECT_EQ(full[0].prefill_tokens, 0u);
  EXPECT_DOUBLE_EQ(full[0].cost, 0);
  // A worker's own tiers, at their fetch costs (CPU 0.05, disk 0.4): 10 GPU
  // blocks, 20 on its CPU, 10 on disk, 20 from the store, 40 tokens
  // computed: 40 + 0.05*320 + 0.4*160 + 0.1*320 = 152. The occupancy term
  // counts every token not on its GPU (840) as placed in new pages.
  std::vector<Candidate> tiers = {C("a", 10, 20, 0)};
  tiers[0].blocks.cpu = 20;
  tiers[0].blocks.disk = 10;
  tiers[0].occupancy = 1;
  Decide(k, 1000, 16, 1, tiers, 0, OccupancyTerm{0.01, 0.5});
  EXPECT_EQ(tiers[0].prefill_tokens, 40u);
  EXPECT_DOUBLE_EQ(tiers[0].cost, 152 + 0.01 * 840 * 0.5);
}

TEST(Cost, TiesBreakByRequestHashStablyAndSpread) {
  CostKnobs k;
  std::map<std::string, int> wins;
  for (uint64_t req = 0; req < 4000; ++req) {
    std::vector<Candidate> a = {C("w0", 0, 0, 0), C("w1", 0, 0, 0), C("w2", 0, 0, 0),
                                C("w3", 0, 0, 0)};
    std::vector<Candidate> b = {a[3], a[1], a[0], a[2]};  // another order
    auto da = Decide(k, 100, 16, req * 0x9E3779B97F4A7C15ull, a);
    auto db = Decide(k, 100, 16, req * 0x9E3779B97F4A7C15ull, b);
    EXPECT_EQ(da.reason, Reason::kTieBreak);
    EXPECT_EQ(a[da.chosen].worker_id, b[db.chosen].worker_id);  // order does not matter
    wins[std::string(a[da.chosen].worker_id)]++;
  }
  for (const auto& [w, n] : wins) EXPECT_NEAR(n, 1000, 150) << w;  // ties spread evenly
  // Removing a worker that did not win keeps the decision (rendezvous hashing).
  for (uint64_t req = 0; req < 200; ++req) {
    std::vector<Candidate> all = {C("w0", 0, 0, 0), C("w1", 0, 0, 0), C("w2", 0, 0, 0)};
    auto d = Decide(k, 100, 16, req, all);
    std::string winner(all[d.chosen].worker_id);
    std::vector<Candidate> fewer;
    bool dropped = false;
    for (const auto& c : all) {
      if (c.worker_id != winner && !dropped) {
        dropped = true;
        continue;
      }
      fewer.push_back(c);
    }
    auto d2 = Decide(k, 100, 16, req, fewer);
    EXPECT_EQ(fewer[d2.chosen].worker_id, winner);
  }
}

TEST(Cost, BalanceGuardRoutesByLoadAlone) {
  CostKnobs k;
  k.balance_threshold_tokens = 1000;
  // Everyone shares the system prompt on w0, which is far busier.
  std::vector<Candidate> c = {C("w0", 4, 0, 5000), C("w1", 0, 0, 200), C("w2", 0, 0, 100)};
  auto d = Decide(k, 100, 16, 9, c);
  EXPECT_EQ(d.reason, Reason::kBalanceGuard);
  EXPECT_EQ(c[d.chosen].worker_id, "w2");
  // Within the threshold, cost decides.
  std::vector<Candidate> calm = {C("w0", 4, 0, 600), C("w1", 0, 0, 200), C("w2", 0, 0, 100)};
  d = Decide(k, 1000, 16, 9, calm);
  EXPECT_NE(d.reason, Reason::kBalanceGuard);
  // w0: 1000-64+600 = 1536; w1: 1200; w2: 1100.
  EXPECT_EQ(calm[d.chosen].worker_id, "w2");
  EXPECT_DOUBLE_EQ(calm[d.chosen].cost, 1100);
}

TEST(Cost, TemperatureSamplesDeterministicallyPerRequest) {
  CostKnobs k;
  k.temperature = 0.5;
  std::map<std::string, int> wins;
  for (uint64_t req = 0; req < 2000; ++req) {
    std::vector<Candidate> c = {C("a", 10, 0, 0), C("b", 0, 0, 0)};
    std::vector<Candidate> again = c;
    auto d = Decide(k, 320, 16, req, c);
    auto d2 = Decide(k, 320, 16, req, again);
    EXPECT_EQ(d.reason, Reason::kSampled);
    EXPECT_EQ(c[d.chosen].worker_id, again[d2.chosen].worker_id);
    wins[std::string(c[d.chosen].worker_id)]++;
  }
  // a costs 160, b 320: weight ratio e^(160/160) = e, so a wins ~73 %.
  EXPECT_NEAR(wins["a"] / 2000.0, 0.731, 0.04);
}

}  // namespace
}  // namespace kvtier::router
