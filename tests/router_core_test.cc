// RouterCore driven directly: sequence rules, snapshots, epochs, expiry,
// routing, bad input, and replica agreement.
#include "router/router_core.h"
#include "router/wire.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <algorithm>
#include <map>
#include <random>
#include <set>

namespace kvtier::router {
namespace {

constexpr uint64_t kNs = 0xabc;
BlockHash H(uint64_t i) { return BlockHash{i + 1, 77}; }

v1::Hello Worker(const std::string& id, uint64_t epoch = 1) {
  v1::Hello h;
  h.set_source_id(id);
  h.set_kind(v1::SOURCE_WORKER);
  h.set_endpoint(id + ":8000");
  h.set_namespace_id(kNs);
  h.set_block_tokens(16);
  h.set_epoch(epoch);
  return h;
}

v1::SourceMessage Stored(uint64_t seq, std::vector<uint64_t> ids, uint64_t ns = kNs) {
  v1::SourceMessage m;
  m.mutable_event()->set_seq(seq);
  auto* s = m.mutable_event()->mutable_stored();
  s->set_namespace_id(ns);
  for (uint64_t i : ids) {
    auto* h = s->add_hashes();
    h->set_hi(H(i).hi);
    h->set_lo(H(i).lo);
  }
  return m;
}

v1::SourceMessage Removed(uint64_t seq, std::vector<uint64_t> ids) {
  v1::SourceMessage m = Stored(seq, ids);
  v1::BlockStored s = m.event().stored();
  m.mutable_event()->mutable_removed()->set_namespace_id(s.namespace_id());
  *m.mutable_event()->mutable_removed()->mutable_hashes() = s.hashes();
  return m;
}

v1::SourceMessage Snapshot(uint64_t seq, std::vector<uint64_t> ids, bool last = true) {
  v1::SourceMessage m;
  auto* c = m.mutable_snapshot();
  c->set_seq(seq);
  c->set_namespace_id(kNs);
  c->set_last(last);
  for (uint64_t i : ids) {
    auto* h = c->add_hashes();
    h->set_hi(H(i).hi);
    h->set_lo(H(i).lo);
  }
  return m;
}

v1::RouteRequest Req(int blocks) {
  v1::RouteRequest r;
  r.set_namespace_id(kNs);
  for (int i = 0; i < blocks; ++i) {
    auto* h = r.mutable_hashes()->add_hashes();
    h->set_hi(H(i).hi);
    h->set_lo(H(i).lo);
  }
  return r;
}

// Registers workers holding nothing.
void JoinIdle(RouterCore& core, std::initializer_list<const char*> ids) {
  std::vector<RouterCommand> cmds;
  for (const char* id : ids) {
    ASSERT_TRUE(core.Hello(FromWire(Worker(id)), &cmds).ok());
    ASSERT_TRUE(core.Handle(id, FromWire(Snapshot(0, {})), &cmds).ok());
  }
}

class RouterCoreTest : public ::testing::Test {
 protected:
  RouterCoreTest() : core_(RouterOptions{}) {}
  // Registers a worker and answers the snapshot request with `blocks`.
  void Join(const std::string& id, std::vector<uint64_t> blocks, uint64_t epoch = 1) {
    std::vector<RouterCommand> cmds;
    ASSERT_TRUE(core_.Hello(FromWire(Worker(id, epoch)), &cmds).ok());
    ASSERT_EQ(cmds.size(), 1u);
    EXPECT_EQ(cmds[0].reason, "unknown source");
    Send(id, Snapshot(0, blocks));
  }
  // A store shard says hello; its snapshot is still to come.
  void HelloStore(const std::string& id) {
    std::vector<RouterCommand> cmds;
    v1::Hello store;
    store.set_source_id(id);
    store.set_kind(v1::SOURCE_STORE);
    store.set_epoch(1);
    ASSERT_TRUE(core_.Hello(FromWire(store), &cmds).ok());
  }
  std::vector<RouterCommand> Send(const std::string& id, const v1::SourceMessage& m) {
    std::vector<RouterCommand> cmds;
    auto s = core_.Handle(id, FromWire(m), &cmds);
    EXPECT_TRUE(s.ok()) << s;
    return cmds;
  }
  uint64_t Blocks(const std::string& id) {
    for (const auto& s : core_.Sources()) {
      if (s.source_id == id) return s.indexed_blocks;
    }
    return 0;
  }
  RouterCore core_;
};

TEST_F(RouterCoreTest, EventsApplyInOrderAndDuplicatesAreIgnored) {
  Join("w1", {});
  EXPECT_TRUE(Send("w1", Stored(1, {0, 1, 2})).empty());
  EXPECT_TRUE(Send("w1", Stored(1, {0, 1, 2, 3})).empty());  // duplicate: ignored
  EXPECT_EQ(Blocks("w1"), 3u);
  EXPECT_TRUE(Send("w1", Removed(2, {1, 99})).empty());  // 99 was never stored
  EXPECT_EQ(Blocks("w1"), 2u);
  auto st = core_.Stats();
  EXPECT_EQ(st.events_applied, 2u);
  EXPECT_EQ(st.events_duplicate, 1u);
  EXPECT_EQ(st.unknown_removals, 1u);
  EXPECT_EQ(st.indexed_blocks, 2u);
}

TEST_F(RouterCoreTest, AllClearedDropsEverythingOfThatSourceOnly) {
  Join("w1", {0, 1, 2});
  Join("w2", {0, 1});
  v1::SourceMessage clear;
  clear.mutable_event()->set_seq(1);
  clear.mutable_event()->mutable_cleared();
  EXPECT_TRUE(Send("w1", clear).empty());
  EXPECT_EQ(Blocks("w1"), 0u);
  EXPECT_EQ(Blocks("w2"), 2u);
  auto st = core_.Stats();
  EXPECT_EQ(st.indexed_blocks, 2u);
  EXPECT_EQ(st.indexed_replicas, 2u);
  EXPECT_EQ(core_.Route(FromWire(Req(3)))->worker_id, "w2");
}

TEST_F(RouterCoreTest, AGapAsksForASnapshotThatReplacesTheIndex) {
  Join("w1", {});
  Send("w1", Stored(1, {0, 1}));
  auto cmds = Send("w1", Stored(3, {5}));
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_EQ(cmds[0].reason, "sequence gap: expected 2, got 3");
  EXPECT_TRUE(Send("w1", Stored(4, {6})).empty());  // ignored while resyncing
  EXPECT_EQ(Blocks("w1"), 2u);
  Send("w1", Snapshot(4, {0, 2}, false));
  Send("w1", Snapshot(4, {5, 6}, true));
  EXPECT_EQ(Blocks("w1"), 4u);  // 1 is gone, 2, 5, 6 arrived
  Send("w1", Stored(5, {7}));   // continues after the snapshot's seq
  EXPECT_EQ(Blocks("w1"), 5u);
  EXPECT_EQ(core_.Stats().snapshots_applied, 2u);
}

TEST_F(RouterCoreTest, ANewEpochClearsTheSourceAndAsksForASnapshot) {
  Join("w1", {0, 1, 2});
  std::vector<RouterCommand> cmds;
  ASSERT_TRUE(core_.Hello(FromWire(Worker("w1", 2)), &cmds).ok());
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_EQ(cmds[0].reason, "new epoch");
  EXPECT_EQ(Blocks("w1"), 0u);
  EXPECT_EQ(core_.Stats().indexed_blocks, 0u);
  Send("w1", Snapshot(0, {9}));
  EXPECT_EQ(Blocks("w1"), 1u);
  // A reconnect in the same epoch keeps everything.
  cmds.clear();
  ASSERT_TRUE(core_.Hello(FromWire(Worker("w1", 2)), &cmds).ok());
  EXPECT_TRUE(cmds.empty());
  EXPECT_EQ(Blocks("w1"), 1u);
}

TEST_F(RouterCoreTest, SilentSourcesExpireWithTheirBlocks) {
  Join("w1", {0, 1});
  Join("w2", {0});
  auto later = RouterCore::Clock::now() + std::chrono::milliseconds(6000);
  EXPECT_EQ(core_.ExpireSources(RouterCore::Clock::now()), 0u);
  EXPECT_EQ(core_.ExpireSources(later), 2u);
  EXPECT_EQ(core_.Stats().indexed_blocks, 0u);
  EXPECT_EQ(core_.Route(FromWire(Req(2))).status().code(), absl::StatusCode::kUnavailable);
  // An expired source that speaks again must say hello first.
  std::vector<RouterCommand> cmds;
  EXPECT_EQ(core_.Handle("w1", FromWire(Stored(3, {1})), &cmds).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RouterCoreTest, ASourceRemovedLeavesTheIndexAtOnce) {
  Join("w1", {0, 1, 2});
  Join("w2", {0});
  EXPECT_TRUE(core_.RemoveSource("w1"));
  EXPECT_FALSE(core_.RemoveSource("w1"));
  EXPECT_FALSE(core_.RemoveSource("nobody"));
  EXPECT_EQ(core_.Stats().indexed_blocks, 1u);
  auto r = core_.Route(FromWire(Req(3)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id, "w2");
  EXPECT_EQ(r->gpu_blocks, 1u);
  std::vector<RouterCommand> cmds;
  EXPECT_EQ(core_.Handle("w1", FromWire(Stored(3, {1})), &cmds).code(),
            absl::StatusCode::kNotFound);
}

v1::SourceMessage Beat(bool draining, double prefill_tokens_per_s = 1000) {
  v1::SourceMessage m;
  m.mutable_heartbeat()->set_draining(draining);
  m.mutable_heartbeat()->set_prefill_tokens_per_s(prefill_tokens_per_s);
  return m;
}

TEST_F(RouterCoreTest, ADrainingWorkerGetsNoRouteAndLeavesAtOnceWhenItsStreamCloses) {
  Join("w1", {0, 1, 2});
  Join("w2", {});
  core_.Connected("w1", true);
  core_.Connected("w2", true);
  auto r = core_.Route(FromWire(Req(3)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id, "w1");
  Send("w1", Beat(true));
  for (int i = 0; i < 5; ++i) {
    r = core_.Route(FromWire(Req(3)));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->worker_id, "w2");  // its prefix or not, w1 takes nothing new
  }
  // Its blocks stay indexed while it drains (it still holds them).
  EXPECT_EQ(Blocks("w1"), 3u);
  // Draining no more (an operator's undo): it is routed to again.
  Send("w1", Beat(false));
  r = core_.Route(FromWire(Req(3)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id, "w1");
  // Draining, and every worker draining: no route at all.
  Send("w1", Beat(true));
  Send("w2", Beat(true));
  EXPECT_EQ(core_.Route(FromWire(Req(3))).status().code(), absl::StatusCode::kUnavailable);
  Send("w2", Beat(false));
  // A stream closing leaves a worker that is not draining listed (it may
  // reconnect; the heartbeat deadline decides) ...
  core_.Connected("w2", false);
  EXPECT_EQ(core_.Sources().size(), 2u);
  // ... and removes a draining one with its blocks now.
  core_.Connected("w1", false);
  ASSERT_EQ(core_.Sources().size(), 1u);
  EXPECT_EQ(core_.Sources()[0].source_id, "w2");
  EXPECT_EQ(core_.Stats().indexed_blocks, 0u);
}

TEST_F(RouterCoreTest, ListedWorkersCountTheBlocksOnlyTheyHold) {
  Join("w1", {0, 1, 2, 3});
  Join("w2", {0, 1});
  Send("w1", Beat(false, 1600));  // 16-token blocks: 0.01 s a block
  HelloStore("s1");
  Send("s1", Snapshot(0, {3, 9}));
  std::map<std::string, SourceInfo> by_id;
  for (const auto& s : core_.Sources()) by_id[s.source_id] = s;
  // w1: block 2 alone (0 and 1 are w2's too, 3 the store's).
  EXPECT_EQ(by_id["w1"].sole_blocks, 1u);
  EXPECT_DOUBLE_EQ(by_id["w1"].sole_recompute_seconds, 0.01);
  EXPECT_EQ(by_id["w2"].sole_blocks, 0u);
  EXPECT_EQ(by_id["w2"].sole_recompute_seconds, 0);
  EXPECT_EQ(by_id["s1"].sole_blocks, 0u);  // stores are not counted
  v1::SourceInfo wire;
  ToWire(by_id["w1"], &wire);
  EXPECT_EQ(wire.sole_blocks(), 1u);
  EXPECT_DOUBLE_EQ(wire.sole_recompute_seconds(), 0.01);
}

TEST_F(RouterCoreTest, RoutesToTheLongestPrefixAndExplains) {
  Join("w1", {0, 1, 2, 3});
  Join("w2", {0});
  Join("w3", {});
  auto r = core_.Route(FromWire(Req(6)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id, "w1");
  EXPECT_EQ(r->endpoint, "w1:8000");
  EXPECT_EQ(r->gpu_blocks, 4u);
  EXPECT_EQ(r->prefill_tokens, 32u);
  ASSERT_EQ(r->candidates.size(), 3u);
  EXPECT_EQ(r->candidates[1].worker_id, "w2");
  EXPECT_DOUBLE_EQ(r->candidates[1].cost, 80);
  // Load counts: what was routed to w1 since its heartbeat weighs on it.
  EXPECT_EQ(core_.Sources()[0].routed_tokens_since_heartbeat, 32u);
  v1::SourceMessage hb;
  hb.mutable_heartbeat()->set_queued_prefill_tokens(1000);
  Send("w1", hb);
  r = core_.Route(FromWire(Req(6)));
  EXPECT_EQ(r->worker_id, "w2");  // 32 + 1000 > 80
}

// A caller that cannot send to a worker (down, or tried already) names it:
// the route goes to the best of the others, and its load and pending blocks
// go with it, not to the worker the request never reached.
TEST_F(RouterCoreTest, ExcludedWorkersAreNeitherChosenNorChargedWithTheRoute) {
  Join("w1", {0, 1, 2, 3});
  Join("w2", {0});
  Join("w3", {});
  const v1::RouteRequest req = Req(6);
  const std::vector<std::string> w1_down = {"w1", "no-such-worker"};
  RouteQuery q = FromWire(req);
  q.exclude = w1_down;
  auto r = core_.Route(q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id, "w2");
  EXPECT_EQ(r->gpu_blocks, 1u);
  for (const auto& c : r->candidates) EXPECT_NE(c.worker_id, "w1");
  for (const auto& s : core_.Sources()) {
    EXPECT_EQ(s.routed_tokens_since_heartbeat, s.source_id == "w2" ? 80u : 0u) << s.source_id;
  }
  // The blocks pending are w2's: an explanation of the same prompt sees w2
  // holding all six and w1 only the four its events named.
  v1::RouteRequest dry = Req(6);
  dry.set_dry_run(true);
  auto again = core_.Route(FromWire(dry));
  ASSERT_TRUE(again.ok());
  std::map<std::string, uint32_t> depth;
  for (const auto& c : again->candidates) depth[c.worker_id] = c.gpu_blocks;
  EXPECT_EQ(depth["w2"], 6u);
  EXPECT_EQ(depth["w1"], 4u);
  // Every worker excluded: no route, and nobody charged.
  const std::vector<std::string> all = {"w1", "w2", "w3"};
  q.exclude = all;
  auto none = core_.Route(q);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
  uint64_t routed = 0;
  for (const auto& s : core_.Sources()) routed += s.routed_tokens_since_heartbeat;
  EXPECT_EQ(routed, 80u);
}

TEST(RouterInflight, TokensRoutedJustBeforeAHeartbeatStayInTheLoadUntilTheyCanHaveArrived) {
  // A heartbeat may leave its worker before a request routed to it arrives
  // there: with inflight_ms the request's tokens stay in the worker's load,
  // so the next request of a burst goes elsewhere; without, the heartbeat
  // wipes them and the burst piles onto the same worker.
  for (uint64_t inflight : {uint64_t{0}, uint64_t{60000}}) {
    SCOPED_TRACE(inflight);
    RouterOptions o;
    o.inflight_ms = inflight;
    o.pending_ms = 0;  // the same prompt twice: pending, its worker would cost the same
    RouterCore core(o);
    JoinIdle(core, {"w1", "w2"});
    auto first = core.Route(FromWire(Req(6)));
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->prefill_tokens, 96u);
    v1::SourceMessage hb;
    hb.mutable_heartbeat()->set_queued_prefill_tokens(0);
    std::vector<RouterCommand> cmds;
    ASSERT_TRUE(core.Handle(first->worker_id, FromWire(hb), &cmds).ok());
    for (const auto& src : core.Sources()) {
      if (src.source_id == first->worker_id) {
        EXPECT_EQ(src.routed_tokens_since_heartbeat, inflight > 0 ? 96u : 0u);
      }
    }
    auto second = core.Route(FromWire(Req(6)));
    ASSERT_TRUE(second.ok()) << second.status();
    if (inflight > 0) {
      EXPECT_NE(second->worker_id, first->worker_id);
    } else {
      EXPECT_EQ(second->worker_id, first->worker_id);  // the same tie-break, the same worker
    }
  }
}

TEST(RouterInflight, ARouteWithAnIdStaysInTheLoadUntilTheWorkerListsIt) {
  // inflight_ms 0: without an id a heartbeat would wipe the route at once.
  RouterOptions o;
  o.inflight_ms = 0;
  o.pending_ms = 0;
  RouterCore core(o);
  for (const char* id : {"w1", "w2"}) {
    std::vector<RouterCommand> cmds;
    ASSERT_TRUE(core.Hello(FromWire(Worker(id)), &cmds).ok());
    ASSERT_TRUE(core.Handle(id, FromWire(Snapshot(0, {})), &cmds).ok());
  }
  v1::RouteRequest req = Req(6);
  req.set_request_id(41);
  auto first = core.Route(FromWire(req));
  ASSERT_TRUE(first.ok()) << first.status();
  auto routed = [&] {
    for (const auto& src : core.Sources()) {
      if (src.source_id == first->worker_id) return src.routed_tokens_since_heartbeat;
    }
    return uint64_t{999};
  };
  std::vector<RouterCommand> cmds;
  v1::SourceMessage hb;
  hb.mutable_heartbeat()->add_arrived_request_ids(40);  // another request
  ASSERT_TRUE(core.Handle(first->worker_id, FromWire(hb), &cmds).ok());
  EXPECT_EQ(routed(), 96u);
  // Still on its way: the next request of the burst goes to the other worker.
  auto second = core.Route(FromWire(Req(6)));
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->worker_id, first->worker_id);
  hb.mutable_heartbeat()->add_arrived_request_ids(41);
  hb.mutable_heartbeat()->set_queued_prefill_tokens(96);
  ASSERT_TRUE(core.Handle(first->worker_id, FromWire(hb), &cmds).ok());
  EXPECT_EQ(routed(), 0u);  // now in the worker's own queue, counted once
}

TEST(RouterPending, ABurstSharingAPrefixIsCostedAsItsWorkerWillRunIt) {
  // Two idle workers, w2 a little busy. A prompt of 40 blocks goes to w1;
  // the next one, the same 40 blocks and one more, arrives before w1's
  // events show them. w1 will have them by the time it runs it (it matches
  // its cache again): 640 queued + 16 to compute there against 50 + 656
  // on w2. Without pending routes w1 looks like 640 + 656.
  for (uint64_t pending : {uint64_t{0}, uint64_t{2000}}) {
    SCOPED_TRACE(pending);
    RouterOptions o;
    o.pending_ms = pending;
    RouterCore core(o);
    std::vector<RouterCommand> cmds;
    JoinIdle(core, {"w1", "w2"});
    v1::SourceMessage hb;
    hb.mutable_heartbeat()->set_queued_prefill_tokens(50);
    ASSERT_TRUE(core.Handle("w2", FromWire(hb), &cmds).ok());
    auto first = core.Route(FromWire(Req(40)));
    ASSERT_TRUE(first.ok());
    ASSERT_EQ(first->worker_id, "w1");
    auto second = core.Route(FromWire(Req(41)));
    ASSERT_TRUE(second.ok());
    if (pending > 0) {
      EXPECT_EQ(second->worker_id, "w1");
      EXPECT_EQ(second->gpu_blocks, 40u);
      EXPECT_EQ(second->prefill_tokens, 16u);
    } else {
      EXPECT_EQ(second->worker_id, "w2");
      EXPECT_EQ(second->prefill_tokens, 656u);
    }
  }
}

// The same on a fleet whose every worker holds the prompt's first blocks
// (more than Deepen scans: it maps them): the burst's second request
// follows the first, and the others stay at the depth they hold.
TEST(RouterPending, ABurstOnAFleetSharingAPrefixFollowsItsFirstRequest) {
  RouterOptions o;
  RouterCore core(o);
  std::vector<RouterCommand> cmds;
  std::vector<std::string> ids;
  for (int i = 0; i < 40; ++i) {
    ids.push_back("w" + std::to_string(i));
    ASSERT_TRUE(core.Hello(FromWire(Worker(ids.back())), &cmds).ok());
    ASSERT_TRUE(core.Handle(ids.back(), FromWire(Snapshot(0, {0, 1, 2, 3})), &cmds).ok());
  }
  auto first = core.Route(FromWire(Req(40)));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->gpu_blocks, 4u);
  // The others a little busy (an idle fleet would tie: the first request's
  // compute is in its worker's load).
  v1::SourceMessage hb;
  hb.mutable_heartbeat()->set_queued_prefill_tokens(50);
  for (const auto& id : ids) {
    if (id == first->worker_id) continue;
    ASSERT_TRUE(core.Handle(id, FromWire(hb), &cmds).ok());
  }
  v1::RouteRequest next = Req(41);
  next.set_dry_run(true);
  next.set_max_candidates(40);
  auto second = core.Route(FromWire(next));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->worker_id, first->worker_id);
  EXPECT_EQ(second->gpu_blocks, 40u);
  EXPECT_EQ(second->prefill_tokens, 16u);
  ASSERT_EQ(second->candidates.size(), 40u);
  for (const auto& c : second->candidates) {
    EXPECT_EQ(c.gpu_blocks, c.worker_id == first->worker_id ? 40u : 4u) << c.worker_id;
  }
}

// Deepen on many holders (past the few it scans): each worker once, at the
// end of its pending run; a named worker in place, one not named added.
TEST(RouterPending, DeepenNamesEachOfManyWorkersOnceAtItsPendingDepth) {
  PendingRoutes pending(std::chrono::milliseconds(2000));
  PrefixIndex index;
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < 10; ++i) chain.push_back(H(i));
  const auto now = PendingRoutes::Clock::now();
  // Workers 0..39 hold the first four; 0..29 have the rest pending, and
  // 40..59 (holding nothing) the whole prompt.
  for (SourceNum w = 0; w < 30; ++w) pending.Add(kNs, w, ChainView(chain), 4, 1, now);
  for (SourceNum w = 40; w < 60; ++w) pending.Add(kNs, w, ChainView(chain), 0, 1, now);
  PrefixMatch m;
  for (SourceNum w = 0; w < 40; ++w) m.gpu_depth.emplace_back(w, 4);
  m.store_runs.emplace_back(0, 0);
  pending.Deepen(kNs, ChainView(chain), 1, index, &m, now);
  ASSERT_EQ(m.gpu_depth.size(), 60u);
  std::set<SourceNum> seen;
  for (const auto& [w, d] : m.gpu_depth) {
    EXPECT_TRUE(seen.insert(w).second) << "worker " << w << " named twice";
    EXPECT_EQ(d, w >= 30 && w < 40 ? 4u : 10u) << "worker " << w;
  }
}

// A match of `chain` that an empty index gives, deepened with what is
// pending at `at`.
PrefixMatch PendingOnly(const PendingRoutes& pending, const std::vector<BlockHash>& chain,
                        PendingRoutes::Clock::time_point at, uint32_t stride = 1) {
  PrefixIndex index;
  PrefixMatch m;
  m.store_runs.emplace_back(0, 0);
  pending.Deepen(kNs, ChainView(chain), stride, index, &m, at);
  return m;
}

// The kept positions: Sampled(from) is the first at or past `from`, a kept
// one names itself, and between two kept ones every position names the
// next; every stride-th over the first 16 strides, then 8 a doubling.
TEST(RouterPending, SampledNamesTheNextKeptBlock) {
  for (uint32_t stride : {1u, 2u, 5u, 16u, 85u}) {
    SCOPED_TRACE(stride);
    size_t kept = 0;
    for (size_t from = 0; from < 100000; ++from) {
      const size_t s = PendingRoutes::Sampled(from, stride);
      ASSERT_GE(s, from);
      ASSERT_EQ(PendingRoutes::Sampled(s, stride), s);
      ASSERT_TRUE(s == from || s == PendingRoutes::Sampled(from + 1, stride)) << from;
      if (s == from && from < 16 * size_t{stride}) {
        ASSERT_EQ((from + 1) % stride, 0u) << from;
      }
      if (s == from && from + 1 > 16 * size_t{stride} && from + 1 <= 32 * size_t{stride}) ++kept;
    }
    EXPECT_EQ(kept, 8u);  // in the first doubling past 16 strides
  }
}

// A 2,000-block prompt's end is found through the last kept block before
// it, only while the end's own pair holds; a prompt of the same length
// that parts from it after that kept block is not credited with the rest.
TEST(RouterPending, APromptsEndIsFoundThroughTheLastKeptBlockBeforeIt) {
  const auto now = PendingRoutes::Clock::now();
  PendingRoutes pending(std::chrono::milliseconds(60000));
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < 2000; ++i) chain.push_back(H(i));
  pending.Add(kNs, 1, ChainView(chain), 0, 16, now);
  auto depth = [&](const std::vector<BlockHash>& c) {
    const PrefixMatch m = PendingOnly(pending, c, now, 16);
    return m.gpu_depth.empty() ? 0u : m.gpu_depth[0].second;
  };
  EXPECT_EQ(depth(chain), 2000u);
  std::vector<BlockHash> other(chain.begin(), chain.begin() + 1920);
  for (uint64_t i = 1920; i < 2000; ++i) other.push_back(H(50000 + i));
  EXPECT_EQ(depth(other), 1920u);
  pending.Drop(kNs, 1, std::span<const BlockHash>(chain).subspan(1999));
  EXPECT_EQ(depth(chain), 1920u);
}

// Pairs are kept in generations of `ttl` dropped whole: a pair lives its
// whole ttl across a new generation, is gone once its time passes, Drop
// finds it in either generation, and an old generation's pairs leave size().
TEST(RouterPending, APairLivesItsTtlAcrossGenerationsAndNoLonger) {
  using namespace std::chrono_literals;
  const auto t0 = PendingRoutes::Clock::now();
  PendingRoutes pending(1000ms);
  std::vector<BlockHash> chain, other;
  for (uint64_t i = 0; i < 8; ++i) chain.push_back(H(i));
  for (uint64_t i = 0; i < 8; ++i) other.push_back(H(1000 + i));
  auto depth = [&](SourceNum w, PendingRoutes::Clock::time_point at) {
    for (const auto& [num, d] : PendingOnly(pending, chain, at).gpu_depth) {
      if (num == w) return d;
    }
    return 0u;
  };
  // Worker 3 in the first generation (until t0 + 1.5 s), worker 1 too
  // (until t0 + 1.9 s).
  pending.Add(kNs, 3, ChainView(chain), 0, 1, t0 + 500ms);
  pending.Add(kNs, 1, ChainView(chain), 0, 1, t0 + 900ms);
  EXPECT_EQ(pending.size(), 16u);
  // A generation starts at t0 + 1.2 s (the first one is 1 s old); worker 3
  // is in both.
  pending.Add(kNs, 2, ChainView(other), 0, 1, t0 + 1200ms);
  pending.Add(kNs, 3, ChainView(chain), 0, 1, t0 + 1300ms);
  EXPECT_EQ(pending.size(), 32u);
  EXPECT_EQ(depth(1, t0 + 1800ms), 8u);
  EXPECT_EQ(depth(1, t0 + 1950ms), 0u);
  // Drop reaches both generations: the first's pairs would still hold.
  EXPECT_EQ(depth(3, t0 + 1400ms), 8u);
  pending.Drop(kNs, 3, std::span<const BlockHash>(chain).subspan(4));
  EXPECT_EQ(depth(3, t0 + 1400ms), 4u);
  EXPECT_EQ(pending.size(), 24u);
  // A third stretch drops the first generation (workers 1 and 3: 12
  // pairs), a fourth the second (workers 2 and 3: 12 more).
  pending.Add(kNs, 4, ChainView(other), 0, 1, t0 + 2300ms);
  EXPECT_EQ(pending.size(), 20u);
  pending.Add(kNs, 4, ChainView(other), 0, 1, t0 + 3400ms);
  EXPECT_EQ(pending.size(), 16u);
  pending.Forget(4);
  EXPECT_EQ(pending.size(), 0u);
}

// Past the bound the oldest pairs go first, before their time.
TEST(RouterPending, PastTheBoundTheOldestPairsGo) {
  const auto now = PendingRoutes::Clock::now();
  PendingRoutes pending(std::chrono::milliseconds(60000));
  std::vector<BlockHash> first;
  for (uint64_t i = 0; i < 4; ++i) first.push_back(H(i));
  pending.Add(kNs, 1, ChainView(first), 0, 1, now);
  std::vector<BlockHash> chain(4096);
  for (uint64_t r = 0; pending.size() < PendingRoutes::kMaxBlocks; ++r) {
    for (uint64_t i = 0; i < chain.size(); ++i) chain[i] = BlockHash{r + 10, i};
    const size_t before = pending.size();
    pending.Add(kNs, 2, ChainView(chain), 0, 1, now);
    if (pending.size() <= before) break;  // a generation went
    ASSERT_LT(r, 20000u);
  }
  EXPECT_LE(pending.size(), PendingRoutes::kMaxBlocks);
  EXPECT_TRUE(PendingOnly(pending, first, now).gpu_depth.empty());
  // The newest route's pairs stay.
  const PrefixMatch last = PendingOnly(pending, chain, now);
  ASSERT_EQ(last.gpu_depth.size(), 1u);
  EXPECT_EQ(last.gpu_depth[0], std::make_pair(SourceNum{2}, uint32_t{4096}));
}

// Pairs dropped (a worker's Removed events) leave no lasting room behind:
// routes and evictions of the same few blocks for a whole stretch keep the
// tables at their smallest.
TEST(RouterPending, DroppedPairsDoNotGrowTheTables) {
  const auto now = PendingRoutes::Clock::now();
  PendingRoutes pending(std::chrono::milliseconds(60000));
  std::vector<BlockHash> chain;
  for (uint64_t r = 0; r < 20000; ++r) {
    chain.clear();
    for (uint64_t i = 0; i < 16; ++i) chain.push_back(BlockHash{r + 1, i});
    pending.Add(kNs, 1, ChainView(chain), 0, 1, now);
    pending.Drop(kNs, 1, chain);
  }
  EXPECT_EQ(pending.size(), 0u);
  EXPECT_LE(pending.MemoryBytes(), size_t{64} << 10);
}

TEST(RouterPending, ALongPromptKeepsABlockEvery256TokensThenEightADoublingAndItsLast) {
  // 16-token blocks: a route keeps every 16th block up to 256, then 8
  // evenly spaced in each doubling (every 32nd up to 512, every 64th up to
  // 1,024, every 128th up to 2,048), and the last: 16 + 3 x 8 - 1 + 1 = 40
  // of a 2,000-block prompt. Another prompt sharing 1,500 of its blocks
  // then finds the worker's run to the last kept block it shares (1,408:
  // within an eighth), and the same prompt again, or one that goes on
  // past it, finds all 2,000 (its last block was kept, and the last kept
  // block before it, 1,920, says where it is).
  RouterOptions o;
  RouterCore core(o);
  std::vector<RouterCommand> cmds;
  JoinIdle(core, {"w1", "w2"});
  auto first = core.Route(FromWire(Req(2000)));
  ASSERT_TRUE(first.ok());
  auto dry = [&](v1::RouteRequest r) {
    r.set_dry_run(true);
    r.set_max_candidates(2);
    auto res = core.Route(FromWire(r));
    EXPECT_TRUE(res.ok());
    for (const auto& c : res->candidates) {
      if (c.worker_id == first->worker_id) return c.gpu_blocks;
    }
    return uint32_t{999999};
  };
  v1::RouteRequest shared = Req(1500);
  for (int i = 0; i < 500; ++i) {
    auto* h = shared.mutable_hashes()->add_hashes();
    h->set_hi(H(100000 + i).hi);
    h->set_lo(H(100000 + i).lo);
  }
  EXPECT_EQ(dry(shared), 1408u);
  EXPECT_EQ(dry(Req(2000)), 2000u);
  EXPECT_EQ(dry(Req(2001)), 2000u);
  // Within the first 256 blocks, to within 16: the route's first 200.
  EXPECT_EQ(dry(Req(200)), 192u);
  // A longer prompt routed there (the other worker excluded: the first
  // one's queue makes them tie) from the 2,000 pending blocks keeps only
  // its end (its first kept block past them, 2,047, is past its end): a
  // repeat of it still finds all of it.
  const v1::RouteRequest lreq = Req(2010);
  RouteQuery lq = FromWire(lreq);  // (views into lreq)
  const std::vector<std::string> other = {first->worker_id == "w1" ? "w2" : "w1"};
  lq.exclude = other;
  auto longer = core.Route(lq);
  ASSERT_TRUE(longer.ok());
  ASSERT_EQ(longer->worker_id, first->worker_id);
  EXPECT_EQ(dry(Req(2010)), 2010u);
  PendingRoutes alone(std::chrono::milliseconds(2000));
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < 2000; ++i) chain.push_back(H(i));
  alone.Add(kNs, 1, ChainView(chain), 0, PendingRoutes::StrideFor(16), PendingRoutes::Clock::now());
  EXPECT_EQ(alone.size(), 40u);
  // A shared prefix shorter than a stride (112 tokens) is not seen: none of
  // its blocks was kept.
  EXPECT_EQ(dry(Req(7)), 0u);
}

TEST(RouterPending, PendingBlocksExpireAndLeaveWithTheirWorker) {
  RouterOptions o;
  o.pending_ms = 500;
  RouterCore core(o);
  std::vector<RouterCommand> cmds;
  JoinIdle(core, {"w1", "w2"});
  auto first = core.Route(FromWire(Req(10)));
  ASSERT_TRUE(first.ok());
  auto dry = [&] {
    v1::RouteRequest req = Req(10);
    req.set_dry_run(true);
    req.set_max_candidates(2);
    return core.Route(FromWire(req));
  };
  auto now = dry();
  ASSERT_TRUE(now.ok());
  ASSERT_EQ(now->candidates.size(), 2u);
  for (const auto& c : now->candidates) {
    EXPECT_EQ(c.gpu_blocks, c.worker_id == first->worker_id ? 10u : 0u) << c.worker_id;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  auto later = dry();
  ASSERT_TRUE(later.ok());
  for (const auto& c : later->candidates) EXPECT_EQ(c.gpu_blocks, 0u) << c.worker_id;
  // A worker that leaves takes its pending blocks along (its number may
  // be given to the next worker that joins).
  o.pending_ms = 60000;
  RouterCore kept(o);
  ASSERT_TRUE(kept.Hello(FromWire(Worker("w1")), &cmds).ok());
  ASSERT_TRUE(kept.Handle("w1", FromWire(Snapshot(0, {})), &cmds).ok());
  ASSERT_TRUE(kept.Route(FromWire(Req(10))).ok());
  ASSERT_EQ(kept.ExpireSources(RouterCore::Clock::now() + std::chrono::hours(1)), 1u);
  ASSERT_TRUE(kept.Hello(FromWire(Worker("w3")), &cmds).ok());
  ASSERT_TRUE(kept.Handle("w3", FromWire(Snapshot(0, {})), &cmds).ok());
  v1::RouteRequest req = Req(10);
  req.set_dry_run(true);
  auto fresh = kept.Route(FromWire(req));
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->worker_id, "w3");
  EXPECT_EQ(fresh->gpu_blocks, 0u);
}

TEST_F(RouterCoreTest, StoreHeldBlocksCountAsFetchable) {
  Join("w1", {0});
  Join("w2", {});
  HelloStore("store-0");
  Send("store-0", Snapshot(0, {0, 1, 2, 3, 4, 5, 6, 7}));
  auto r = core_.Route(FromWire(Req(10)));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->worker_id, "w1");
  EXPECT_EQ(r->gpu_blocks, 1u);
  EXPECT_EQ(r->store_blocks, 7u);
  EXPECT_EQ(r->prefill_tokens, 32u);
  EXPECT_EQ(r->candidates[1].store_blocks, 8u);  // w2 would fetch all eight
  EXPECT_EQ(r->store_end, 8u);                   // what the worker's lookup may find
  v1::RouteResponse wire;
  ToWire(*r, &wire);
  EXPECT_EQ(wire.store_end_blocks(), 8u);
}

// A route tells its worker how far the stores' run of the prompt goes, so a
// worker holding that much skips a lookup that cannot find anything.
TEST_F(RouterCoreTest, TheStoresRunEndsWhereTheirBlocksEnd) {
  Join("w1", {0, 1, 2, 3, 4});
  v1::RouteRequest req = Req(10);
  req.set_dry_run(true);  // (a route would leave w1 holding all ten, pending)
  // No store known: no hint (a worker must look up).
  auto unknown = core_.Route(FromWire(req));
  ASSERT_TRUE(unknown.ok());
  EXPECT_FALSE(unknown->store_end.has_value());
  v1::RouteResponse wire;
  ToWire(*unknown, &wire);
  EXPECT_FALSE(wire.has_store_end_blocks());
  HelloStore("store-0");
  auto syncing = core_.Route(FromWire(req));  // its snapshot still to come
  ASSERT_TRUE(syncing.ok());
  EXPECT_FALSE(syncing->store_end.has_value());
  Send("store-0", Snapshot(0, {0, 1, 2}));
  auto behind = core_.Route(FromWire(req));
  ASSERT_TRUE(behind.ok());
  EXPECT_EQ(behind->gpu_blocks, 5u);
  EXPECT_EQ(behind->store_blocks, 0u);
  EXPECT_EQ(behind->store_end, 3u);  // w1 holds more: its lookup could find nothing
  Send("store-0", Stored(1, {5, 6}));
  auto past = core_.Route(FromWire(req));
  ASSERT_TRUE(past.ok());
  EXPECT_EQ(past->store_blocks, 2u);
  EXPECT_EQ(past->store_end, 7u);  // from w1's five, blocks 5 and 6
}

// The fetch cost follows the slowest store shard's reported time per block
// against the workers' mean prefill rate; with either missing, the flag.
TEST_F(RouterCoreTest, FetchCostFollowsStoreAndWorkerFigures) {
  Join("w1", {0});
  Join("w2", {});
  std::vector<RouterCommand> cmds;
  for (const char* id : {"store-0", "store-1"}) {
    HelloStore(id);
    Send(id, Snapshot(0, {0, 1, 2, 3, 4, 5, 6, 7}));
  }
  auto r = core_.Route(FromWire(Req(10)));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->fetch.measured);
  EXPECT_DOUBLE_EQ(r->fetch.fetch_cost, core_.options().knobs.fetch_cost);
  auto beat = [&](const std::string& id, double tps,
                  std::vector<std::pair<uint64_t, double>> tiers) {
    v1::SourceMessage m;
    m.mutable_heartbeat()->set_prefill_tokens_per_s(tps);
    for (const auto& [blocks, us] : tiers) {
      auto* t = m.mutable_heartbeat()->add_fetch();
      t->set_tier("ram");
      t->set_blocks(blocks);
      t->set_us_per_block(us);
      t->set_queue_depth(3);
    }
    Send(id, m);
  };
  // Stores report, workers do not: still the flag.
  beat("store-0", 0, {{10, 100}});
  EXPECT_FALSE(core_.Route(FromWire(Req(10)))->fetch.measured);
  // w1 prefills 4,000 tokens/s, w2 12,000: 8,000 on average. store-1 is the
  // slower: tiers weighted by blocks, (10 x 100 + 30 x 500) / 40 = 400 us.
  beat("w1", 4000, {});
  beat("w2", 12000, {});
  beat("store-1", 0, {{10, 100}, {30, 500}});
  r = core_.Route(FromWire(Req(10)));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->fetch.measured);
  EXPECT_EQ(r->fetch.store_id, "store-1");
  EXPECT_DOUBLE_EQ(r->fetch.store_us_per_block, 400);
  EXPECT_EQ(r->fetch.store_queue_depth, 3u);
  EXPECT_DOUBLE_EQ(r->fetch.prefill_tokens_per_s, 8000);
  // 400 us a block of 16 tokens is 25 us a token; computing one takes 125 us.
  EXPECT_NEAR(r->fetch.fetch_cost, 0.2, 1e-12);
  EXPECT_NEAR(r->candidates[0].fetch_cost, 0.2, 1e-12);
  // A store shard that stops fetching (no figures) no longer counts; nor one
  // that leaves.
  beat("store-1", 0, {});
  EXPECT_DOUBLE_EQ(core_.Route(FromWire(Req(10)))->fetch.store_us_per_block, 100);
  EXPECT_EQ(core_.ExpireSources(RouterCore::Clock::now() + std::chrono::hours(1)), 4u);
}

// With the stores known, a worker's pages in use are priced: a new session
// whose only match is a short prefix the store also holds goes to a worker
// with room rather than to the full worker holding that prefix, and a
// session stays where its history is when the workers are equally full.
// Without a store, the holder wins as before.
TEST_F(RouterCoreTest, NewSessionsGoWhereThereIsRoomWhileTheStoresAreKnown) {
  Join("w1", {0, 1, 100, 101, 102, 103});  // the system prompt (0, 1) and another session
  Join("w2", {});
  auto free_pages = [&](const std::string& id, uint64_t n) {
    v1::SourceMessage m;
    m.mutable_heartbeat()->set_free_gpu_pages(n);
    Send(id, m);
  };
  free_pages("w1", 0);                // 6 held, 0 free: occupancy 1
  free_pages("w2", 64);               // 0 held: occupancy 0
  v1::RouteRequest session = Req(4);  // blocks 0, 1 (shared), 2, 3 (its own)
  session.set_dry_run(true);
  auto no_store = core_.Route(FromWire(session));
  ASSERT_TRUE(no_store.ok());
  EXPECT_EQ(no_store->worker_id, "w1");  // no store to give pages back: the holder
  EXPECT_DOUBLE_EQ(no_store->candidates[0].occupancy, 1.0);
  HelloStore("store-0");
  Send("store-0", Snapshot(0, {0, 1, 100, 101, 102, 103}));
  auto spread = core_.Route(FromWire(session));
  ASSERT_TRUE(spread.ok());
  ASSERT_EQ(spread->candidates.size(), 2u);
  EXPECT_EQ(spread->worker_id, "w2");
  EXPECT_EQ(spread->store_blocks, 2u);  // it fetches the shared prefix
  // The fleet's mean occupancy is 0.5. w2: 32 tokens to compute + 0.1 x 32
  // fetched; w1: 32 + 4 x 0.1 x 32 placed x (1.0 - 0.5).
  EXPECT_NEAR(spread->candidates[0].cost, 32 + 3.2, 1e-9);
  EXPECT_NEAR(spread->candidates[1].cost, 32 + 6.4, 1e-9);
  // Equally full, the term is 0 and the session's next turn stays with its
  // history (w1 holds blocks 100..103 of that other session).
  Send("w2", Stored(1, {200, 201, 202, 203, 204, 205}));
  free_pages("w2", 0);
  v1::RouteRequest next_turn;
  next_turn.set_namespace_id(kNs);
  next_turn.set_dry_run(true);
  for (uint64_t i : {0, 1, 100, 101, 102, 103, 104, 105}) {
    auto* h = next_turn.mutable_hashes()->add_hashes();
    h->set_hi(H(i).hi);
    h->set_lo(H(i).lo);
  }
  auto sticky = core_.Route(FromWire(next_turn));
  ASSERT_TRUE(sticky.ok());
  EXPECT_EQ(sticky->worker_id, "w1");
  EXPECT_EQ(sticky->gpu_blocks, 6u);
  ASSERT_EQ(sticky->candidates.size(), 2u);
  EXPECT_NEAR(sticky->candidates[0].cost, 32, 1e-9);             // 2 blocks to compute
  EXPECT_NEAR(sticky->candidates[1].cost, 32 + 0.1 * 96, 1e-9);  // + 6 fetched
}

// A restarted router hears some workers' heartbeats before their
// snapshots: a snapshot updates its worker's occupancy at once, so the
// worker is not priced as empty (and its prefixes sent elsewhere) until its
// next heartbeat.
TEST_F(RouterCoreTest, ASnapshotAfterAHeartbeatUpdatesTheOccupancy) {
  HelloStore("store-0");
  Send("store-0", Snapshot(0, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  auto full = [&](const std::string& id) {
    v1::SourceMessage m;
    m.mutable_heartbeat()->set_free_gpu_pages(0);
    Send(id, m);
  };
  Join("w1", {0, 1, 2, 3, 4, 5, 6, 7});
  full("w1");  // after its snapshot: 8 held, 0 free
  std::vector<RouterCommand> cmds;
  ASSERT_TRUE(core_.Hello(FromWire(Worker("w2")), &cmds).ok());
  full("w2");  // before its snapshot
  Send("w2", Snapshot(0, {0, 1, 2}));
  v1::RouteRequest req = Req(10);
  req.set_dry_run(true);
  auto r = core_.Route(FromWire(req));
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->candidates.size(), 2u);
  for (const auto& c : r->candidates) EXPECT_DOUBLE_EQ(c.occupancy, 1.0) << c.worker_id;
  EXPECT_EQ(r->worker_id, "w1");
  EXPECT_EQ(r->gpu_blocks, 8u);
  // A worker with no heartbeat yet stays at 0: its free pages are unknown.
  Join("w3", {0, 1, 2, 3});
  auto again = core_.Route(FromWire(req));
  ASSERT_TRUE(again.ok());
  bool seen = false;
  for (const auto& c : again->candidates) {
    if (c.worker_id != "w3") continue;
    seen = true;
    EXPECT_DOUBLE_EQ(c.occupancy, 0.0);
  }
  EXPECT_TRUE(seen);
}

// A fetch cost measured above the configured one (an idle store's fetches
// count their lease's release delay) prices fetching as measured, but the
// occupancy term's price per token stays capped at occupancy_weight x the
// configured fetch cost.
TEST_F(RouterCoreTest, TheOccupancyPriceIsCappedAtTheConfiguredFetchCost) {
  Join("w1", {0, 1});
  Join("w2", {});
  HelloStore("store-0");
  Send("store-0", Snapshot(0, {0, 1}));
  auto beat = [&](const std::string& id, uint64_t free, double tps, double us) {
    v1::SourceMessage m;
    m.mutable_heartbeat()->set_free_gpu_pages(free);
    m.mutable_heartbeat()->set_prefill_tokens_per_s(tps);
    if (us > 0) {
      auto* t = m.mutable_heartbeat()->add_fetch();
      t->set_tier("ram");
      t->set_blocks(10);
      t->set_us_per_block(us);
    }
    Send(id, m);
  };
  beat("w1", 0, 8000, 0);       // occupancy 1
  beat("w2", 64, 8000, 0);      // occupancy 0: the mean is 0.5
  beat("store-0", 0, 0, 2000);  // 2 ms a 16-token block at 8,000 tokens/s: 1.0
  v1::RouteRequest req = Req(4);
  req.set_dry_run(true);
  auto r = core_.Route(FromWire(req));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->fetch.measured);
  EXPECT_NEAR(r->fetch.fetch_cost, 1.0, 1e-12);
  ASSERT_EQ(r->candidates.size(), 2u);
  EXPECT_EQ(r->worker_id, "w1");
  // w1: 32 to compute + 4 x 0.1 (not 1.0) x 32 placed x (1 - 0.5);
  // w2: 32 + 1.0 x 32 fetched.
  EXPECT_NEAR(r->candidates[0].cost, 32 + 6.4, 1e-9);
  EXPECT_NEAR(r->candidates[1].cost, 32 + 32, 1e-9);
}

// Prompts that share only a prefix every worker holds tie on cost; they
// spread over the workers by their own last block, not all to the one that
// the shared prefix's hash ranks first.
TEST_F(RouterCoreTest, PromptsTiedOnASharedPrefixSpreadOverItsHolders) {
  for (const char* id : {"w1", "w2", "w3", "w4"}) Join(id, {0});
  std::set<std::string> chosen;
  int passed_over_first = 0;
  for (uint64_t k = 1; k <= 40; ++k) {
    v1::RouteRequest req;
    req.set_namespace_id(kNs);
    req.set_dry_run(true);
    for (uint64_t i : {uint64_t{0}, 1000 + k}) {
      auto* h = req.mutable_hashes()->add_hashes();
      h->set_hi(H(i).hi);
      h->set_lo(H(i).lo);
    }
    auto r = core_.Route(FromWire(req));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->reason, Reason::kTieBreak);
    // A caller tries the chosen worker first, whatever place the tie gave
    // it among the equally cheap.
    const auto order = r->ChosenFirst();
    ASSERT_EQ(order.size(), r->candidates.size());
    EXPECT_EQ(order[0]->worker_id, r->worker_id);
    if (r->candidates[0].worker_id != r->worker_id) passed_over_first++;
    chosen.insert(r->worker_id);
    auto again = core_.Route(FromWire(req));  // stable for the same prompt
    EXPECT_EQ(again->worker_id, r->worker_id);
  }
  EXPECT_EQ(chosen.size(), 4u);
  EXPECT_GT(passed_over_first, 0);  // the case the frontend once got wrong
}

// Holes (the invariant broken) can make group counts overlap; the workers
// holding nothing of the prompt are still weighed (a review's counterexample:
// 600 workers sharing block 0, half with a hole at block 1, one idle worker).
TEST_F(RouterCoreTest, AnIdleWorkerIsWeighedWhenHolesMakeGroupsOverlap) {
  for (int w = 0; w < 600; ++w) {
    std::vector<uint64_t> blocks = {0};
    if (w < 300) blocks.push_back(1);
    if (w >= 300 || w == 0) {
      blocks.push_back(2);
      blocks.push_back(3);
    }
    Join("w" + std::to_string(w), blocks);
    v1::SourceMessage hb;
    hb.mutable_heartbeat()->set_queued_prefill_tokens(100000);
    Send("w" + std::to_string(w), hb);
  }
  Join("idle", {});
  auto r = core_.Route(FromWire(Req(8)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id, "idle");
}

// A snapshot holding `chain`, its last chunk.
v1::SourceMessage SnapshotOf(const std::vector<BlockHash>& chain) {
  v1::SourceMessage snap;
  snap.mutable_snapshot()->set_namespace_id(kNs);
  snap.mutable_snapshot()->set_last(true);
  for (const auto& h : chain) {
    auto* p = snap.mutable_snapshot()->add_hashes();
    p->set_hi(h.hi);
    p->set_lo(h.lo);
  }
  return snap;
}

// A route by token ids, rooted at `variant`.
v1::RouteRequest TokenRoute(const std::vector<uint32_t>& tokens, uint64_t variant = 0) {
  v1::RouteRequest req;
  req.set_namespace_id(kNs);
  req.set_variant(variant);
  for (uint32_t t : tokens) req.mutable_tokens()->add_ids(t);
  return req;
}

TEST_F(RouterCoreTest, TokensAreHashedWithTheNamespaceBlockSize) {
  std::vector<uint32_t> tokens(40);
  for (uint32_t i = 0; i < 40; ++i) tokens[i] = i;
  std::vector<RouterCommand> cmds;
  ASSERT_TRUE(core_.Hello(FromWire(Worker("w1")), &cmds).ok());
  Send("w1", SnapshotOf(ChainHashes(kNs, tokens, 16)));
  ASSERT_TRUE(core_.Hello(FromWire(Worker("w2")), &cmds).ok());
  auto r = core_.Route(FromWire(TokenRoute(tokens)));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->worker_id, "w1");
  EXPECT_EQ(r->gpu_blocks, 2u);
  EXPECT_EQ(r->prefill_tokens, 8u);
}

// A LoRA adapter's (or a salted request's) blocks are rooted at its
// variant: a gRPC route carrying it matches them, one without does not.
TEST_F(RouterCoreTest, ATokenRouteMatchesOnlyBlocksOfItsVariant) {
  std::vector<uint32_t> tokens(40);
  for (uint32_t i = 0; i < 40; ++i) tokens[i] = i;
  const uint64_t sql = ChainVariant("sql-adapter", "");
  std::vector<RouterCommand> cmds;
  ASSERT_TRUE(core_.Hello(FromWire(Worker("w1")), &cmds).ok());
  Send("w1", SnapshotOf(ChainHashes(kNs, tokens, 16, sql)));
  auto plain = core_.Route(FromWire(TokenRoute(tokens)));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->gpu_blocks, 0u);
  auto adapted = core_.Route(FromWire(TokenRoute(tokens, sql)));
  ASSERT_TRUE(adapted.ok());
  EXPECT_EQ(adapted->gpu_blocks, 2u);
  auto other = core_.Route(FromWire(TokenRoute(tokens, ChainVariant("", "tenant-7"))));
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->gpu_blocks, 0u);
}

TEST_F(RouterCoreTest, BadInputGetsAClearStatusAndChangesNothing) {
  Join("w1", {0, 1});
  auto expect = [](absl::Status s, absl::StatusCode code, const std::string& needle) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  std::vector<RouterCommand> cmds;
  v1::Hello bad = Worker("");
  expect(core_.Hello(FromWire(bad), &cmds), absl::StatusCode::kInvalidArgument, "source_id");
  bad = Worker("w9");
  bad.set_kind(v1::SOURCE_KIND_UNSPECIFIED);
  expect(core_.Hello(FromWire(bad), &cmds), absl::StatusCode::kInvalidArgument, "kind");
  bad = Worker("w9");
  bad.set_namespace_id(0);
  expect(core_.Hello(FromWire(bad), &cmds), absl::StatusCode::kInvalidArgument, "namespace");
  bad = Worker("w9");
  bad.clear_endpoint();
  expect(core_.Hello(FromWire(bad), &cmds), absl::StatusCode::kInvalidArgument, "endpoint");
  expect(core_.Handle("nobody", FromWire(Stored(1, {1})), &cmds), absl::StatusCode::kNotFound,
         "hello");
  v1::RouteRequest many = Req(2);
  many.set_max_candidates(1025);
  expect(core_.Route(FromWire(many)).status(), absl::StatusCode::kInvalidArgument,
         "max_candidates");
  many.set_max_candidates(1);
  auto one = core_.Route(FromWire(many));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->candidates.size(), 1u);
  EXPECT_EQ(one->candidates[0].worker_id, one->worker_id);
  expect(core_.Handle("w1", FromWire(v1::SourceMessage()), &cmds),
         absl::StatusCode::kInvalidArgument, "carries no");
  // An event for another namespace is refused; the stream goes on.
  cmds = Send("w1", Stored(1, {5}, /*ns=*/kNs + 1));
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_NE(cmds[0].reason.find("namespace"), std::string::npos);
  v1::SourceMessage empty_event;
  empty_event.mutable_event()->set_seq(2);
  cmds = Send("w1", empty_event);
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_NE(cmds[0].reason.find("empty"), std::string::npos);
  cmds = Send("w1", Stored(3, {}));
  ASSERT_EQ(cmds.size(), 1u);
  // Route: unknown namespace, empty, oversized, inconsistent prompt_tokens.
  v1::RouteRequest r = Req(2);
  r.set_namespace_id(999);
  expect(core_.Route(FromWire(r)).status(), absl::StatusCode::kUnavailable, "no live worker");
  r = Req(0);
  expect(core_.Route(FromWire(r)).status(), absl::StatusCode::kInvalidArgument, "empty");
  r = Req(kMaxPromptBlocks + 1);
  expect(core_.Route(FromWire(r)).status(), absl::StatusCode::kInvalidArgument, "limit");
  r = Req(4);
  r.set_prompt_tokens(10);
  expect(core_.Route(FromWire(r)).status(), absl::StatusCode::kInvalidArgument, "prompt_tokens");
  v1::RouteRequest none;
  none.set_namespace_id(kNs);
  expect(core_.Route(FromWire(none)).status(), absl::StatusCode::kInvalidArgument, "empty");
  // The index is as it was.
  EXPECT_EQ(Blocks("w1"), 2u);
  EXPECT_EQ(core_.Route(FromWire(Req(2)))->gpu_blocks, 2u);
  EXPECT_EQ(core_.Stats().events_rejected, 3u);
}

// Routes run on several threads while events, heartbeats, restarts and
// role changes apply (run under ThreadSanitizer by scripts/sanitize.sh):
// every route names a live worker, and the index's counts add up at the end.
TEST(RouterConcurrency, RoutesRunBesideEventsAndRestarts) {
  RouterCore core{RouterOptions{}};
  std::vector<std::string> ids;
  for (int i = 0; i < 8; ++i) ids.push_back("w" + std::to_string(i));
  {
    std::vector<RouterCommand> cmds;
    for (const auto& id : ids) {
      ASSERT_TRUE(core.Hello(FromWire(Worker(id)), &cmds).ok());
      ASSERT_TRUE(core.Handle(id, FromWire(Snapshot(0, {})), &cmds).ok());
    }
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> routed{0}, bad{0};
  std::vector<std::thread> routers;
  for (int t = 0; t < 3; ++t) {
    routers.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      while (!stop) {
        v1::RouteRequest r = Req(1 + static_cast<int>(rng() % 60));
        r.set_max_candidates(1 + rng() % 4);
        auto res = core.Route(FromWire(r));
        if (res.ok()) {
          routed++;
          if (res->worker_id.empty() || res->worker_id[0] != 'w') bad++;
        } else if (res.status().code() != absl::StatusCode::kUnavailable) {
          bad++;
        }
      }
    });
  }
  std::mt19937_64 rng(99);
  std::vector<uint64_t> seq(ids.size(), 0);
  // 4,000 events at least, and on until the routing threads have routed
  // beside them (a busy machine may not schedule them within the first few
  // milliseconds), for 10 s at most.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (int step = 0;
       step < 4000 || (routed.load() < 100 && std::chrono::steady_clock::now() < until); ++step) {
    const size_t w = rng() % ids.size();
    std::vector<RouterCommand> cmds;
    if (step % 97 == 0) {  // a restart: a new epoch clears it
      v1::Hello h = Worker(ids[w], 2 + step);
      ASSERT_TRUE(core.Hello(FromWire(h), &cmds).ok());
      ASSERT_TRUE(core.Handle(ids[w], FromWire(Snapshot(0, {})), &cmds).ok());
      seq[w] = 0;
      continue;
    }
    v1::SourceMessage m;
    if (step % 7 == 0) {
      m.mutable_heartbeat()->set_queued_prefill_tokens(rng() % 4000);
    } else {
      const uint64_t first = rng() % 50;
      m = rng() % 3 ? Stored(++seq[w], {first, first + 1, first + 2, first + 3})
                    : Removed(++seq[w], {first + 3});
    }
    ASSERT_TRUE(core.Handle(ids[w], FromWire(m), &cmds).ok());
  }
  stop = true;
  for (auto& t : routers) t.join();
  EXPECT_GT(routed.load(), 0u);
  EXPECT_EQ(bad.load(), 0u);
  uint64_t held = 0;
  for (const auto& s : core.Sources()) held += s.indexed_blocks;
  EXPECT_EQ(held, core.Stats().indexed_replicas);
}

// The same decision, reason, GPU depth and candidate list.
void ExpectSameRoute(const RouteResult& a, const RouteResult& b, int step) {
  EXPECT_EQ(a.worker_id, b.worker_id) << "step " << step;
  EXPECT_EQ(a.reason, b.reason) << "step " << step;
  EXPECT_EQ(a.gpu_blocks, b.gpu_blocks) << "step " << step;
  ASSERT_EQ(a.candidates.size(), b.candidates.size()) << "step " << step;
  for (size_t i = 0; i < a.candidates.size(); ++i) {
    EXPECT_EQ(a.candidates[i].worker_id, b.candidates[i].worker_id) << "step " << step;
    EXPECT_DOUBLE_EQ(a.candidates[i].cost, b.candidates[i].cost) << "step " << step;
  }
}

// Property: walking the workers in load order (stopping once no later one
// can be kept) decides and lists exactly what weighing every worker does,
// through events, heartbeats that raise and lower loads, restarts, the
// balance guard and any max_candidates.
TEST(RouterLoadOrder, WalkingInLoadOrderDecidesAsWeighingEveryWorker) {
  // The third round knows a store (so the occupancy term counts) and its
  // heartbeats report free pages.
  for (auto [threshold, with_store] :
       {std::pair{uint64_t{0}, false}, std::pair{uint64_t{3000}, false},
        std::pair{uint64_t{0}, true}}) {
    SCOPED_TRACE(with_store ? "with a store" : "without a store");
    RouterOptions o;
    o.knobs.balance_threshold_tokens = threshold;
    // The two cores see each message a moment apart: a time window on
    // routed tokens could end between them (RouterInflight tests it).
    o.inflight_ms = 0;
    RouterOptions ro = o;
    ro.scan_all_workers = true;
    RouterCore fast(o), ref(ro);
    std::mt19937_64 rng(17 + threshold);
    std::vector<std::string> ids;
    for (int i = 0; i < 40; ++i) ids.push_back("w" + std::to_string(i));
    std::vector<uint64_t> seq(ids.size(), 0);
    for (RouterCore* r : {&fast, &ref}) {
      std::vector<RouterCommand> cmds;
      for (const auto& id : ids) {
        ASSERT_TRUE(r->Hello(FromWire(Worker(id)), &cmds).ok());
        ASSERT_TRUE(r->Handle(id, FromWire(Snapshot(0, {})), &cmds).ok());
      }
      if (with_store) {
        v1::Hello store;
        store.set_source_id("store-0");
        store.set_kind(v1::SOURCE_STORE);
        store.set_epoch(1);
        ASSERT_TRUE(r->Hello(FromWire(store), &cmds).ok());
        ASSERT_TRUE(r->Handle("store-0", FromWire(Snapshot(0, {0, 1, 2, 3, 4, 5})), &cmds).ok());
      }
    }
    int compared = 0, occupied = 0;
    for (int step = 0; step < 4000; ++step) {
      const size_t w = rng() % ids.size();
      v1::SourceMessage m;
      bool send = true;
      switch (rng() % 6) {
        case 0:
          // (Loads the size of the occupancy term where it counts.)
          m.mutable_heartbeat()->set_queued_prefill_tokens(rng() % (with_store ? 300 : 6000));
          if (with_store) m.mutable_heartbeat()->set_free_gpu_pages(rng() % 64);
          break;
        case 1:
        case 2: {
          const uint64_t first = rng() % 30;
          m = Stored(++seq[w], {first, first + 1, first + 2});
          break;
        }
        case 3:
          m = Removed(++seq[w], {rng() % 33});
          break;
        default: {
          send = false;
          v1::RouteRequest r = Req(1 + static_cast<int>(rng() % 34));
          r.set_max_candidates(static_cast<uint32_t>(rng() % 6));
          // (With a store, routes leave loads as the heartbeats set them.)
          r.set_dry_run(with_store);
          auto a = fast.Route(FromWire(r));
          auto b = ref.Route(FromWire(r));
          ASSERT_EQ(a.ok(), b.ok());
          if (!a.ok()) break;
          ExpectSameRoute(*a, *b, step);
          ++compared;
          for (const auto& c : a->candidates) occupied += c.occupancy > 0;
        }
      }
      if (!send) continue;
      for (RouterCore* r : {&fast, &ref}) {
        std::vector<RouterCommand> cmds;
        ASSERT_TRUE(r->Handle(ids[w], FromWire(m), &cmds).ok());
      }
    }
    EXPECT_GT(compared, 1000);
    if (with_store) {
      EXPECT_GT(occupied, 1000);  // the term took part
    }
    if (threshold > 0) {
      EXPECT_GT(fast.Stats().balance_guard, 0u);
    }
  }
}

// An idle fleet (every load 0) is walked a tied worker at a time, one
// hash each; with a store known, a tied worker whose pages are in use costs
// more than the tie and must not be kept for its rank alone.
TEST(RouterLoadOrder, TiedIdleWorkersAreWeighedWithTheirPagesInUse) {
  RouterOptions o;
  o.inflight_ms = 0;
  RouterOptions ro = o;
  ro.scan_all_workers = true;
  RouterCore fast(o), ref(ro);
  for (RouterCore* r : {&fast, &ref}) {
    std::vector<RouterCommand> cmds;
    for (int i = 0; i < 60; ++i) {
      const std::string id = "w" + std::to_string(i);
      ASSERT_TRUE(r->Hello(FromWire(Worker(id)), &cmds).ok());
      // Every other worker holds a block no route asks for, its pages full.
      ASSERT_TRUE(r->Handle(id,
                            FromWire(Snapshot(
                                0, i % 2 ? std::vector<uint64_t>{900} : std::vector<uint64_t>{})),
                            &cmds)
                      .ok());
      v1::SourceMessage beat;
      beat.mutable_heartbeat()->set_free_gpu_pages(i % 2 ? 0 : 64);
      ASSERT_TRUE(r->Handle(id, FromWire(beat), &cmds).ok());
    }
    v1::Hello store;
    store.set_source_id("store-0");
    store.set_kind(v1::SOURCE_STORE);
    store.set_epoch(1);
    ASSERT_TRUE(r->Hello(FromWire(store), &cmds).ok());
    ASSERT_TRUE(r->Handle("store-0", FromWire(Snapshot(0, {0})), &cmds).ok());
  }
  for (uint64_t k = 1; k <= 200; ++k) {
    v1::RouteRequest req;
    req.set_namespace_id(kNs);
    req.set_dry_run(true);
    req.set_max_candidates(1 + k % 3);
    for (uint64_t i : {uint64_t{0}, 1000 + k}) {
      auto* h = req.mutable_hashes()->add_hashes();
      h->set_hi(H(i).hi);
      h->set_lo(H(i).lo);
    }
    auto a = fast.Route(FromWire(req));
    auto b = ref.Route(FromWire(req));
    ASSERT_TRUE(a.ok() && b.ok());
    ExpectSameRoute(*a, *b, static_cast<int>(k));
    EXPECT_EQ(std::stoi(a->worker_id.substr(1)) % 2, 0) << a->worker_id << " has no room";
  }
}

// The same with a fleet most of which shares a prefix (holder lists past
// PrefixIndex::kGroupFrom, matched as groups and walked in load order):
// workers hold prefixes of one chain that grow and shrink from the tail.
TEST(RouterLoadOrder, GroupsOfSharedPrefixesDecideAsNamingEveryWorker) {
  RouterOptions o;
  o.knobs.balance_threshold_tokens = 20000;
  o.inflight_ms = 0;  // as above
  RouterOptions ro = o;
  ro.scan_all_workers = true;
  RouterCore fast(o), ref(ro);
  std::mt19937_64 rng(23);
  const int n = 320;
  std::vector<std::string> ids;
  for (int i = 0; i < n; ++i) ids.push_back("w" + std::to_string(i));
  std::vector<uint64_t> seq(n, 0), depth(n, 0);
  auto send = [&](size_t w, const v1::SourceMessage& m) {
    for (RouterCore* r : {&fast, &ref}) {
      std::vector<RouterCommand> cmds;
      ASSERT_TRUE(r->Handle(ids[w], FromWire(m), &cmds).ok());
    }
  };
  for (RouterCore* r : {&fast, &ref}) {
    std::vector<RouterCommand> cmds;
    for (const auto& id : ids) {
      ASSERT_TRUE(r->Hello(FromWire(Worker(id)), &cmds).ok());
      ASSERT_TRUE(r->Handle(id, FromWire(Snapshot(0, {})), &cmds).ok());
    }
  }
  // Most hold the first 4 blocks (a system prompt); some hold more.
  for (int w = 0; w < n; ++w) {
    depth[w] = w % 10 == 0 ? 0 : 4 + rng() % 3;
    std::vector<uint64_t> blocks;
    for (uint64_t b = 0; b < depth[w]; ++b) blocks.push_back(b);
    if (!blocks.empty()) send(w, Stored(++seq[w], blocks));
    v1::SourceMessage hb;
    hb.mutable_heartbeat()->set_queued_prefill_tokens(rng() % 30000);
    send(w, hb);
  }
  int compared = 0;
  for (int step = 0; step < 3000; ++step) {
    const size_t w = rng() % n;
    switch (rng() % 5) {
      case 0: {
        v1::SourceMessage hb;
        hb.mutable_heartbeat()->set_queued_prefill_tokens(rng() % 30000);
        send(w, hb);
        break;
      }
      case 1:  // grow from the tail
        if (depth[w] < 20) {
          send(w, Stored(++seq[w], {depth[w]}));
          depth[w]++;
        }
        break;
      case 2:  // evict from the tail
        if (depth[w] > 0) {
          depth[w]--;
          send(w, Removed(++seq[w], {depth[w]}));
        }
        break;
      default: {
        v1::RouteRequest r = Req(1 + static_cast<int>(rng() % 22));
        r.set_max_candidates(static_cast<uint32_t>(rng() % 6));
        auto a = fast.Route(FromWire(r));
        auto b = ref.Route(FromWire(r));
        ASSERT_TRUE(a.ok() && b.ok());
        ExpectSameRoute(*a, *b, step);
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 1000);
}

TEST(RouterReplicas, SameEventsGiveTheSameDecisions) {
  RouterOptions o;
  o.knobs.balance_threshold_tokens = 5000;
  RouterCore a(o), b(o);
  std::mt19937_64 rng(5);
  std::vector<std::string> ids = {"w0", "w1", "w2", "w3", "w4", "w5"};
  // The workers register in a different order on each replica.
  for (RouterCore* r : {&a, &b}) {
    std::vector<RouterCommand> cmds;
    for (const auto& id : ids) {
      ASSERT_TRUE(r->Hello(FromWire(Worker(id)), &cmds).ok());
      ASSERT_TRUE(r->Handle(id, FromWire(Snapshot(0, {})), &cmds).ok());
    }
    std::reverse(ids.begin(), ids.end());
  }
  std::vector<uint64_t> seq(ids.size(), 0);
  int compared = 0;
  for (int step = 0; step < 3000; ++step) {
    size_t w = rng() % ids.size();
    v1::SourceMessage m;
    if (step % 10 == 0) {
      m.mutable_heartbeat()->set_queued_prefill_tokens(rng() % 8000);
    } else {
      uint64_t first = rng() % 50;
      m = rng() % 4 ? Stored(++seq[w], {first, first + 1, first + 2}) : Removed(++seq[w], {first});
    }
    std::vector<RouterCommand> ca, cb;
    ASSERT_TRUE(a.Handle(ids[w], FromWire(m), &ca).ok());
    ASSERT_TRUE(b.Handle(ids[w], FromWire(m), &cb).ok());
    if (step % 3 == 0) {
      auto req = Req(1 + static_cast<int>(rng() % 60));
      auto ra = a.Route(FromWire(req));
      auto rb = b.Route(FromWire(req));
      ASSERT_TRUE(ra.ok() && rb.ok());
      EXPECT_EQ(ra->worker_id, rb->worker_id) << step;
      EXPECT_EQ(ra->reason, rb->reason);
      EXPECT_EQ(ra->gpu_blocks, rb->gpu_blocks);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 1000);
  EXPECT_EQ(a.Stats().indexed_replicas, b.Stats().indexed_replicas);
}

}  // namespace
}  // namespace kvtier::router
