// Blocks an engine holds off its GPU, on an offloading tier of its own
// (vLLM's CPU offloading, or a slower tier): the router prices each at its
// tier's fetch cost, not as a GPU hit, and forgets the medium with the
// block, on a clear and on a snapshot. RouterCore driven directly, as the
// in-process vLLM subscriber drives it.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "router/router_core.h"

namespace kvtier::router {
namespace {

constexpr uint64_t kNs = 0xabc;
constexpr uint32_t kBt = 16;
BlockHash H(uint64_t i) { return BlockHash{i + 1, 77}; }

std::vector<BlockHash> Hashes(uint64_t from, uint64_t to) {
  std::vector<BlockHash> out;
  for (uint64_t i = from; i < to; ++i) out.push_back(H(i));
  return out;
}

// A route of `chain` (which must outlive it); a dry run unless `counted`.
RouteQuery HashQuery(const std::vector<BlockHash>& chain, bool counted = false) {
  RouteQuery q;
  q.namespace_id = kNs;
  q.prompt = RouteQuery::Prompt::kHashes;
  q.hashes = ChainView(chain);
  q.dry_run = !counted;
  return q;
}

class RouterMedia : public ::testing::Test {
 protected:
  explicit RouterMedia(RouterOptions o = {}) : core_(o) {}

  // A worker that holds blocks [0, blocks), all on its GPU, with `load`
  // prefill tokens queued.
  void Join(const std::string& id, uint64_t blocks, uint64_t load = 0) {
    std::vector<RouterCommand> cmds;
    SourceHello h{id, SourceKind::kWorker, id + ":8000", kNs, kBt, 1};
    ASSERT_TRUE(core_.Hello(h, &cmds).ok());
    ASSERT_TRUE(core_.Handle(id, SnapshotChunk{0, kNs, Hashes(0, blocks), true}, &cmds).ok());
    SourceLoad l;
    l.queued_prefill_tokens = load;
    ASSERT_TRUE(core_.Handle(id, l, &cmds).ok());
  }
  std::vector<RouterCommand> Send(const std::string& id, BlockEvent::Kind kind,
                                  std::vector<BlockHash> hashes, Medium medium = Medium::kGpu) {
    BlockEvent e;
    e.seq = ++seq_[id];
    e.kind = kind;
    e.namespace_id = kNs;
    e.hashes = std::move(hashes);
    e.medium = medium;
    std::vector<RouterCommand> cmds;
    auto s = core_.Handle(id, e, &cmds);
    EXPECT_TRUE(s.ok()) << s;
    return cmds;
  }
  void Place(const std::string& id, uint64_t from, uint64_t to, Medium m) {
    EXPECT_TRUE(Send(id, BlockEvent::Kind::kMedium, Hashes(from, to), m).empty());
  }
  // A prompt of `blocks` blocks from block 0 (counted: its load and
  // pending blocks stay on its worker).
  RouteResult Route(uint64_t blocks, bool counted = false) {
    const std::vector<BlockHash> chain = Hashes(0, blocks);
    auto r = core_.Route(HashQuery(chain, counted));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : RouteResult{};
  }
  static const RouteCandidate& Of(const RouteResult& r, const std::string& id) {
    for (const auto& c : r.candidates) {
      if (c.worker_id == id) return c;
    }
    ADD_FAILURE() << id << " is not a candidate";
    static RouteCandidate none;
    return none;
  }

  RouterCore core_;
  std::map<std::string, uint64_t> seq_;
};

// b holds the prompt's first 8 blocks as a does, 6 of them on its CPU tier
// only: loading those costs b 0.05 a token (96 tokens: 4.8), more than a's
// 3 queued tokens. Priced as GPU hits, b (idle) would win.
TEST_F(RouterMedia, BlocksOnAnEnginesOwnTierArePricedAtThatTiersFetch) {
  Join("a", 8, 3);
  Join("b", 8, 0);
  Place("b", 2, 8, Medium::kCpu);
  RouteResult r = Route(10);
  EXPECT_EQ(r.worker_id, "a");
  const RouteCandidate& b = Of(r, "b");
  EXPECT_EQ(b.gpu_blocks, 2u);
  EXPECT_EQ(b.cpu_blocks, 6u);
  EXPECT_EQ(b.disk_blocks, 0u);
  EXPECT_EQ(b.prefill_tokens, 32u);  // blocks 8 and 9
  EXPECT_DOUBLE_EQ(b.cost, 32 + 0.05 * 96);
  EXPECT_DOUBLE_EQ(Of(r, "a").cost, 32 + 3);
  // Its tail drops to a slower tier: 0.4 a token there.
  Place("b", 5, 8, Medium::kDisk);
  r = Route(10);
  EXPECT_EQ(Of(r, "b").cpu_blocks, 3u);
  EXPECT_EQ(Of(r, "b").disk_blocks, 3u);
  EXPECT_DOUBLE_EQ(Of(r, "b").cost, 32 + 0.05 * 48 + 0.4 * 48);
  // Back on its GPU, the idle b is the cheaper.
  Place("b", 2, 8, Medium::kGpu);
  r = Route(10);
  EXPECT_EQ(r.worker_id, "b");
  EXPECT_EQ(r.gpu_blocks, 8u);
  EXPECT_EQ(r.cpu_blocks, 0u);
  EXPECT_DOUBLE_EQ(Of(r, "b").cost, 32);
}

// A CPU-held prefix still beats computing it: b holds 8 blocks on its CPU
// only, a nothing; a loaded b is chosen over an idle a.
TEST_F(RouterMedia, ACpuHeldPrefixStillBeatsComputingIt) {
  Join("a", 0, 0);
  Join("b", 8, 20);
  Place("b", 0, 8, Medium::kCpu);
  RouteResult r = Route(8);
  EXPECT_EQ(r.worker_id, "b");
  EXPECT_EQ(r.gpu_blocks, 0u);
  EXPECT_EQ(r.cpu_blocks, 8u);
  EXPECT_EQ(r.prefill_tokens, 0u);
  EXPECT_DOUBLE_EQ(Of(r, "b").cost, 0.05 * 128 + 20);
  EXPECT_DOUBLE_EQ(Of(r, "a").cost, 128);
}

// A medium goes with its block: removed and stored again, a block is on the
// GPU; a clear and a snapshot put every block there (the subscriber places
// them again after a snapshot).
TEST_F(RouterMedia, AMediumGoesWithItsBlock) {
  Join("b", 8, 0);
  Place("b", 0, 8, Medium::kCpu);
  EXPECT_EQ(Route(8).cpu_blocks, 8u);
  Send("b", BlockEvent::Kind::kRemoved, Hashes(4, 8));
  RouteResult r = Route(8);
  EXPECT_EQ(r.gpu_blocks, 0u);
  EXPECT_EQ(r.cpu_blocks, 4u);
  EXPECT_EQ(r.prefill_tokens, 64u);
  Send("b", BlockEvent::Kind::kRemoved, Hashes(0, 4));
  Send("b", BlockEvent::Kind::kStored, Hashes(0, 8));
  r = Route(8);
  EXPECT_EQ(r.gpu_blocks, 8u) << "stored again, on the GPU";
  EXPECT_EQ(r.cpu_blocks, 0u);
  Place("b", 2, 8, Medium::kCpu);
  Send("b", BlockEvent::Kind::kCleared, {});
  Send("b", BlockEvent::Kind::kStored, Hashes(0, 8));
  EXPECT_EQ(Route(8).gpu_blocks, 8u) << "a clear forgets the media";
  Place("b", 2, 8, Medium::kCpu);
  std::vector<RouterCommand> cmds;
  ASSERT_TRUE(core_.Handle("b", SnapshotChunk{++seq_["b"], kNs, Hashes(0, 8), true}, &cmds).ok());
  EXPECT_EQ(Route(8).gpu_blocks, 8u) << "a snapshot puts every block on the GPU";
  // A block it does not hold has no medium: placing it does nothing, and
  // when it is stored it is on the GPU.
  Place("b", 8, 10, Medium::kCpu);
  Send("b", BlockEvent::Kind::kStored, Hashes(8, 10));
  EXPECT_EQ(Route(10).gpu_blocks, 10u);
}

TEST_F(RouterMedia, AMediumEventIsRefusedWhereItCannotApply) {
  Join("b", 4, 0);
  auto cmds = Send("b", BlockEvent::Kind::kMedium, Hashes(0, 4), static_cast<Medium>(7));
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_EQ(cmds[0].kind, RouterCommand::Kind::kEventRejected);
  EXPECT_EQ(cmds[0].reason, "event 1 places blocks on medium 7: only a worker's GPU, CPU or disk");
  EXPECT_EQ(Route(4).gpu_blocks, 4u) << "nothing moved";
  std::vector<RouterCommand> out;
  ASSERT_TRUE(core_.Hello(SourceHello{"s", SourceKind::kStore, "", 0, 0, 1}, &out).ok());
  ASSERT_TRUE(core_.Handle("s", SnapshotChunk{0, kNs, Hashes(0, 4), true}, &out).ok());
  cmds = Send("s", BlockEvent::Kind::kMedium, Hashes(0, 4), Medium::kCpu);
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_EQ(cmds[0].reason, "event 1 places blocks on medium 1: only a worker's GPU, CPU or disk");
  EXPECT_EQ(Route(4).gpu_blocks, 4u);
}

// Pending blocks (a route's, on its worker until its events show them) go
// on its GPU: they are not what its offloading tier holds.
TEST_F(RouterMedia, PendingBlocksAreNotTakenForOffloadedOnes) {
  Join("b", 8, 0);
  Place("b", 2, 8, Medium::kCpu);
  Route(16, /*counted=*/true);  // blocks 8..15 pending on b
  RouteResult r = Route(16);
  EXPECT_EQ(r.gpu_blocks, 2u + 8u);
  EXPECT_EQ(r.cpu_blocks, 6u);
  EXPECT_EQ(r.disk_blocks, 0u);
  EXPECT_EQ(r.prefill_tokens, 0u);
}

// Blocks a worker holds only off its GPU take no GPU page: its occupancy
// counts the rest.
TEST_F(RouterMedia, OffloadedBlocksTakeNoGpuPage) {
  Join("b", 8, 0);
  std::vector<RouterCommand> cmds;
  SourceLoad l;
  l.free_gpu_pages = 8;
  ASSERT_TRUE(core_.Handle("b", l, &cmds).ok());
  EXPECT_DOUBLE_EQ(Route(8).candidates[0].occupancy, 0.5);
  Place("b", 4, 8, Medium::kCpu);
  ASSERT_TRUE(core_.Handle("b", l, &cmds).ok());
  EXPECT_DOUBLE_EQ(Route(8).candidates[0].occupancy, 4.0 / 12);
}

// The load-order walk prices a worker's media as the full scan does: the
// same choice and costs over random fleets, with workers too many to name
// at one depth (a group), and with routes counted (their blocks pending).
void ExpectTheWalkAgreesWithTheFullScan(int workers, bool one_depth) {
  RouterOptions full_scan;
  full_scan.scan_all_workers = true;
  RouterCore walk{RouterOptions{}}, full{full_scan};
  std::mt19937_64 rng(7);
  for (int w = 0; w < workers; ++w) {
    const std::string id = "w" + std::to_string(w);
    const uint64_t held = one_depth ? 6 : rng() % 12, load = rng() % 64;
    const uint64_t gpu = held == 0 ? 0 : rng() % (held + 1);
    const uint64_t cpu = gpu + (held == gpu ? 0 : rng() % (held - gpu + 1));
    for (RouterCore* core : {&walk, &full}) {
      std::vector<RouterCommand> cmds;
      ASSERT_TRUE(core->Hello(SourceHello{id, SourceKind::kWorker, id, kNs, kBt, 1}, &cmds).ok());
      cmds.clear();
      ASSERT_TRUE(core->Handle(id, SnapshotChunk{0, kNs, Hashes(0, held), true}, &cmds).ok());
      SourceLoad l;
      l.queued_prefill_tokens = load;
      ASSERT_TRUE(core->Handle(id, l, &cmds).ok());
      uint64_t seq = 0;
      for (auto [from, to, m] : {std::tuple{gpu, cpu, Medium::kCpu}, {cpu, held, Medium::kDisk}}) {
        if (from == to) continue;
        BlockEvent e{++seq, BlockEvent::Kind::kMedium, kNs, Hashes(from, to), m};
        ASSERT_TRUE(core->Handle(id, e, &cmds).ok());
      }
      ASSERT_TRUE(cmds.empty()) << cmds[0].reason;
    }
  }
  size_t tiered = 0;  // candidates shown with blocks off their GPU
  for (uint64_t round = 0; round < 2; ++round) {
    for (uint64_t blocks = 1; blocks <= 14; ++blocks) {
      const std::vector<BlockHash> chain = Hashes(0, blocks);
      // The second round's routes leave their blocks pending.
      RouteQuery q = HashQuery(chain, /*counted=*/round == 1);
      q.max_candidates = 3;
      auto a = walk.Route(q), b = full.Route(q);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->worker_id, b->worker_id) << blocks << " blocks";
      ASSERT_EQ(a->candidates.size(), b->candidates.size());
      for (size_t i = 0; i < a->candidates.size(); ++i) {
        const RouteCandidate &x = a->candidates[i], &y = b->candidates[i];
        EXPECT_EQ(x.worker_id, y.worker_id) << blocks;
        EXPECT_DOUBLE_EQ(x.cost, y.cost) << blocks;
        EXPECT_EQ(x.gpu_blocks, y.gpu_blocks) << blocks;
        EXPECT_EQ(x.cpu_blocks, y.cpu_blocks) << blocks;
        EXPECT_EQ(x.disk_blocks, y.disk_blocks) << blocks;
        tiered += x.cpu_blocks + x.disk_blocks > 0;
      }
    }
  }
  EXPECT_GT(tiered, 3u) << "the fleet's tiered workers were weighed";
}

TEST(RouterMediaWalk, TheWalkAgreesWithTheFullScan) {
  ExpectTheWalkAgreesWithTheFullScan(40, false);
}

TEST(RouterMediaWalk, TheWalkAgreesWithTheFullScanOverAGroup) {
  ExpectTheWalkAgreesWithTheFullScan(300, true);  // > PrefixIndex::kGroupFrom at one depth
}

}  // namespace
}  // namespace kvtier::router
