#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "common/block_key.h"
#include "common/config.h"
#include "common/dtype.h"
#include "common/histogram.h"
#include "common/prompt_chain.h"
#include "common/rendezvous.h"
#include "common/rw_mutex.h"
#include "common/version.h"

namespace kvtier {
namespace {

TEST(ParseBytes, AcceptsBinaryAndDecimalUnits) {
  EXPECT_EQ(*ParseBytes("4096"), 4096u);
  EXPECT_EQ(*ParseBytes("64MiB"), 64ull << 20);
  EXPECT_EQ(*ParseBytes("8GiB"), 8ull << 30);
  EXPECT_EQ(*ParseBytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseBytes("2k"), 2048u);
  EXPECT_EQ(*ParseBytes("1GB"), 1000000000u);
  EXPECT_EQ(*ParseBytes(" 3 MiB "), 3ull << 20);
}

TEST(ParseBytes, RejectsGarbageWithAMessage) {
  for (const char* bad : {"", "MiB", "-1", "12XB", "1e99TiB", "abc"}) {
    auto r = ParseBytes(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(bad[0] ? bad : "\"\""), std::string::npos) << bad;
  }
}

TEST(ParseDuration, Units) {
  EXPECT_EQ(*ParseDurationMs("250ms"), 250u);
  EXPECT_EQ(*ParseDurationMs("10s"), 10000u);
  EXPECT_EQ(*ParseDurationMs("2m"), 120000u);
  EXPECT_EQ(*ParseDurationMs("75"), 75u);
  EXPECT_FALSE(ParseDurationMs("10 parsecs").ok());
  EXPECT_FALSE(ParseDurationMs("").ok());
}

TEST(FlagSet, ParsesEveryForm) {
  std::string listen = "127.0.0.1:1";
  uint64_t bytes = 1, ms = 1;
  int64_t n = 0;
  bool b = false, c = true;
  std::string policy = "lru";
  FlagSet f("prog", "test");
  f.HostPort("listen", &listen, "");
  f.Bytes("ram-bytes", &bytes, "");
  f.DurationMs("lease-ms", &ms, "");
  f.Int("n", &n, 0, 10, "");
  f.Bool("b", &b, "");
  f.Bool("c", &c, "");
  f.Choice("policy", &policy, {"lru", "sieve"}, "");
  const char* argv[] = {"prog",          "--listen=0.0.0.0:99",
                        "--ram-bytes",   "64MiB",
                        "--lease-ms=2s", "--n=7",
                        "--b",           "--no-c",
                        "--policy",      "sieve"};
  ASSERT_TRUE(f.Parse(10, argv).ok());
  EXPECT_EQ(listen, "0.0.0.0:99");
  EXPECT_EQ(bytes, 64ull << 20);
  EXPECT_EQ(ms, 2000u);
  EXPECT_EQ(n, 7);
  EXPECT_TRUE(b);
  EXPECT_FALSE(c);
  EXPECT_EQ(policy, "sieve");
}

TEST(FlagSet, VersionIsRequestedNotAnError) {
  FlagSet f("kvtier-test", "A test.");
  std::string listen = "x";
  f.String("listen", &listen, "Where");
  const char* argv[] = {"kvtier-test", "--version", "--listen=y"};
  EXPECT_TRUE(f.Parse(3, argv).ok());
  EXPECT_TRUE(f.version_requested());
  EXPECT_FALSE(f.help_requested());
  EXPECT_EQ(f.program(), "kvtier-test");
  EXPECT_NE(std::string(Version()), "");
}

TEST(FlagSet, ErrorsNameTheFlag) {
  uint64_t bytes = 0;
  int64_t n = 0;
  std::string policy = "lru", listen = "a:1";
  FlagSet f("prog", "test");
  f.Bytes("ram-bytes", &bytes, "");
  f.Int("n", &n, 0, 10, "");
  f.Choice("policy", &policy, {"lru", "sieve"}, "");
  f.HostPort("listen", &listen, "");
  auto expect_error = [&](std::vector<const char*> args, const std::string& needle) {
    args.insert(args.begin(), "prog");
    auto s = f.Parse(static_cast<int>(args.size()), args.data());
    ASSERT_FALSE(s.ok()) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect_error({"--ram-bytes=lots"}, "--ram-bytes");
  expect_error({"--n=11"}, "--n");
  expect_error({"--policy=fifo"}, "--policy");
  expect_error({"--listen=nohost"}, "--listen");
  expect_error({"--bogus=1"}, "unknown flag --bogus");
  expect_error({"--ram-bytes"}, "needs a value");
  expect_error({"stray"}, "unexpected argument");
}

TEST(FlagSet, ConfigFileLosesToCommandLine) {
  uint64_t bytes = 0;
  int64_t n = 0;
  FlagSet f("prog", "test");
  f.Bytes("ram-bytes", &bytes, "");
  f.Int("n", &n, 0, 10, "");
  std::string path = ::testing::TempDir() + "/kvtier_config_test.conf";
  std::ofstream(path) << "# comment\nram-bytes = 2MiB\n--n = 3\n";
  std::string arg = "--config=" + path;
  const char* argv[] = {"prog", "--n=5", arg.c_str()};
  ASSERT_TRUE(f.Parse(3, argv).ok());
  EXPECT_EQ(bytes, 2ull << 20);
  EXPECT_EQ(n, 5);
  EXPECT_FALSE(f.ParseConfigText("no equals sign", "x.conf").ok());
  EXPECT_FALSE(f.ParseConfigText("ram-bytes = ?", "x.conf").ok());
  std::remove(path.c_str());
}

NamespaceSpec Llama8B() {
  return NamespaceSpec{"meta-llama/Llama-3.1-8B", "bf16", 32, 8, 128, 16, 0, 1, "", "", ""};
}

TEST(Namespace, BlockBytesMatchTheDesignNumbers) {
  // DESIGN: Llama-3-8B bf16 is 128 KiB per token; a 16-token block is 2 MiB.
  EXPECT_EQ(BlockBytes(Llama8B()), 2ull << 20);
  ASSERT_TRUE(ValidateNamespace(Llama8B()).ok());
}

TEST(Namespace, IdSeparatesEveryField) {
  NamespaceSpec a = Llama8B();
  NamespaceSpec b = a;
  b.tp_rank = 0;
  b.tp_size = 0;  // read as 1
  EXPECT_EQ(NamespaceId(a), NamespaceId(b));
  b = a;
  b.cache_salt = "tenant-1";
  EXPECT_NE(NamespaceId(a), NamespaceId(b));
  b = a;
  b.dtype = "fp16";
  EXPECT_NE(NamespaceId(a), NamespaceId(b));
}

// Free text cannot pose as another field of the canonical string: a model
// may not hold "|", nor a salt end as the kv_wire field would. Ids of
// every other spec are what they always were.
TEST(Namespace, FreeTextCannotPoseAsAnotherField) {
  NamespaceSpec s = Llama8B();
  s.dtype = "fp16";
  s.cache_salt = "s|int8";
  EXPECT_EQ(ValidateNamespace(s).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ValidateNamespace(s).message().find("may not end in \"|int8\""), std::string::npos);
  s.cache_salt = "salt=a|lora=b";  // "|" elsewhere in a salt is fine
  EXPECT_TRUE(ValidateNamespace(s).ok());
  s = Llama8B();
  s.model = "m|bf16";
  EXPECT_NE(ValidateNamespace(s).message().find("may not contain"), std::string::npos);
  NamespaceSpec packed = Llama8B();
  packed.dtype = "fp16";
  packed.cache_salt = "tenant-1";
  packed.kv_wire = kKvWireInt8;
  EXPECT_EQ(CanonicalNamespace(packed), Llama8B().model + "|fp16|32|8|128|16|0|1|tenant-1|int8");
}

// The layout field: another engine layout or tier row format is another
// namespace; a spec without one keeps the id it always had; a salt cannot
// pose as it.
TEST(Namespace, LayoutIsPartOfTheIdOnlyWhenSet) {
  const NamespaceSpec plain = Llama8B();
  EXPECT_EQ(CanonicalNamespace(plain), plain.model + "|bf16|32|8|128|16|0|1|");
  NamespaceSpec a = plain, b = plain;
  a.layout = "vllm-page=LBHNC|cpu-attn=amx";
  b.layout = "vllm-page=LBHNC|cpu-attn=vec";
  EXPECT_TRUE(ValidateNamespace(a).ok());
  EXPECT_NE(NamespaceId(a), NamespaceId(plain));
  EXPECT_NE(NamespaceId(a), NamespaceId(b));
  EXPECT_EQ(CanonicalNamespace(a), plain.model + "|bf16|32|8|128|16|0|1||layout=" + a.layout);
  NamespaceSpec salted = plain;
  salted.cache_salt = "x|layout=vllm-page=LBHNC|cpu-attn=amx";
  EXPECT_NE(ValidateNamespace(salted).message().find("|layout="), std::string::npos);
  a.layout = std::string(257, 'x');
  EXPECT_NE(ValidateNamespace(a).message().find("layout"), std::string::npos);
}

TEST(Namespace, ValidationNamesTheField) {
  NamespaceSpec s = Llama8B();
  s.dtype = "int3";
  EXPECT_NE(ValidateNamespace(s).message().find("int3"), std::string::npos);
  s = Llama8B();
  s.layers = 0;
  EXPECT_NE(ValidateNamespace(s).message().find("layers"), std::string::npos);
  s = Llama8B();
  s.tp_rank = 2;
  s.tp_size = 2;
  EXPECT_NE(ValidateNamespace(s).message().find("tp_rank"), std::string::npos);
  s = Llama8B();
  s.model = "";
  EXPECT_FALSE(ValidateNamespace(s).ok());
}

TEST(ChainHashes, OnlyFullBlocksAndPrefixStable) {
  std::vector<uint32_t> tokens(50);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i * 7;
  auto h = ChainHashes(42, tokens, 16);
  ASSERT_EQ(h.size(), 3u);  // 50 tokens: 3 full blocks, 2 left over
  // A longer prompt with the same first 32 tokens shares the first 2 hashes.
  std::vector<uint32_t> other(tokens.begin(), tokens.begin() + 32);
  other.resize(48, 999);
  auto g = ChainHashes(42, other, 16);
  EXPECT_EQ(g[0], h[0]);
  EXPECT_EQ(g[1], h[1]);
  EXPECT_NE(g[2], h[2]);
  // Chaining: the same block tokens under a different parent hash differently.
  std::vector<uint32_t> shifted(tokens.begin() + 16, tokens.begin() + 32);
  EXPECT_NE(ChainHashes(42, shifted, 16)[0], h[1]);
  // Namespaces never alias.
  EXPECT_NE(ChainHashes(43, tokens, 16)[0], h[0]);
  EXPECT_EQ(NextBlockHash(BlockHash{42, 0}, std::span(tokens).subspan(0, 16)), h[0]);
}

TEST(Dtype, OneParserForEveryName) {
  EXPECT_EQ(*ParseDtype("fp16"), Dtype::kFp16);
  EXPECT_EQ(*ParseDtype("bf16"), Dtype::kBf16);
  for (const char* fp8 : {"fp8", "fp8_e4m3", "fp8_e5m2"}) EXPECT_EQ(*ParseDtype(fp8), Dtype::kFp8);
  auto bad = ParseDtype("fp8_e3m4");  // the connector used to accept any "fp8..." name
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fp8_e3m4"), std::string::npos);
  EXPECT_EQ(ElementBytes(Dtype::kBf16), 2u);
  EXPECT_EQ(ElementBytes(Dtype::kFp8), 1u);
  EXPECT_EQ(*DtypeBytes("fp8_e4m3"), 1u);
}

TEST(PromptChain, TokensAndHashesFollowOneRule) {
  std::vector<uint32_t> tokens(40);
  for (uint32_t i = 0; i < 40; ++i) tokens[i] = i;
  auto p = ChainFromTokens(9, tokens, 16, "route");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->chain, ChainHashes(9, tokens, 16));
  EXPECT_EQ(p->prompt_tokens, 40u);
  EXPECT_EQ(ChainFromTokens(9, {}, 16, "route").status().message(), "route: the prompt is empty");
  // Hashes: prompt_tokens must reach into the chain's last block.
  auto h = ChainFromHashes(p->chain, 40, 16, "submit");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->prompt_tokens, 40u);
  EXPECT_EQ(ChainFromHashes(p->chain, 0, 16, "submit")->prompt_tokens, 32u);
  auto short_prompt = ChainFromHashes(p->chain, 16, 16, "submit");
  EXPECT_EQ(short_prompt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(short_prompt.status().message().find("submit: prompt_tokens 16"), std::string::npos);
  std::vector<BlockHash> many(kMaxPromptBlocks + 1);
  EXPECT_EQ(ChainFromHashes(many, 0, 16, "route").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Rendezvous, PicksTheHighestScoreAndMovesOnlyToANewMember) {
  std::vector<std::string> three = {"a", "b", "c"}, four = {"a", "b", "c", "d"};
  int moved = 0;
  for (uint64_t key = 0; key < 4000; ++key) {
    size_t p = RendezvousPick(key, three);
    for (size_t i = 0; i < three.size(); ++i) {
      EXPECT_LE(RendezvousScore(key, three[i]), RendezvousScore(key, three[p]));
    }
    size_t q = RendezvousPick(key, four);
    if (q != p) {
      EXPECT_EQ(q, 3u);
      ++moved;
    }
  }
  EXPECT_NEAR(moved / 4000.0, 0.25, 0.03);
}

TEST(BlockHashHex, RoundTripsAndRejects) {
  BlockHash h{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(ToHex(h), "0123456789abcdeffedcba9876543210");
  EXPECT_EQ(*BlockHashFromHex(ToHex(h)), h);
  EXPECT_FALSE(BlockHashFromHex("xyz").ok());
  EXPECT_FALSE(BlockHashFromHex(std::string(32, 'g')).ok());
}

TEST(LatencyHistogram, QuantilesLandInTheRightBucket) {
  LatencyHistogram h;
  for (int i = 0; i < 99; ++i) h.Record(3);
  h.Record(1000, false);
  auto s = h.Take();
  EXPECT_EQ(s.count, 100u);
  EXPECT_EQ(s.errors, 1u);
  EXPECT_EQ(s.Quantile(0.5), 4u);
  EXPECT_EQ(s.Quantile(0.999), 1024u);
}

// A writer waiting for the readers inside goes before readers that come
// after it (glibc's default rwlock lets new readers in ahead without bound).
TEST(WriterPreferringMutex, AWaitingWriterGoesBeforeNewReaders) {
  WriterPreferringMutex mu;
  std::shared_lock first(mu);  // a reader inside
  std::atomic<bool> writing{false};
  std::thread writer([&] {
    std::unique_lock w(mu);  // waits for the reader inside
    writing = true;
  });
  // Once the writer waits, a new reader may not pass it.
  bool passed = true;
  for (int i = 0; i < 200 && passed; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    passed = mu.try_lock_shared();
    if (passed) mu.unlock_shared();
  }
  EXPECT_FALSE(passed) << "a new reader went ahead of a waiting writer";
  EXPECT_FALSE(writing);
  first.unlock();
  writer.join();
  EXPECT_TRUE(writing);
  EXPECT_TRUE(mu.try_lock_shared());
  mu.unlock_shared();
}

}  // namespace
}  // namespace kvtier
