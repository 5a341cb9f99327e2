// The router's subscriber to vLLM's ZeroMQ KV events: the documented wire
// format decoded (golden bytes of both event encodings), vLLM hashes mapped
// to kvtier's chain, and a real subscriber against a publisher and a replay
// socket on loopback that emit that format, through gaps, malformed and
// out-of-order messages and an engine restart.
#include <gtest/gtest.h>
#include <msgpack.h>

#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "router/router_core.h"
#include "router/vllm_chain_map.h"
#include "router/vllm_events.h"
#include "tests/test_util.h"
#include "tests/vllm_event_fakes.h"

namespace kvtier::router {
namespace {

std::string Hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size();) {
    if (hex[i] == ' ' || hex[i] == '\n') {
      ++i;
      continue;
    }
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    i += 2;
  }
  return out;
}

// vLLM 0.26+ (events as maps): ts 1700000000.5, one BlockStored of one
// block (hash 0xDEADBEEF12345678, no parent, tokens 1 2 300 70000, block
// size 4, medium GPU, extra_keys [nil], group 0, full attention), rank 0.
const char kStoredMap[] =
    "93 cb 41 d9 54 fc 40 20 00 00 91 8b"
    " a4 74 79 70 65 ab 42 6c 6f 63 6b 53 74 6f 72 65 64"
    " ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73 91 cf de ad be ef 12 34 56 78"
    " b1 70 61 72 65 6e 74 5f 62 6c 6f 63 6b 5f 68 61 73 68 c0"
    " a9 74 6f 6b 65 6e 5f 69 64 73 94 01 02 cd 01 2c ce 00 01 11 70"
    " aa 62 6c 6f 63 6b 5f 73 69 7a 65 04"
    " a7 6c 6f 72 61 5f 69 64 c0"
    " a6 6d 65 64 69 75 6d a3 47 50 55"
    " a9 6c 6f 72 61 5f 6e 61 6d 65 c0"
    " aa 65 78 74 72 61 5f 6b 65 79 73 91 c0"
    " a9 67 72 6f 75 70 5f 69 64 78 00"
    " b2 6b 76 5f 63 61 63 68 65 5f 73 70 65 63 5f 6b 69 6e 64"
    " ae 66 75 6c 6c 5f 61 74 74 65 6e 74 69 6f 6e"
    " 00";
// The same event positionally (vLLM ~0.21-0.23: a 12-element array).
const char kStoredArray[] =
    "93 cb 41 d9 54 fc 40 20 00 00 91 9c"
    " ab 42 6c 6f 63 6b 53 74 6f 72 65 64"
    " 91 cf de ad be ef 12 34 56 78 c0 94 01 02 cd 01 2c ce 00 01 11 70 04 c0"
    " a3 47 50 55 c0 91 c0 00"
    " ae 66 75 6c 6c 5f 61 74 74 65 6e 74 69 6f 6e c0"
    " 00";

TEST(VllmDecode, GoldenBytesOfBothEncodingsDecodeAlike) {
  for (const char* hex : {kStoredMap, kStoredArray}) {
    auto b = DecodeVllmBatch(Hex(hex));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_DOUBLE_EQ(b->ts, 1700000000.5);
    ASSERT_EQ(b->events.size(), 1u);
    const VllmEvent& e = b->events[0];
    EXPECT_EQ(e.kind, VllmEvent::kStored);
    EXPECT_EQ(e.hashes, std::vector<uint64_t>{0xDEADBEEF12345678ull});
    EXPECT_FALSE(e.parent.has_value());
    EXPECT_EQ(e.token_ids, (std::vector<uint32_t>{1, 2, 300, 70000}));
    EXPECT_EQ(e.block_size, 4u);
    EXPECT_EQ(e.skip_reason, "");
  }
  // v0.9: [ts, events] and a 6-element event, a negative (Python hash())
  // parent; removal and clearing in map form; a hash as 32 digest bytes.
  auto old =
      DecodeVllmBatch(Hex("92 cb 41 d9 54 fc 40 20 00 00 91 96 ab 42 6c 6f 63 6b 53 74 6f 72 65 64"
                          " 91 05 ff 92 07 08 02 c0"));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(*old->events[0].parent, ~uint64_t{0});
  std::string digest(32, '\0');
  digest[31] = 0x2a;
  digest[24] = 0x01;
  auto removed = DecodeVllmBatch(
      Hex("93 cb 41 d9 54 fc 40 20 00 00 92"
          " 83 a4 74 79 70 65 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64"
          " ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73 91 c4 20") +
      digest +
      Hex(" a6 6d 65 64 69 75 6d a3 47 50 55"
          " 81 a4 74 79 70 65 b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65 64 00"));
  ASSERT_TRUE(removed.ok()) << removed.status();
  ASSERT_EQ(removed->events.size(), 2u);
  EXPECT_EQ(removed->events[0].kind, VllmEvent::kRemoved);
  EXPECT_EQ(removed->events[0].hashes, std::vector<uint64_t>{0x010000000000002aull});
  EXPECT_EQ(removed->events[1].kind, VllmEvent::kCleared);
}

TEST(VllmDecode, BadPayloadsAreRefusedSayingWhy) {
  const std::string good = Hex(kStoredMap);
  struct Case {
    std::string bytes, says;
  };
  for (const auto& c : std::vector<Case>{
           {"", "not one msgpack value"},
           {good.substr(0, good.size() / 2), "not one msgpack value"},
           {good + "x", "bytes after"},
           {Hex("a3 61 62 63"), "not a KVEventBatch"},
           // Declared sizes past the bytes there are (msgpack-c would
           // allocate them first): a map of 2^32-1 entries, an array of
           // 65535, a string of 4 GiB; and nesting past 32 levels.
           {Hex("df ff ff ff ff 01"), "not one msgpack value"},
           {Hex("92 00 dc ff ff 01 02"), "not one msgpack value"},
           {Hex("db ff ff ff ff 61"), "not one msgpack value"},
           {std::string(40, '\x91') + Hex("c0"), "nests over 32 levels"},
       }) {
    auto b = DecodeVllmBatch(c.bytes);
    ASSERT_FALSE(b.ok()) << c.says;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(b.status().message().find(c.says), std::string::npos) << b.status();
  }
}

TEST(VllmDecode, AnEventTheRouterCannotUseIsSkippedNotItsBatch) {
  // Each batch: one bad event, then a BlockRemoved of hash 5 on the GPU
  // (array form). The bad event is kept with its reason; the next applies.
  const std::string removed5 = "93 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64 91 05 a3 47 50 55";
  struct Case {
    std::string event, says;
  };
  for (const auto& c : std::vector<Case>{
           {"91 a3 46 6f 6f", "unknown event type \"Foo\""},
           {"c0", "malformed: an event is neither an array nor a map"},
           {"92 ab 42 6c 6f 63 6b 53 74 6f 72 65 64 05", "malformed: block_hashes is not an array"},
           {"92 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64 91 a1 78", "neither an integer nor bytes"},
           // One block of 4 with 3 token ids.
           {"96 ab 42 6c 6f 63 6b 53 74 6f 72 65 64 91 05 c0 93 01 02 03 04 c0",
            "3 token ids for 1 blocks of 4"},
       }) {
    auto b = DecodeVllmBatch(Hex("92 00 92 " + c.event + " " + removed5));
    ASSERT_TRUE(b.ok()) << c.says << ": " << b.status();
    ASSERT_EQ(b->events.size(), 2u);
    EXPECT_NE(b->events[0].skip_reason.find(c.says), std::string::npos) << b->events[0].skip_reason;
    EXPECT_TRUE(b->events[1].skip_reason.empty());
    EXPECT_EQ(b->events[1].kind, VllmEvent::kRemoved);
    EXPECT_EQ(b->events[1].hashes, std::vector<uint64_t>{5});
  }
}

// vLLM 0.32's own bytes (msgspec, from its BlockPool and its CPU offloading
// events tracker): a GPU BlockStored of two 16-token blocks, the CPU
// offloading's placeholder for one of them (block_size 0, no tokens), two
// GPU removals and AllBlocksCleared, in one batch. Every event applies.
constexpr char kVllm032Mixed[] =
    "93cb41d954fc40200000958aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf137bb0"
    "37547f4cafcf16d077ad0843c577b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc002001"
    "02030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20aa626c6f636b5f73697a6510a76c6f72"
    "615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f7570"
    "5f6964780089a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf16d077ad0843c577b1"
    "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f"
    "6964c0a66d656469756da3435055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac426c6f63"
    "6b52656d6f766564ac626c6f636b5f68617368657391cf137bb037547f4cafa66d656469756da3475055a967726f75"
    "705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf16d077ad0843c5"
    "77a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c65617265640"
    "0";

TEST(VllmDecode, Vllm032BatchWithCpuOffloadingEventsApplies) {
  auto b = DecodeVllmBatch(Hex(kVllm032Mixed));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->events.size(), 5u);
  EXPECT_EQ(b->events[0].kind, VllmEvent::kStored);
  EXPECT_TRUE(b->events[0].skip_reason.empty());
  EXPECT_EQ(b->events[0].hashes,
            (std::vector<uint64_t>{1403909460543360175ull, 1643945449041937783ull}));
  EXPECT_EQ(b->events[0].block_size, 16u);
  EXPECT_EQ(b->events[0].token_ids.size(), 32u);
  // The CPU tier's placeholder names its block by hash alone.
  EXPECT_TRUE(b->events[1].skip_reason.empty());
  EXPECT_TRUE(b->events[1].by_hash);
  EXPECT_EQ(b->events[1].medium, "CPU");
  EXPECT_TRUE(b->events[2].skip_reason.empty());
  EXPECT_TRUE(b->events[3].skip_reason.empty());
  EXPECT_EQ(b->events[4].kind, VllmEvent::kCleared);
  // Applied in order, the GPU's removals leave the second block on the
  // engine's CPU: still its, priced as a CPU load.
  VllmChainMap m(kNs, 16);
  VllmSourceStats st;
  VllmChainMap::Moved moved;
  const auto stored = m.Stored(b->events[0], &st, &moved);
  ASSERT_EQ(stored.size(), 2u);
  m.Stored(b->events[1], &st, &moved);
  EXPECT_EQ(m.Removed(b->events[2], &st, &moved), std::vector<BlockHash>{stored[0]});
  EXPECT_TRUE(m.Removed(b->events[3], &st, &moved).empty());
  EXPECT_EQ(moved, (VllmChainMap::Moved{{stored[1], Medium::kCpu}}));
}

TEST(VllmDecode, TheTestEncoderWritesWhatTheDecoderReads) {
  auto b = DecodeVllmBatch(Batch(
      {Ev(Ev::kStored, {7, 8}, 6, Tokens(0, 8)), Ev(Ev::kRemoved, {5}), Ev(Ev::kCleared)}, 4));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->events.size(), 3u);
  EXPECT_EQ(b->events[0].hashes, (std::vector<uint64_t>{7, 8}));
  EXPECT_EQ(*b->events[0].parent, 6u);
  EXPECT_EQ(b->events[1].kind, VllmEvent::kRemoved);
  EXPECT_EQ(b->events[2].kind, VllmEvent::kCleared);
}

TEST(VllmChainMap, StoredBlocksGetKvtierChainHashesThroughTheirParents) {
  VllmChainMap m(kNs, kBt);
  VllmSourceStats st;
  VllmEvent a = Made(VllmEvent::kStored, {11, 12}, std::nullopt, Tokens(0, 8), kBt, "");
  VllmEvent b = Made(VllmEvent::kStored, {13}, 12, Tokens(8, 4), kBt, "");
  auto ha = m.Stored(a, &st);
  auto hb = m.Stored(b, &st);
  auto whole = ChainHashes(kNs, Tokens(0, 12), kBt);
  ASSERT_EQ(ha.size(), 2u);
  ASSERT_EQ(hb.size(), 1u);
  EXPECT_EQ(ha[0], whole[0]);
  EXPECT_EQ(ha[1], whole[1]);
  EXPECT_EQ(hb[0], whole[2]);
  // An unknown parent, or another block size, is counted and left out.
  VllmEvent orphan = Made(VllmEvent::kStored, {21}, 99, Tokens(0, 4), kBt, "");
  EXPECT_TRUE(m.Stored(orphan, &st).empty());
  EXPECT_EQ(st.unknown_parents, 1u);
  VllmEvent wide = Made(VllmEvent::kStored, {31}, std::nullopt, Tokens(0, 8), 8, "");
  EXPECT_TRUE(m.Stored(wide, &st).empty());
  EXPECT_EQ(st.skipped, 1u);
  // An event without a block's worth of tokens per hash (a skipped one, or
  // one built by hand) maps nothing: there are no tokens to hash. The fuzzer
  // found the unchecked walk reading past the tokens.
  VllmEvent short_tokens = Made(VllmEvent::kStored, {41, 42}, std::nullopt, Tokens(0, 4), kBt, "");
  EXPECT_TRUE(m.Stored(short_tokens, &st).empty());
  VllmEvent marked =
      Made(VllmEvent::kStored, {51}, std::nullopt, Tokens(0, 4), kBt, "malformed: x");
  EXPECT_TRUE(m.Stored(marked, &st).empty());
  EXPECT_EQ(st.skipped, 4u);
  VllmEvent gone = Made(VllmEvent::kRemoved, {12, 77}, std::nullopt, {}, 0, "");
  EXPECT_EQ(m.Removed(gone, &st), std::vector<BlockHash>{whole[1]});
  EXPECT_EQ(m.size(), 2u);
}

TEST(VllmSources, SpecsParseAndBadOnesNameLineAndKey) {
  auto ok = ParseVllmSources(
      "# engines\n"
      "id=vllm-0,endpoint=10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,"
      "namespace=00c0ffee00c0ffee,block-tokens=16\n\n"
      "id=vllm-1, endpoint=10.0.0.6:8000, events=ipc:///run/ev, topic=kv, "
      "namespace=00c0ffee00c0ffee, "
      "block-tokens=16, role=prefill\n");
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].role, EngineRole::kBoth);
  EXPECT_EQ((*ok)[1].role, EngineRole::kPrefill);
  EXPECT_EQ((*ok)[0].replay, "tcp://10.0.0.5:5558");
  EXPECT_EQ((*ok)[1].topic, "kv");
  EXPECT_EQ((*ok)[1].namespace_id, kNs);
  for (const auto& [text, says] : std::vector<std::pair<std::string, std::string>>{
           {"id=a,endpoint=e,events=http://x,namespace=00c0ffee00c0ffee,block-tokens=16",
            "line 1: events"},
           {"\nid=a,endpoint=e,events=tcp://x:1,namespace=xyz,block-tokens=16",
            "line 2: namespace"},
           {"id=a,endpoint=e,events=tcp://x:1,namespace=00c0ffee00c0ffee,block-tokens=0",
            "block-tokens"},
           {"id=a,endpoint=e,events=tcp://x:1,namespace=00c0ffee00c0ffee,block-tokens=4,colour=red",
            "unknown key \"colour\""},
           {"id=a,endpoint=e,events=tcp://x:1,namespace=00c0ffee00c0ffee,block-tokens=4,role=pre",
            "role \"pre\" must be prefill, decode or both"},
           {"id=a,endpoint=e,events=tcp://x:1,namespace=00c0ffee00c0ffee,block-tokens=4\n"
            "id=a,endpoint=e,events=tcp://x:1,namespace=00c0ffee00c0ffee,block-tokens=4",
            "used twice"},
           {"endpoint=e,events=tcp://x:1,namespace=00c0ffee00c0ffee,block-tokens=4", "id must be"},
       }) {
    auto bad = ParseVllmSources(text);
    ASSERT_FALSE(bad.ok()) << text;
    EXPECT_NE(bad.status().message().find(says), std::string::npos) << bad.status();
  }
}

// A hello the router refuses (here: an endpoint over 256 bytes) leaves the
// engine out of routing; the subscriber says so, counts it and tries again
// every second, instead of going on as if registered.
TEST_F(VllmSubscriber, ARefusedHelloIsRetriedAndCounted) {
  FakeEngine engine;
  VllmSourceSpec spec{"vllm-0", std::string(300, 'e'), engine.events(), engine.replay(), "", kNs,
                      kBt};
  VllmEventSource source(spec, &core_);
  ASSERT_TRUE(
      testing::WaitFor([&] { return source.stats().hello_failures >= 2; }, std::chrono::seconds(5)))
      << source.stats().hello_failures << " refused hellos";
  EXPECT_EQ(Held(), ~uint64_t{0}) << "not a source of the router";
}

TEST_F(VllmSubscriber, IndexesTheDocumentedStreamThroughGapsBadMessagesAndRestarts) {
  FakeEngine engine;
  // Published before the router subscribed: it comes from the replay socket.
  engine.Publish(0,
                 Batch({Ev(Ev::kStored, {100, 101, 102, 103}, std::nullopt, Tokens(0, 16))}, kBt));
  VllmSourceSpec spec{"vllm-0", "10.0.0.5:8000", engine.events(), engine.replay(), "", kNs, kBt};
  VllmEventSource source(spec, &core_);
  ASSERT_TRUE(testing::WaitFor([&] { return Held() == 4; }))
      << Held() << " held; replays " << source.stats().replays << ", malformed "
      << source.stats().malformed << ", batches " << source.stats().batches << ", requests "
      << engine.replay_requests;
  EXPECT_EQ(GpuHit(0, 20), 4u);
  // Live: two more blocks after block 103. The subscriber may join late
  // (ZeroMQ's slow joiner): resend until it has them.
  engine.Publish(1, Batch({Ev(Ev::kStored, {104, 105}, 103, Tokens(16, 8))}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] {
    if (Held() != 6)
      engine.SendLive(
          {"", FakeEngine::Seq(1), Batch({Ev(Ev::kStored, {104, 105}, 103, Tokens(16, 8))}, kBt)});
    return Held() == 6;
  })) << Held();
  EXPECT_EQ(GpuHit(0, 26), 6u);
  // A gap: batch 2 never arrives live; 3 does, and the replay fills 2.
  engine.Publish(2, Batch({Ev(Ev::kStored, {106, 107}, 105, Tokens(24, 8))}, kBt), /*drop=*/true);
  engine.Publish(3, Batch({Ev(Ev::kRemoved, {107})}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] { return source.stats().gaps == 1 && Held() == 7; }))
      << Held() << " blocks, " << source.stats().gaps << " gaps";
  EXPECT_EQ(GpuHit(0, 32), 7u);
  EXPECT_EQ(source.stats().resyncs, 0u);
  // A sliding-window group's blocks are not a prefix: skipped, counted.
  Ev window(Ev::kStored, {200}, std::nullopt, Tokens(1000, 4));
  window.spec_kind = "sliding_window";
  window.group = 1;
  engine.Publish(4, Batch({window}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] { return source.stats().skipped == 1; }));
  EXPECT_EQ(Held(), 7u);
  // A malformed batch: counted, and a resync rebuilds the index from the
  // replay buffer (which holds the bad batch too: it stops there).
  engine.Publish(5, "\xc1 not msgpack");
  ASSERT_TRUE(testing::WaitFor([&] { return source.stats().resyncs == 1; }));
  EXPECT_GE(source.stats().malformed, 1u);
  ASSERT_TRUE(testing::WaitFor([&] { return Held() == 7; })) << Held();
  // A message older than the last one applied: counted, nothing changes.
  engine.SendLive({"", FakeEngine::Seq(1), Batch({Ev(Ev::kRemoved, {100})}, kBt)});
  ASSERT_TRUE(testing::WaitFor([&] { return source.stats().out_of_order >= 1; }));
  EXPECT_EQ(Held(), 7u);
  // A message of the wrong shape: counted, resynced.
  engine.SendLive({"", "short"});
  ASSERT_TRUE(testing::WaitFor([&] { return source.stats().resyncs == 2; }));
  ASSERT_TRUE(testing::WaitFor([&] { return Held() == 7; })) << Held();
  // The engine restarts: its sequence starts at 0 again, its cache empty.
  engine.Restart();
  engine.Publish(0, Batch({Ev(Ev::kStored, {300}, std::nullopt, Tokens(500, 4))}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] { return source.stats().restarts == 1 && Held() == 1; }))
      << Held();
  EXPECT_EQ(GpuHit(0, 8), 0u);
  EXPECT_EQ(GpuHit(500, 4), 1u);
  // AllBlocksCleared.
  engine.Publish(1, Batch({Ev(Ev::kCleared)}, kBt));
  ASSERT_TRUE(testing::WaitFor([&] { return Held() == 0; }));
  // Still serving: routes, stats.
  EXPECT_EQ(core_.Stats().sources, 1u);
}

}  // namespace
}  // namespace kvtier::router
