// The worker library against a real kvtier-store (UCX on loopback): pages go
// pool -> staging -> store -> staging -> another worker's pool byte-exact,
// write-back offload on eviction, the staging bound under a burst, and the
// fallback to prefill when the store dies mid-onboard.
#include "worker/connector.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "worker/model.h"

namespace kvtier::worker {
namespace {

using kvtier::testing::ServerProcess;

// 2 x 2 layers x 2 heads x 64 dim x 2 bytes x 16 tokens = 16 KiB blocks.
NamespaceSpec Spec() {
  return NamespaceSpec{"worker-test", "fp16", 2, 2, 64, 16, 0, 1, "", "", ""};
}

std::vector<BlockHash> Chain(uint64_t salt, size_t n) {
  std::vector<uint32_t> tokens(n * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(salt * 100003 + i);
  return ChainHashes(NamespaceId(Spec()), tokens, 16);
}

class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    store_ = std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir_.sub("store"),
        std::vector<std::string>{"--listen=127.0.0.1:" + std::to_string(port_),
                                 "--data-listen=127.0.0.1:" + std::to_string(ucx_port_),
                                 "--data-dir=" + dir_.sub("db"), "--hugepages=false",
                                 "--ram-bytes=64MiB"});
    ASSERT_GT(store_->port(), 0) << store_->Log();
  }
  std::unique_ptr<KvConnector> Make(uint64_t pages, std::string offload, uint64_t staging = 64,
                                    uint64_t max_held = 0, int deadline_ms = 3000) {
    ConnectorOptions o;
    o.max_held_pages = max_held;
    o.spec = Spec();
    o.num_pages = pages;
    o.stores = {store_->address()};
    o.offload = std::move(offload);
    o.staging_blocks = staging;
    o.data.deadline_ms = deadline_ms;
    o.data.shared_memory = DataClientOptions::SharedMemory::kOff;
    auto c = KvConnector::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }
  // Serves a request the way the simulated engine does; returns blocks loaded.
  uint32_t Serve(KvConnector& c, uint64_t id, const std::vector<BlockHash>& chain,
                 absl::Status* load_status = nullptr) {
    auto m = c.Begin(id, chain);
    EXPECT_TRUE(m.ok()) << m.status();
    uint32_t loaded = 0;
    if (m->store_blocks) {
      EXPECT_TRUE(c.StartLoad(id).ok());
      auto l = c.WaitForLoad(id);
      if (l.ok()) loaded = *l;
      if (load_status) *load_status = l.status();
    }
    auto pages = c.AllocateForCompute(id);
    EXPECT_TRUE(pages.ok()) << pages.status();
    for (size_t i = 0; i < pages->size(); ++i) {
      ComputeIntoPage(c.pool().layout(), c.pool().layer_bases(), (*pages)[i], c.namespace_id(),
                      chain[m->gpu_blocks + loaded + i]);
    }
    EXPECT_TRUE(c.Save(id).ok());
    EXPECT_TRUE(c.WaitForSave(id).ok());
    // Every cached page of the chain holds the model's bytes.
    auto all = c.pool().MatchAndRef(chain);
    EXPECT_EQ(all.size(), chain.size());
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_TRUE(PageMatchesModel(c.pool().layout(), c.pool().layer_bases(), all[i],
                                   c.namespace_id(), chain[i]))
          << "block " << i;
      c.pool().Unref(all[i]);
    }
    c.Finished(id);
    return loaded;
  }
  testing::TempDir dir_;
  int port_ = testing::FreePort(), ucx_port_ = testing::FreePort();
  std::unique_ptr<ServerProcess> store_;
};

TEST_F(WorkerTest, WriteThroughThenAnotherWorkerOnboardsByteExact) {
  auto a = Make(256, "write-through");
  auto b = Make(256, "none");
  auto chain = Chain(1, 40);
  EXPECT_EQ(Serve(*a, 1, chain), 0u);  // computes all 40 and saves them to the store
  auto m = b->Begin(2, chain);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->gpu_blocks, 0u);
  EXPECT_EQ(m->store_blocks, 40u);
  b->Finished(2);
  EXPECT_EQ(Serve(*b, 3, chain), 40u);  // verified byte-exact inside Serve
  // Again on b: now all on its GPU.
  auto again = b->Begin(4, chain);
  EXPECT_EQ(again->gpu_blocks, 40u);
  b->Finished(4);
  EXPECT_EQ(a->stats().offloaded_blocks, 40u);
}

// A router's hint that the stores hold nothing past the pages skips the
// lookup; a hint past the pages asks the store, which answers as ever.
TEST_F(WorkerTest, TheStoreIsAskedOnlyWhenTheHintReachesPastThePages) {
  auto a = Make(256, "write-through");
  auto b = Make(256, "none");
  auto c = Make(256, "none");
  auto chain = Chain(2, 12);
  const std::vector<BlockHash> head(chain.begin(), chain.begin() + 6);
  EXPECT_EQ(Serve(*a, 1, chain), 0u);  // the store now holds all twelve
  EXPECT_EQ(Serve(*b, 2, head), 6u);   // b's pages hold the first six
  struct Case {
    const char* what;
    KvConnector* worker;
    std::optional<uint32_t> hint;
    bool skipped;
    uint32_t gpu, store;
  };
  const Case cases[] = {
      {"the hint ends where the pages do: not asked", b.get(), 6, true, 6, 0},
      {"one block past them: asked, the store has six", b.get(), 7, false, 6, 6},
      {"no hint: asked", b.get(), std::nullopt, false, 6, 6},
      // (the router had not heard of the twelve yet: costs the hits, never a wrong block)
      {"a stale hint: not asked", c.get(), 0, true, 0, 0},
      {"the whole prompt on the pages: nothing to ask", a.get(), 12, false, 12, 0},
  };
  uint64_t id = 10;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    auto m = k.worker->Begin(++id, chain, std::nullopt, k.hint);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->lookup_skipped, k.skipped);
    EXPECT_EQ(m->gpu_blocks, k.gpu);
    EXPECT_EQ(m->store_blocks, k.store);
    k.worker->Finished(id);
  }
}

TEST_F(WorkerTest, WriteBackOffloadsEvictedPagesAndSkipsKnownOnes) {
  auto a = Make(32, "write-back");
  // 4 chains of 16 blocks through 32 pages: the first two are evicted.
  for (uint64_t s = 0; s < 4; ++s) Serve(*a, 10 + s, Chain(100 + s, 16));
  a->Drain();
  auto st = a->stats();
  EXPECT_GE(st.pool.evictions, 32u);
  EXPECT_EQ(st.offloaded_blocks, st.pool.evictions);
  auto b = Make(64, "none");
  EXPECT_EQ(Serve(*b, 20, Chain(100, 16)), 16u);
  // Serving the first two chains again loads them from the store and evicts
  // the last two (never offloaded yet: 32 writes); evicting the first two
  // again later writes nothing, since the store has them.
  uint64_t before = a->stats().offloaded_blocks;
  for (uint64_t s = 0; s < 4; ++s) {
    Serve(*a, 30 + s, Chain(100 + s, 16));
    a->Drain();  // offloads are asynchronous: let each land before the next request
  }
  EXPECT_EQ(a->stats().offloaded_blocks - before, 32u);
  EXPECT_EQ(a->stats().loaded_blocks, 64u);
}

TEST_F(WorkerTest, StagingStaysWithinItsBoundUnderABurst) {
  auto a = Make(16, "write-back", /*staging=*/4);
  // 20 chains of 8 blocks through 16 pages: evictions come in a burst.
  for (uint64_t s = 0; s < 20; ++s) Serve(*a, 100 + s, Chain(500 + s, 8));
  a->Drain();
  auto st = a->stats();
  EXPECT_LE(st.staging_peak, 4u);
  EXPECT_GT(st.staging_peak, 0u);
  EXPECT_EQ(st.offloaded_blocks + st.offload_dropped_full + st.offload_failures, st.pool.evictions);
}

TEST_F(WorkerTest, ARequestNeverWaitsForItsSavesAndTheirPagesGoToRequestsThatNeedThem) {
  // 16 pages, 4 staging slots. Two requests look up while the store
  // answers; then it stops answering (SIGSTOP).
  auto a = Make(16, "write-through", /*staging=*/4);
  ASSERT_TRUE(a);
  const auto chain = Chain(900, 16);
  ASSERT_TRUE(a->Begin(1, chain).ok());
  ASSERT_TRUE(a->Begin(2, Chain(901, 16)).ok());
  store_->proc().Kill(SIGSTOP);
  struct Resume {
    ServerProcess& p;
    ~Resume() { p.proc().Kill(SIGCONT); }
  } resume{*store_};
  auto pages = a->AllocateForCompute(1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  ASSERT_EQ(pages->size(), 16u);
  for (size_t i = 0; i < pages->size(); ++i) {
    ComputeIntoPage(a->pool().layout(), a->pool().layer_bases(), (*pages)[i], a->namespace_id(),
                    chain[i]);
  }
  // Saving and closing take no store round trip: the store being stopped
  // costs the request nothing.
  const auto t = std::chrono::steady_clock::now();
  ASSERT_TRUE(a->Save(1).ok());
  a->Finished(1);
  EXPECT_LT(std::chrono::steady_clock::now() - t, std::chrono::milliseconds(100));
  // The offloader copies blocks out 4 at a time (its staging) and waits
  // on the store; the other pages stay referenced for it meanwhile. A
  // request that needs every page takes them from the oldest waiting saves,
  // which are dropped: it never waits for the store either.
  const auto t2 = std::chrono::steady_clock::now();
  auto pages2 = a->AllocateForCompute(2);
  ASSERT_TRUE(pages2.ok()) << pages2.status();
  EXPECT_EQ(pages2->size(), 16u);
  EXPECT_LT(std::chrono::steady_clock::now() - t2, std::chrono::milliseconds(100));
  a->Finished(2);
  // The store back, every save is accounted for: written, failed by the
  // deadline, or dropped for request 2's pages.
  store_->proc().Kill(SIGCONT);
  a->Drain();
  const auto st = a->stats();
  EXPECT_EQ(st.offloaded_blocks + st.offload_failures + st.offload_dropped_full, 16u);
  EXPECT_LE(st.staging_peak, 4u);
}

TEST_F(WorkerTest, AStoreKilledMidOnboardFallsBackToPrefill) {
  // Every saved page may wait for the store: none of the 400 is dropped.
  auto a = Make(512, "write-through", 64, /*max_held=*/512);
  auto chain = Chain(7, 400);
  Serve(*a, 1, chain);
  auto b = Make(512, "none");
  auto m = b->Begin(2, chain);
  ASSERT_EQ(m->store_blocks, 400u);
  // The store stopped first, so the load is in flight when it dies.
  ASSERT_TRUE(store_->proc().Stop());
  ASSERT_TRUE(b->StartLoad(2).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return b->stats().loads == 1; }));
  store_->proc().Kill(SIGKILL);
  auto l = b->WaitForLoad(2);
  // The load fails with a status that says why, and the engine can
  // compute the rest.
  ASSERT_FALSE(l.ok()) << "a load from a stopped, then killed store succeeded";
  EXPECT_NE(l.status().message().find("store"), std::string::npos) << l.status();
  auto pages = b->AllocateForCompute(2);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(pages->size(), 400u);
  b->Finished(2);
  // A new request with the store gone: no store blocks, served by prefill.
  auto gone = b->Begin(3, Chain(8, 10));
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(gone->store_blocks, 0u);
  b->Finished(3);
}

}  // namespace
}  // namespace kvtier::worker
