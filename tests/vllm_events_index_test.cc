// What the router indexes of vLLM's KV events beyond a plain GPU chain: a
// LoRA adapter's and a salted request's blocks (each chain rooted at its
// variant, so equal tokens under another adapter or salt never match),
// blocks an engine offloaded to its own CPU or disk tier (its blocks while
// any medium holds them, priced at the fastest), one full-attention KV cache group, and an engine
// that restarts in its predecessor's place with a short sequence.
#include <gtest/gtest.h>

#include "common/block_key.h"
#include "router/vllm_batch.h"
#include "router/vllm_chain_map.h"
#include "tests/test_util.h"
#include "tests/vllm_event_fakes.h"

namespace kvtier::router {
namespace {

VllmEvent Decoded(const Ev& ev) {
  auto b = DecodeVllmBatch(Batch({ev}, kBt));
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() && b->events.size() == 1 ? b->events[0] : VllmEvent{};
}

TEST(VllmDecode, AdapterAndSaltNameTheChainsVariant) {
  Ev lora(Ev::kStored, {1, 2}, std::nullopt, Tokens(0, 8), "sql-adapter");
  VllmEvent e = Decoded(lora);
  EXPECT_EQ(e.skip_reason, "");
  EXPECT_EQ(e.variant, ChainVariant("sql-adapter", ""));
  Ev salted(Ev::kStored, {3, 4}, std::nullopt, Tokens(0, 8));
  salted.salt = "tenant-7";
  EXPECT_EQ(Decoded(salted).variant, ChainVariant("", "tenant-7"));
  salted.lora_name = "sql-adapter";
  EXPECT_EQ(Decoded(salted).variant, ChainVariant("sql-adapter", "tenant-7"));
  EXPECT_NE(ChainVariant("sql-adapter", "tenant-7"), ChainVariant("sql-adapter", ""));
  EXPECT_NE(ChainVariant("a|salt=b", ""), ChainVariant("a", "b")) << "the parts cannot pose";
  EXPECT_EQ(Decoded(Ev(Ev::kStored, {5}, std::nullopt, Tokens(0, 4))).variant, 0u);
  // A salt is a chain's first key: past it, the event is not vLLM's.
  Ev late(Ev::kStored, {6}, 5, Tokens(4, 4));
  late.salt = "tenant-7";
  EXPECT_EQ(Decoded(late).skip_reason, "malformed: a cache salt past a chain's first block");
}

TEST(VllmDecode, WhatCannotBeRoutedOnIsSkippedSayingWhy) {
  Ev window(Ev::kStored, {1}, std::nullopt, Tokens(0, 4));
  window.spec_kind = "sliding_window";
  EXPECT_EQ(Decoded(window).skip_reason, "attention kind sliding_window");
  // Multimodal keys: (identifier, offset) pairs, as vLLM publishes them.
  std::string mm = Encode([](msgpack_packer* pk) {
    msgpack_pack_array(pk, 2);
    msgpack_pack_double(pk, 1.0);
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 6);
    Key(pk, "type"), Key(pk, "BlockStored");
    Key(pk, "block_hashes"), msgpack_pack_array(pk, 1), msgpack_pack_uint64(pk, 9);
    Key(pk, "token_ids"), msgpack_pack_array(pk, 4);
    for (int i = 0; i < 4; ++i) msgpack_pack_uint32(pk, 7);
    Key(pk, "block_size"), msgpack_pack_uint32(pk, kBt);
    Key(pk, "parent_block_hash"), msgpack_pack_nil(pk);
    Key(pk, "extra_keys"), msgpack_pack_array(pk, 1), msgpack_pack_array(pk, 1);
    msgpack_pack_array(pk, 2), Key(pk, "img-hash"), msgpack_pack_uint32(pk, 0);
  });
  auto b = DecodeVllmBatch(mm);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->events[0].skip_reason, "extra keys: multimodal inputs");
}

TEST(VllmChainMap, VariantsRootTheirOwnChains) {
  VllmChainMap m(kNs, kBt);
  VllmSourceStats st;
  VllmEvent plain = Made(VllmEvent::kStored, {1, 2}, std::nullopt, Tokens(0, 8), kBt);
  VllmEvent lora = Made(VllmEvent::kStored, {11, 12}, std::nullopt, Tokens(0, 8), kBt);
  lora.variant = ChainVariant("sql-adapter", "");
  VllmEvent next = Made(VllmEvent::kStored, {13}, 12, Tokens(8, 4), kBt);
  EXPECT_EQ(m.Stored(plain, &st), ChainHashes(kNs, Tokens(0, 8), kBt));
  auto hl = m.Stored(lora, &st);
  auto hn = m.Stored(next, &st);
  hl.insert(hl.end(), hn.begin(), hn.end());
  EXPECT_EQ(hl, ChainHashes(kNs, Tokens(0, 12), kBt, lora.variant)) << "the parent carries it";
  EXPECT_NE(hl[0], ChainHashes(kNs, Tokens(0, 4), kBt)[0]);
}

TEST(VllmChainMap, ABlockStaysTheEnginesWhileAnyOfItsMediaHoldsIt) {
  VllmChainMap m(kNs, kBt);
  VllmSourceStats st;
  const auto chain = ChainHashes(kNs, Tokens(0, 8), kBt);
  VllmEvent gpu = Made(VllmEvent::kStored, {1, 2}, std::nullopt, Tokens(0, 8), kBt);
  ASSERT_EQ(m.Stored(gpu, &st), chain);
  // vLLM's CPU offloading names block 2 by hash alone: nothing new to tell,
  // and the GPU is still its fastest medium.
  VllmEvent cpu = Made(VllmEvent::kStored, {2, 99}, std::nullopt, {}, 0);
  cpu.medium = "CPU";
  cpu.by_hash = true;
  VllmChainMap::Moved moved;
  EXPECT_TRUE(m.Stored(cpu, &st, &moved).empty());
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(st.unknown_parents, 1u) << "hash 99 was never mapped";
  // The GPU evicts both: block 1 leaves the engine, block 2 stays on its CPU.
  VllmEvent evicted = Made(VllmEvent::kRemoved, {1, 2}, std::nullopt, {}, 0);
  EXPECT_EQ(m.Removed(evicted, &st, &moved), std::vector<BlockHash>{chain[0]});
  EXPECT_EQ(moved, (VllmChainMap::Moved{{chain[1], Medium::kCpu}}));
  EXPECT_EQ(m.size(), 1u);
  // A slower tier takes it too (its CPU still the faster), then the CPU
  // drops it: the slower tier is where it is.
  VllmEvent disk = Made(VllmEvent::kStored, {2}, std::nullopt, {}, 0);
  disk.medium = "STORAGE";
  disk.by_hash = true;
  moved.clear();
  EXPECT_TRUE(m.Stored(disk, &st, &moved).empty());
  EXPECT_TRUE(moved.empty());
  VllmEvent cpu_gone = Made(VllmEvent::kRemoved, {2}, std::nullopt, {}, 0);
  cpu_gone.medium = "CPU";
  EXPECT_TRUE(m.Removed(cpu_gone, &st, &moved).empty());
  EXPECT_EQ(moved, (VllmChainMap::Moved{{chain[1], Medium::kDisk}}));
  // Loaded back onto the GPU: its fastest again.
  moved.clear();
  VllmEvent back = Made(VllmEvent::kStored, {2}, 1, Tokens(4, 4), kBt);
  EXPECT_TRUE(m.Stored(back, &st, &moved).empty()) << "not new to the engine";
  EXPECT_TRUE(moved.empty()) << "its parent is gone: the event maps nothing";
  VllmEvent by_hash_back = Made(VllmEvent::kStored, {2}, std::nullopt, {}, 0);
  by_hash_back.by_hash = true;
  EXPECT_TRUE(m.Stored(by_hash_back, &st, &moved).empty());
  EXPECT_EQ(moved, (VllmChainMap::Moved{{chain[1], Medium::kGpu}}));
  // Every medium drops it: the engine holds it no more.
  VllmEvent all_gone = Made(VllmEvent::kRemoved, {2}, std::nullopt, {}, 0);
  m.Removed(all_gone, &st);
  all_gone.medium = "STORAGE";
  EXPECT_EQ(m.Removed(all_gone, &st), std::vector<BlockHash>{chain[1]});
  EXPECT_EQ(m.size(), 0u);
}

TEST(VllmChainMap, OneFullAttentionGroupIsIndexed) {
  VllmChainMap m(kNs, kBt);
  VllmSourceStats st;
  VllmEvent g1 = Made(VllmEvent::kStored, {1}, std::nullopt, Tokens(0, 4), kBt);
  g1.group = 1;  // a hybrid model whose full-attention group is not group 0
  EXPECT_EQ(m.Stored(g1, &st).size(), 1u);
  VllmEvent g2 = Made(VllmEvent::kStored, {1}, std::nullopt, Tokens(0, 4), kBt);
  g2.group = 2;
  EXPECT_TRUE(m.Stored(g2, &st).empty());
  VllmEvent g2_gone = Made(VllmEvent::kRemoved, {1}, std::nullopt, {}, 0);
  g2_gone.group = 2;
  EXPECT_TRUE(m.Removed(g2_gone, &st).empty()) << "group 1 still holds it";
  EXPECT_EQ(st.skipped, 2u);
  EXPECT_EQ(m.size(), 1u);
}

// A LoRA adapter's blocks route requests of that adapter, and only those.
TEST_F(VllmSubscriber, AnAdaptersBlocksRouteItsRequestsOnly) {
  FakeEngine engine;
  VllmSourceSpec spec{"vllm-0", "10.0.0.5:8000", engine.events(), engine.replay(), "", kNs, kBt};
  VllmEventSource source(spec, &core_);
  engine.Publish(0, Batch({Ev(Ev::kStored, {1, 2}, std::nullopt, Tokens(0, 8), "sql")}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] { return Held() == 2; })) << Held();
  EXPECT_EQ(GpuHit(0, 9, ChainVariant("sql", "")), 2u);
  EXPECT_EQ(GpuHit(0, 9), 0u) << "the base model's request";
  EXPECT_EQ(GpuHit(0, 9, ChainVariant("chat", "")), 0u) << "another adapter's";
}

// What an engine's CPU offloading holds is priced as its CPU's, also after
// the router asks for a snapshot (a new router, or a gap).
TEST_F(VllmSubscriber, BlocksOnAnEnginesCpuTierRouteAsItsCpus) {
  FakeEngine engine;
  VllmSourceSpec spec{"vllm-0", "10.0.0.5:8000", engine.events(), engine.replay(), "", kNs, kBt};
  VllmEventSource source(spec, &core_);
  Ev cpu(Ev::kStored, {1, 2});
  cpu.medium = "CPU";
  cpu.by_hash = true;
  engine.Publish(
      0, Batch({Ev(Ev::kStored, {1, 2}, std::nullopt, Tokens(0, 8)), cpu, Ev(Ev::kRemoved, {2})},
               kBt));
  auto split = [&] {
    auto r = RouteTokens(0, 9);
    return r.ok() ? std::pair{r->gpu_blocks, r->cpu_blocks} : std::pair{~0u, ~0u};
  };
  ASSERT_TRUE(testing::WaitFor([&] {
    return split() == std::pair{1u, 1u};
  })) << split().first
      << " on the GPU, " << split().second << " on the CPU";
  EXPECT_EQ(Held(), 2u);
  // The router forgets the engine (as one that expired it would): the
  // subscriber's next heartbeat registers it again, with a snapshot, then
  // the media.
  ASSERT_TRUE(core_.RemoveSource("vllm-0"));
  ASSERT_TRUE(testing::WaitFor([&] {
    return split() == std::pair{1u, 1u};
  })) << split().first
      << " on the GPU, " << split().second << " on the CPU";
  EXPECT_EQ(Held(), 2u);
}

// An engine restarted in its predecessor's place, whose sequence is short
// of the old one's (it published a few batches before the subscriber
// reconnected): its predecessor's blocks are forgotten, and what it
// published is replayed.
TEST_F(VllmSubscriber, AnEngineRestartedWithAShortSequenceReplacesItsPredecessor) {
  auto old_engine = std::make_unique<FakeEngine>();
  const std::string events = old_engine->events(), replay = old_engine->replay();
  VllmSourceSpec spec{"vllm-0", "10.0.0.5:8000", events, replay, "", kNs, kBt};
  VllmEventSource source(spec, &core_);
  const std::string stored = Batch({Ev(Ev::kStored, {1, 2}, std::nullopt, Tokens(0, 8))}, kBt);
  old_engine->Publish(0, stored);
  for (uint64_t seq = 1; seq <= 5; ++seq) old_engine->Publish(seq, Batch({}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] {
    if (GpuHit(0, 9) != 2) old_engine->SendLive({"", FakeEngine::Seq(5), Batch({}, kBt)});
    return GpuHit(0, 9) == 2;
  })) << Held();
  old_engine.reset();
  FakeEngine engine(events, replay);
  // Published while nobody listened: only the replay has it.
  engine.Publish(0, Batch({Ev(Ev::kStored, {7}, std::nullopt, Tokens(500, 4))}, kBt), true);
  engine.Publish(1, Batch({}, kBt), true);
  engine.Publish(2, Batch({Ev(Ev::kStored, {8}, 7, Tokens(504, 4))}, kBt), true);
  ASSERT_TRUE(testing::WaitFor([&] {
    if (source.stats().restarts == 0) engine.SendLive({"", FakeEngine::Seq(2), Batch({}, kBt)});
    return source.stats().restarts == 1 && GpuHit(500, 9) == 2;
  })) << source.stats().restarts
      << " restarts, " << source.stats().out_of_order << " out of order, " << Held() << " held";
  EXPECT_EQ(GpuHit(0, 9), 0u) << "the old engine's blocks";
  EXPECT_EQ(Held(), 2u);
}

}  // namespace
}  // namespace kvtier::router
