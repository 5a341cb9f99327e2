// Engine-registered KV memory (worker/connector.h, "Two memory modes"): the
// engine owns the paged cache in vLLM's layouts or as separate K and V
// tensors, chooses the pages, and saves and loads through kvtier with the
// same leases and checksums as the pool mode. Against a real kvtier-store,
// over UCX (TCP) and through the mapped arena; and the C ABI's engine calls.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <future>
#include <numeric>
#include <random>
#include <thread>

#include "client/store_client.h"
#include "tests/test_util.h"
#include "worker/connector.h"
#include "worker/kvtier_worker.h"

namespace kvtier {
namespace {

using testing::ServerProcess;

// 2 layers x 2 heads x 32 dim x 16 tokens of fp16: 2 KiB chunks, 8 KiB blocks.
NamespaceSpec Spec() {
  return NamespaceSpec{"engine-test", "fp16", 2, 2, 32, 16, 0, 1, "", "", ""};
}
constexpr uint64_t kChunk = 16 * 2 * 32 * 2;
constexpr uint64_t kPages = 12;

// An engine's KV cache: one allocation per layer in the given layout.
struct EngineCache {
  std::string
      layout;  // "kv_first" [2][pages]..., "blocks_first" [pages][2]..., "split" K and V apart
  std::vector<std::vector<uint8_t>> mem;  // per layer (split: K layers then V layers)
  gpu::PageMemory memory;

  explicit EngineCache(std::string l) : layout(std::move(l)) {
    const uint32_t layers = Spec().layers;
    for (uint32_t i = 0; i < layers; ++i) {
      if (layout == "split") {
        mem.emplace_back(kPages * kChunk, 0);
        mem.emplace_back(kPages * kChunk, 0);
        memory.k.push_back(mem[2 * i].data());
        memory.v.push_back(mem[2 * i + 1].data());
        memory.page_stride = kChunk;
      } else {
        mem.emplace_back(2 * kPages * kChunk, 0);
        uint8_t* base = mem.back().data();
        memory.k.push_back(base);
        memory.v.push_back(layout == "kv_first" ? base + kPages * kChunk : base + kChunk);
        memory.page_stride = layout == "kv_first" ? kChunk : 2 * kChunk;
      }
    }
  }
  // Fills K and V of every layer of `page` with bytes drawn from seed.
  void Fill(uint32_t page, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (uint32_t l = 0; l < memory.k.size(); ++l) {
      for (uint8_t* p : {memory.K(l, page), memory.V(l, page)}) {
        for (uint64_t b = 0; b < kChunk; ++b) p[b] = static_cast<uint8_t>(rng());
      }
    }
  }
  bool Same(uint32_t page, const EngineCache& other, uint32_t other_page) const {
    for (uint32_t l = 0; l < memory.k.size(); ++l) {
      if (std::memcmp(memory.K(l, page), other.memory.K(l, other_page), kChunk) != 0 ||
          std::memcmp(memory.V(l, page), other.memory.V(l, other_page), kChunk) != 0) {
        return false;
      }
    }
    return true;
  }
  bool Zero(uint32_t page) const {
    for (uint32_t l = 0; l < memory.k.size(); ++l) {
      for (const uint8_t* p : {memory.K(l, page), memory.V(l, page)}) {
        for (uint64_t b = 0; b < kChunk; ++b) {
          if (p[b] != 0) return false;
        }
      }
    }
    return true;
  }
};

std::vector<BlockHash> Chain(uint64_t n, uint64_t salt = 0) {
  std::vector<uint32_t> tokens(n * Spec().block_tokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 13 + 5 + salt);
  return ChainHashes(NamespaceId(Spec()), tokens, Spec().block_tokens);
}

// (layout, transport, page copier: "" the connector reaches the pages
// itself, "host" the staged path CUDA pages take, with host copies).
class EngineMemory
    : public ::testing::TestWithParam<std::tuple<const char*, const char*, const char*>> {
 protected:
  void SetUp() override {
    store_ = testing::StartLoopbackStore(dir_.sub("store"));
    ASSERT_GT(store_->port(), 0) << store_->Log();
  }
  std::unique_ptr<worker::KvConnector> Make(EngineCache& cache) {
    worker::ConnectorOptions o;
    o.spec = Spec();
    o.num_pages = kPages;
    o.stores = {store_->address()};
    o.staging_blocks = 4;
    o.data.deadline_ms = 5000;
    o.data.shared_memory = std::string(std::get<1>(GetParam())) == "mapped"
                               ? DataClientOptions::SharedMemory::kOn
                               : DataClientOptions::SharedMemory::kOff;
    o.engine_memory = cache.memory;
    o.page_copier = std::get<2>(GetParam());
    o.reserve_budget_ms = 5000;  // in place, however busy the host (the counts say so)
    auto c = worker::KvConnector::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // `c` computes chain[i] into pages[i] (filled from seed + i) and saves
  // them all to the store as `request`.
  static void ComputeAndSave(worker::KvConnector& c, EngineCache& cache, uint64_t request,
                             const std::vector<BlockHash>& chain,
                             const std::vector<uint32_t>& pages, uint64_t seed) {
    for (uint32_t i = 0; i < pages.size(); ++i) cache.Fill(pages[i], seed + i);
    ASSERT_TRUE(c.Lookup(request, chain, 0).ok());
    ASSERT_TRUE(c.SaveFrom(request, 0, pages).ok());
    ASSERT_TRUE(c.WaitForSave(request).ok());
    c.Finished(request);
  }
  // The page copier reads the blocks in place: a staged variant whose
  // store is mapped here.
  static bool InPlace() {
    return std::string(std::get<1>(GetParam())) == "mapped" && *std::get<2>(GetParam()) != 0;
  }

  testing::TempDir dir_;
  std::unique_ptr<ServerProcess> store_;
};

TEST_P(EngineMemory, BlocksSavedFromOneEnginesPagesLoadIntoAnothersLayerByLayer) {
  EngineCache a_cache(std::get<0>(GetParam())), b_cache(std::get<0>(GetParam()));
  auto a = Make(a_cache);
  auto b = Make(b_cache);
  ASSERT_TRUE(a && b);
  const auto chain = Chain(6);
  // A computes blocks 0..5 into pages 3, 5, 7, 9, 11, 1 and saves them.
  const std::vector<uint32_t> a_pages = {3, 5, 7, 9, 11, 1};
  for (size_t i = 0; i < a_pages.size(); ++i) a_cache.Fill(a_pages[i], 100 + i);
  auto m = a->Lookup(1, chain, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->store_blocks, 0u);
  ASSERT_TRUE(a->SaveFrom(1, 0, a_pages).ok());
  for (uint32_t p : a_pages) a_cache.Fill(p, 999);  // the engine reuses its pages at once
  ASSERT_TRUE(a->WaitForSave(1).ok());
  a->Finished(1);
  EXPECT_EQ(a->stats().offloaded_blocks, 6u);
  EXPECT_EQ(a->stats().in_place_saved, InPlace() ? 6u : 0u)
      << "a page copier gathers into a mapped store's slots";
  for (size_t i = 0; i < a_pages.size(); ++i) a_cache.Fill(a_pages[i], 100 + i);  // for comparing

  // B has block 0 in its own prefix cache and loads blocks 1..4 of the 5 found.
  m = b->Lookup(2, chain, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->gpu_blocks, 1u);
  EXPECT_EQ(m->store_blocks, 5u);
  const std::vector<uint32_t> b_pages = {0, 2, 10, 4};
  ASSERT_TRUE(b->StartLoadInto(2, b_pages).ok());
  for (uint32_t l = 0; l < Spec().layers; ++l) ASSERT_TRUE(b->WaitForLayer(2, l).ok());
  auto loaded = b->WaitForLoad(2);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 4u);
  for (size_t i = 0; i < b_pages.size(); ++i) {
    EXPECT_TRUE(b_cache.Same(b_pages[i], a_cache, a_pages[i + 1])) << "block " << i + 1;
  }
  for (uint32_t p : {1u, 3u, 5u, 6u, 7u, 8u, 9u, 11u}) EXPECT_TRUE(b_cache.Zero(p)) << "page " << p;
  b->Finished(2);
  EXPECT_EQ(b->stats().loaded_blocks, 4u);
  // A page copier reads a mapped store's blocks in place (no staging); the
  // other paths move them.
  EXPECT_EQ(b->stats().in_place_blocks, InPlace() ? 4u : 0u);
}

// A byte flipped in the store's copy of block 2 (its RAM, read through the
// arena mapped here): the load keeps the two verified blocks before it,
// fails from it on, and the store drops the corrupt block, so the next
// lookup ends before it instead of failing on it again.
TEST_P(EngineMemory, ACorruptBlockInTheStoreEndsTheLoadAndTheStoreDropsIt) {
  EngineCache a_cache(std::get<0>(GetParam())), b_cache(std::get<0>(GetParam()));
  auto a = Make(a_cache);
  auto b = Make(b_cache);
  ASSERT_TRUE(a && b);
  const auto chain = Chain(4, 11);
  ASSERT_NO_FATAL_FAILURE(ComputeAndSave(*a, a_cache, 1, chain, {0, 1, 2, 3}, 40));
  {
    DataClientOptions o;
    o.shared_memory = DataClientOptions::SharedMemory::kOn;
    ShardedStoreClient raw({store_->address()}, o);
    auto ns = raw.RegisterNamespace(Spec());
    ASSERT_TRUE(ns.ok()) << ns.status();
    auto pin = raw.Pin(ns->id, ns->block_bytes, chain);
    ASSERT_TRUE(pin.ok()) << pin.status();
    ASSERT_EQ(pin->blocks, 4u);
    auto views = raw.View(*pin, ns->block_bytes, 0, 4);
    ASSERT_TRUE(views.ok()) << views.status();
    EXPECT_EQ(VerifyViews(*views, ns->block_bytes, 2), 4u);
    const_cast<uint8_t*>(views->blocks[2])[kChunk + 3] ^= 0x5a;  // layer 0's V chunk
    EXPECT_EQ(VerifyViews(*views, ns->block_bytes, 2), 2u);
    raw.Release(*pin);
  }
  auto m = b->Lookup(2, chain, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->store_blocks, 4u);
  ASSERT_TRUE(b->StartLoadInto(2, {8, 9, 10, 11}).ok());
  auto loaded = b->WaitForLoad(2);
  if (InPlace()) {
    // Verified block by block: the two before the corrupt one are kept.
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(*loaded, 2u);
    EXPECT_TRUE(b_cache.Same(8, a_cache, 0));
    EXPECT_TRUE(b_cache.Same(9, a_cache, 1));
  } else {
    // One read of the four: its checksum verdict fails it whole.
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  }
  b->Finished(2);
  const worker::ConnectorStats st = b->stats();
  EXPECT_EQ(st.load_failures, 1u);
  EXPECT_EQ(st.loaded_blocks, InPlace() ? 2u : 0u);
  EXPECT_EQ(st.corrupt_dropped, 1u) << "the store drops the corrupt block, no more";
  m = b->Lookup(3, chain, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->store_blocks, 2u) << "the corrupt block is gone from the store";
  b->Finished(3);
}

// The store is killed between a request's pin and its load: the load ends
// with a verdict by its deadline (in place, the arena this process maps
// still holds the pinned bytes, and they verify; over the data plane the
// read fails), and once a store is back the connector saves and loads
// again.
TEST_P(EngineMemory, AStoreKilledUnderAPinnedLoadLeavesAVerdictAndTheConnectorServing) {
  EngineCache a_cache(std::get<0>(GetParam())), b_cache(std::get<0>(GetParam()));
  auto a = Make(a_cache);
  auto b = Make(b_cache);
  ASSERT_TRUE(a && b);
  const auto chain = Chain(3, 23);
  ASSERT_NO_FATAL_FAILURE(ComputeAndSave(*a, a_cache, 1, chain, {0, 1, 2}, 60));
  auto m = b->Lookup(2, chain, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->store_blocks, 3u);
  store_->proc().Kill(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(b->StartLoadInto(2, {4, 5, 6}).ok());
  auto loaded = b->WaitForLoad(2);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  if (InPlace()) {
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(*loaded, 3u);
    for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(b_cache.Same(4 + i, a_cache, i));
  } else {
    EXPECT_FALSE(loaded.ok()) << "a read from a dead store";
  }
  b->Finished(2);

  store_->Start();  // empty, on a new port: connectors for it
  ASSERT_GT(store_->port(), 0) << store_->Log();
  auto a2 = Make(a_cache);
  ASSERT_TRUE(a2);
  ASSERT_NO_FATAL_FAILURE(ComputeAndSave(*a2, a_cache, 3, chain, {0, 1, 2}, 60));
  auto b2 = Make(b_cache);
  ASSERT_TRUE(b2);
  m = b2->Lookup(4, chain, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->store_blocks, 3u);
  ASSERT_TRUE(b2->StartLoadInto(4, {8, 9, 10}).ok());
  loaded = b2->WaitForLoad(4);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 3u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(b_cache.Same(8 + i, a_cache, i));
  b2->Finished(4);
}

TEST_P(EngineMemory, BadPagesAndCallsOfTheOtherModeAreRefusedAndChangeNothing) {
  EngineCache a_cache(std::get<0>(GetParam())), b_cache(std::get<0>(GetParam()));
  auto a = Make(a_cache);
  auto b = Make(b_cache);
  ASSERT_TRUE(a && b);
  const auto chain = Chain(3, 7);
  for (uint32_t i = 0; i < 3; ++i) a_cache.Fill(i, 7 + i);
  ASSERT_TRUE(a->Lookup(1, chain, 0).ok());
  EXPECT_EQ(a->SaveFrom(1, 0, {0, kPages}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->SaveFrom(1, 2, {0, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->SaveFrom(9, 0, {0}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a->Begin(5, chain).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a->AllocateForCompute(1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a->Save(1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a->Lookup(3, {}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Lookup(3, chain, 4).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a->SaveFrom(1, 0, {0, 1, 2}).ok());
  ASSERT_TRUE(a->WaitForSave(1).ok());
  a->Finished(1);

  auto m = b->Lookup(2, chain, 0);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->store_blocks, 3u);
  EXPECT_EQ(b->StartLoadInto(2, {0, 1, 2, 3}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->StartLoadInto(2, {0, kPages}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->StartLoadInto(2, {4, 4}).code(), absl::StatusCode::kInvalidArgument);
  for (uint32_t p = 0; p < kPages; ++p)
    EXPECT_TRUE(b_cache.Zero(p)) << "a refused load wrote page " << p;
  // Looked up again (a scheduler's retry), then loaded: the refusals changed nothing.
  m = b->Lookup(2, chain, 0);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->store_blocks, 3u);
  ASSERT_TRUE(b->StartLoadInto(2, {6, 7, 8}).ok());
  EXPECT_EQ(b->StartLoadInto(2, {6}).code(), absl::StatusCode::kFailedPrecondition);
  auto loaded = b->WaitForLoad(2);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 3u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(b_cache.Same(6 + i, a_cache, i));
  b->Finished(2);
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineMemory,
                         ::testing::Combine(::testing::Values("kv_first", "blocks_first", "split"),
                                            ::testing::Values("ucx", "mapped"),
                                            ::testing::Values("", "host")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param) +
                                  (*std::get<2>(info.param) ? "_staged" : "");
                         });

// Options of an engine-mode connector over `cache` saving to `store`
// through the staging (no shared memory).
worker::ConnectorOptions StagedSaves(const testing::ServerProcess& store, EngineCache& cache,
                                     uint32_t staging_blocks, uint32_t offload_batch,
                                     int deadline_ms) {
  worker::ConnectorOptions o;
  o.spec = Spec();
  o.num_pages = kPages;
  o.stores = {store.address()};
  o.staging_blocks = staging_blocks;
  o.offload_batch = offload_batch;
  o.data.deadline_ms = deadline_ms;
  o.data.shared_memory = DataClientOptions::SharedMemory::kOff;
  o.engine_memory = cache.memory;
  return o;
}

// Issue #30 ("offloads never hold a request"): with the store stalled, a
// save finds the staging full (the offloader's put is stuck) and waits no
// longer than kOffloadStalled, not the deadline: it takes the slots of the
// oldest request's queued blocks (dropped, counted), and when the oldest
// queued blocks are its own it drops the rest of its save. Once the store
// answers again, what was not dropped reaches it: each chain keeps a
// prefix. (The offloader may have taken one or two of request 2's blocks
// into the stuck put, k below; the counts follow from k.)
TEST(EngineMemorySaves, ASaveNeverWaitsForAStalledStoreItDropsTheOldestQueuedBlocks) {
  testing::TempDir dir;
  auto store = testing::StartLoopbackStore(dir.sub("store"));
  ASSERT_GT(store->port(), 0) << store->Log();
  EngineCache cache("kv_first");
  for (uint32_t p = 0; p < kPages; ++p) cache.Fill(p, p);
  auto made = worker::KvConnector::Create(StagedSaves(*store, cache, 4, 2, 5000));
  ASSERT_TRUE(made.ok()) << made.status();
  auto& c = **made;
  const auto old_chain = Chain(4, 1), new_chain = Chain(4, 2);
  // Healthy: both requests open (their lookups answered) and a save lands.
  ASSERT_TRUE(c.Lookup(1, Chain(1, 3), 0).ok());
  ASSERT_TRUE(c.SaveFrom(1, 0, {11}).ok());
  ASSERT_TRUE(c.WaitForSave(1).ok());
  ASSERT_TRUE(c.Lookup(2, old_chain, 0).ok());
  ASSERT_TRUE(c.Lookup(3, new_chain, 0).ok());

  ASSERT_TRUE(store->proc().Stop());
  // Request 2's four blocks fill the staging: the offloader's put of its
  // first k (1 or 2) sticks, the rest stay queued.
  ASSERT_TRUE(c.SaveFrom(2, 0, {0, 1}).ok());
  // The offloader took them into its put (it runs at nice 10: waited for).
  ASSERT_TRUE(testing::WaitFor([&] { return c.stats().offload_blocks_in_flight > 0; }));
  ASSERT_TRUE(c.SaveFrom(2, 2, {2, 3}).ok());
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status saved = c.SaveFrom(3, 0, {4, 5, 6, 7});
  const auto save_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  ::kill(store->proc().pid(), SIGCONT);
  std::printf("a save with the store stalled returned after %lld ms: %s\n",
              static_cast<long long>(save_ms), saved.ToString().c_str());
  EXPECT_LT(save_ms, 1000) << "the save waited for the stalled store";
  // Request 3's first 4 - k blocks took request 2's queued slots; its next
  // found its own blocks oldest in the queue: it and those after it are not
  // saved.
  EXPECT_EQ(saved.code(), absl::StatusCode::kResourceExhausted) << saved;
  const uint64_t dropped = c.stats().offload_dropped_full;
  ASSERT_TRUE(dropped == 3 || dropped == 4) << dropped;
  const uint64_t k = 5 - dropped;  // request 2's blocks in the stuck put
  EXPECT_NE(saved.message().find("block " + std::to_string(4 - k)), std::string::npos) << saved;

  // The stuck put and the queued blocks land once the store answers.
  EXPECT_TRUE(c.WaitForSave(2).ok());
  EXPECT_TRUE(c.WaitForSave(3).ok());
  StoreClient control(store->address());
  auto ns = control.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto old_held = control.Lookup(ns->id, old_chain);
  auto new_held = control.Lookup(ns->id, new_chain);
  ASSERT_TRUE(old_held.ok() && new_held.ok());
  EXPECT_EQ(old_held->size(), k);      // the put that was out
  EXPECT_EQ(new_held->size(), 4 - k);  // the blocks that took the queued slots
  c.Finished(1);
  c.Finished(2);
  c.Finished(3);
}

// Saves through a page copier to a mapped store go straight into the
// store's slots (a reservation, then the gather); with the store stalled,
// the reservation misses its budget and the save goes through the staging
// instead, which never waits: SaveFrom returns at once, and every block
// lands once the store answers.
TEST(EngineMemorySaves, ASaveInPlaceNeverWaitsForAStalledStore) {
  testing::TempDir dir;
  auto store = testing::StartLoopbackStore(dir.sub("store"));
  ASSERT_GT(store->port(), 0) << store->Log();
  EngineCache cache("blocks_first");
  for (uint32_t p = 0; p < kPages; ++p) cache.Fill(p, p);
  worker::ConnectorOptions o;
  o.spec = Spec();
  o.num_pages = kPages;
  o.stores = {store->address()};
  o.staging_blocks = 8;
  o.offload_batch = 2;
  o.data.deadline_ms = 5000;
  o.data.shared_memory = DataClientOptions::SharedMemory::kOn;
  o.engine_memory = cache.memory;
  o.page_copier = "host";
  auto made = worker::KvConnector::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  auto& c = **made;
  const auto chain = Chain(4, 5);
  ASSERT_TRUE(c.Lookup(1, Chain(1, 6), 0).ok());
  ASSERT_TRUE(c.SaveFrom(1, 0, {11}).ok());
  ASSERT_TRUE(c.WaitForSave(1).ok());
  EXPECT_EQ(c.stats().in_place_saved, 1u);
  ASSERT_TRUE(c.Lookup(2, chain, 0).ok());

  ASSERT_TRUE(store->proc().Stop());
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status saved = c.SaveFrom(2, 0, {0, 1, 2, 3});
  const auto save_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  ::kill(store->proc().pid(), SIGCONT);
  EXPECT_TRUE(saved.ok()) << saved;
  EXPECT_LT(save_ms, 1000) << "the save waited for the stalled store";
  ASSERT_TRUE(c.WaitForSave(2).ok());
  const worker::ConnectorStats st = c.stats();
  EXPECT_EQ(st.offloaded_blocks, 5u);
  EXPECT_EQ(st.in_place_saved, 1u) << "the stalled store's blocks went through the staging";
  StoreClient control(store->address());
  auto ns = control.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto held = control.Lookup(ns->id, chain);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->size(), 4u);
  c.Finished(1);
  c.Finished(2);
}

// Issue #60: the connector's note of what it saved is a hint. A block the
// store lost (evicted here; a restart is the same) is saved again the next
// time the engine computes it and asks to save it.
TEST(EngineMemorySaves, ABlockTheStoreLostIsSavedAgain) {
  testing::TempDir dir;
  auto store = testing::StartLoopbackStore(dir.sub("store"));
  ASSERT_GT(store->port(), 0) << store->Log();
  EngineCache cache("kv_first");
  for (uint32_t p = 0; p < kPages; ++p) cache.Fill(p, p);
  auto made = worker::KvConnector::Create(StagedSaves(*store, cache, 4, 32, 10000));
  ASSERT_TRUE(made.ok()) << made.status();
  auto& c = **made;
  const auto chain = Chain(3, 31);
  StoreClient control(store->address());
  auto held = [&] {
    auto ns = control.RegisterNamespace(Spec());
    if (!ns.ok()) return size_t{0};
    auto found = control.Lookup(ns->id, chain);
    return found.ok() ? found->size() : size_t{0};
  };
  ASSERT_TRUE(c.Lookup(1, chain, 0).ok());
  ASSERT_TRUE(c.SaveFrom(1, 0, {0, 1, 2}).ok());
  ASSERT_TRUE(c.WaitForSave(1).ok());
  c.Finished(1);
  ASSERT_EQ(held(), 3u);

  v1::EvictRequest all;
  all.set_all(true);
  ASSERT_TRUE(control.Evict(all).ok());
  ASSERT_EQ(held(), 0u);
  ASSERT_TRUE(c.Lookup(2, chain, 0).ok());
  ASSERT_TRUE(c.SaveFrom(2, 0, {0, 1, 2}).ok());
  ASSERT_TRUE(c.WaitForSave(2).ok());
  c.Finished(2);
  EXPECT_EQ(held(), 3u) << "the connector trusted its own note over the store";
  // Saved again while the store holds it: the store takes no second copy.
  const uint64_t offloaded = c.stats().offloaded_blocks;
  ASSERT_TRUE(c.Lookup(3, chain, 0).ok());
  ASSERT_TRUE(c.SaveFrom(3, 0, {0, 1, 2}).ok());
  ASSERT_TRUE(c.WaitForSave(3).ok());
  c.Finished(3);
  EXPECT_EQ(c.stats().offloaded_blocks, offloaded);
  EXPECT_GE(c.stats().offload_skipped_known, 3u);
}

// Issue #60: a drain that runs out of time drops the saves the store has
// not taken, and ends each one: a WaitForSave on their request returns
// (with the reason) instead of waiting for saves that will never be made.
TEST(EngineMemorySaves, ADrainPastItsDeadlineEndsEverySaveItDrops) {
  testing::TempDir dir;
  auto store = testing::StartLoopbackStore(dir.sub("store"));
  ASSERT_GT(store->port(), 0) << store->Log();
  EngineCache cache("kv_first");
  for (uint32_t p = 0; p < kPages; ++p) cache.Fill(p, p);
  auto made = worker::KvConnector::Create(StagedSaves(*store, cache, 8, 2, 1000));
  ASSERT_TRUE(made.ok()) << made.status();
  auto& c = **made;
  ASSERT_TRUE(c.Lookup(1, Chain(1, 41), 0).ok());
  ASSERT_TRUE(c.SaveFrom(1, 0, {11}).ok());
  ASSERT_TRUE(c.WaitForSave(1).ok());
  ASSERT_TRUE(c.Lookup(2, Chain(6, 42), 0).ok());
  ASSERT_TRUE(store->proc().Stop());
  // The offloader's put of the first blocks sticks; the rest stay queued.
  ASSERT_TRUE(c.SaveFrom(2, 0, {0, 1, 2, 3, 4, 5}).ok());
  EXPECT_FALSE(c.Drain(std::chrono::steady_clock::now() + std::chrono::milliseconds(100)));
  EXPECT_GT(c.stats().offload_dropped_full, 0u);
  auto waited = std::async(std::launch::async, [&c] { return c.WaitForSave(2); });
  const bool ended = waited.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  ::kill(store->proc().pid(), SIGCONT);
  ASSERT_TRUE(ended) << "WaitForSave waits for saves the drain dropped";
  const absl::Status s = waited.get();
  EXPECT_FALSE(s.ok());
  c.Finished(1);
  c.Finished(2);
}

TEST(EngineMemoryOptions, RegistrationErrorsAreClear) {
  EngineCache cache("kv_first");
  worker::ConnectorOptions o;
  o.spec = Spec();
  o.num_pages = kPages;
  gpu::PageMemory m = cache.memory;
  m.k.pop_back();
  o.engine_memory = m;
  auto c = worker::KvConnector::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("layers"), std::string::npos) << c.status();
  m = cache.memory;
  m.page_stride = kChunk - 2;
  o.engine_memory = m;
  EXPECT_EQ(worker::KvConnector::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  m = cache.memory;
  m.v[0] = m.k[0] + 16;  // V overlapping K
  o.engine_memory = m;
  EXPECT_EQ(worker::KvConnector::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  m = cache.memory;
  m.page_stride = kChunk;  // V of page p would be K of page p + 1
  m.v[1] = m.k[1] + kChunk;
  o.engine_memory = m;
  EXPECT_EQ(worker::KvConnector::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.engine_memory = cache.memory;
  o.spec.kv_wire = kKvWireInt8;
  c = worker::KvConnector::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("int8"), std::string::npos) << c.status();
}

TEST(EngineMemoryOptions, PageCopiersAreCheckedAtCreation) {
  EngineCache cache("kv_first");
  worker::ConnectorOptions o;
  o.spec = Spec();
  o.num_pages = kPages;
  o.engine_memory = cache.memory;
  o.page_copier = "gpu";
  auto c = worker::KvConnector::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("cuda:N"), std::string::npos) << c.status();
  // The pool mode has no engine memory to reach.
  o.engine_memory.reset();
  o.page_copier = "host";
  c = worker::KvConnector::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("engine memory"), std::string::npos) << c.status();
  // Host pages named as a GPU's: without the module (or without a GPU)
  // there is no CUDA; with both, the pages are not on the device. Refused
  // either way, saying why.
  o.engine_memory = cache.memory;
  o.page_copier = "cuda:0";
  c = worker::KvConnector::Create(o);
  ASSERT_FALSE(c.ok());
  const auto code = c.status().code();
  EXPECT_TRUE(code == absl::StatusCode::kFailedPrecondition ||
              code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kInvalidArgument)
      << c.status();
  if (code == absl::StatusCode::kFailedPrecondition) {
    EXPECT_NE(c.status().message().find("build_cuda_module.sh"), std::string::npos) << c.status();
  }
  if (code == absl::StatusCode::kInvalidArgument) {
    EXPECT_NE(c.status().message().find("host memory, not on cuda:0"), std::string::npos)
        << c.status();
  }
}

TEST(EngineMemoryCAbi, EngineCallsWorkAndPoolCallsAreRefused) {
  EngineCache cache("blocks_first");
  std::vector<void*> k(cache.memory.k.begin(), cache.memory.k.end());
  std::vector<void*> v(cache.memory.v.begin(), cache.memory.v.end());
  kvtier_engine_kv kv{k.data(), v.data(), cache.memory.page_stride};
  kvtier_connector_config cfg{};
  cfg.model = "engine-test";
  cfg.dtype = "fp16";
  cfg.layers = 2;
  cfg.kv_heads = 2;
  cfg.head_dim = 32;
  cfg.block_tokens = 16;
  cfg.num_pages = kPages;
  cfg.stores = "";
  kvtier_connector* c = kvtier_connector_create_engine(&cfg, &kv);
  ASSERT_NE(c, nullptr) << kvtier_last_error();
  std::vector<uint32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 1);
  uint64_t hashes[4];
  ASSERT_EQ(kvtier_hash_tokens(c, tokens.data(), tokens.size(), hashes, 2), 2);
  uint64_t store_tokens = 99;
  ASSERT_EQ(kvtier_lookup(c, 1, hashes, 2, 0, &store_tokens), KVTIER_OK) << kvtier_last_error();
  EXPECT_EQ(store_tokens, 0u);  // no store
  const uint32_t pages[2] = {0, 1};
  EXPECT_EQ(kvtier_save_blocks(c, 1, 0, pages, 2), KVTIER_OK);
  EXPECT_EQ(kvtier_save_blocks(c, 1, 1, pages, 2), KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_start_load_into(c, 1, pages, 1), KVTIER_INVALID_ARGUMENT);  // nothing found
  EXPECT_EQ(kvtier_lookup(c, 2, hashes, 2, 3, nullptr), KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_get_num_matched_tokens(c, 3, hashes, 2, nullptr, nullptr),
            KVTIER_FAILED_PRECONDITION);
  EXPECT_EQ(kvtier_layer_base(c, 0), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_FAILED_PRECONDITION);
  EXPECT_EQ(kvtier_wait_for_save(c, 1), KVTIER_OK);
  kvtier_request_finished(c, 1);
  kvtier_connector_destroy(c);
  EXPECT_EQ(kvtier_connector_create_engine(&cfg, nullptr), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  // The staged path through the C ABI; an unknown page copier is refused.
  c = kvtier_connector_create_engine_on(&cfg, &kv, "host");
  ASSERT_NE(c, nullptr) << kvtier_last_error();
  ASSERT_EQ(kvtier_lookup(c, 1, hashes, 2, 0, &store_tokens), KVTIER_OK) << kvtier_last_error();
  EXPECT_EQ(kvtier_save_blocks(c, 1, 0, pages, 2), KVTIER_OK);
  kvtier_request_finished(c, 1);
  kvtier_connector_destroy(c);
  EXPECT_EQ(kvtier_connector_create_engine_on(&cfg, &kv, "tpu"), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("tpu"), std::string::npos);
}

}  // namespace
}  // namespace kvtier
