// Integration tests: the real kvtier-store binary on a loopback port,
// driven over gRPC.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include "client/store_client.h"
#include "common/checksum.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::BlockBytesFor;

NamespaceSpec Spec() { return NamespaceSpec{"it-model", "bf16", 1, 1, 64, 256, 0, 1, "", "", ""}; }
constexpr uint64_t kBlock = 64 << 10;
BlockHash H(uint64_t n) { return BlockHash{n * 7 + 1, n}; }

// A kvtier-store on 127.0.0.1 with a data dir of its own.
class StoreProcess {
 public:
  StoreProcess(const std::string& data_dir, std::vector<std::string> extra = {})
      : data_dir_(data_dir) {
    Start(std::move(extra));
  }
  void Start(std::vector<std::string> extra = {}) {
    if (extra.empty()) extra = extra_;
    extra_ = extra;
    std::string port_file = data_dir_ + ".port";
    std::remove(port_file.c_str());
    std::vector<std::string> args = {"--listen=127.0.0.1:0", "--data-dir=" + data_dir_,
                                     "--port-file=" + port_file, "--hugepages=false"};
    args.insert(args.end(), extra.begin(), extra.end());
    proc_ = std::make_unique<testing::Process>(KVTIER_STORE_BIN, args, data_dir_ + ".log");
    port_ = testing::WaitForPortFile(port_file, std::chrono::seconds(20));
    ASSERT_GT(port_, 0) << "kvtier-store did not start; see " << data_dir_ << ".log";
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  testing::Process& proc() { return *proc_; }
  std::string Log() const {
    std::ifstream in(data_dir_ + ".log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  std::string data_dir_;
  std::vector<std::string> extra_;
  std::unique_ptr<testing::Process> proc_;
  int port_ = 0;
};

std::vector<std::pair<BlockHash, std::string_view>> Blocks(const std::vector<std::string>& data,
                                                           uint64_t first) {
  std::vector<std::pair<BlockHash, std::string_view>> out;
  for (size_t i = 0; i < data.size(); ++i) out.emplace_back(H(first + i), data[i]);
  return out;
}

std::vector<std::string> Data(uint64_t first, uint64_t count) {
  std::vector<std::string> d;
  for (uint64_t n = first; n < first + count; ++n) d.push_back(BlockBytesFor(n, kBlock));
  return d;
}

std::vector<BlockHash> Chain(uint64_t first, uint64_t count) {
  std::vector<BlockHash> h;
  for (uint64_t n = first; n < first + count; ++n) h.push_back(H(n));
  return h;
}

// The namespace's first data.size() blocks, read inline: each served from
// NVMe and byte-exact.
void ExpectServedFromDisk(StoreClient& c, uint64_t ns, const std::vector<std::string>& data) {
  auto got = c.GetInline(ns, Chain(0, data.size()));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    EXPECT_EQ((*got)[i].tier, v1::TIER_DISK) << i;
    EXPECT_EQ((*got)[i].data, data[i]) << i;
  }
}

void WaitForDemotions(StoreClient& c) {
  for (int i = 0; i < 500; ++i) {
    auto s = c.GetStats();
    if (s.ok() && s->demotion_queue_blocks() == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  FAIL() << "write-back queue did not drain";
}

// A server owns its port: a second store on a port in use fails to start,
// saying so, instead of sharing the port's connections with the first.
TEST(StoreIntegration, ASecondStoreOnAPortInUseFailsToStart) {
  testing::TempDir dir;
  StoreProcess first(dir.sub("a"));
  const std::string listen = "--listen=127.0.0.1:" + first.address().substr(10);
  testing::Process second(KVTIER_STORE_BIN,
                          {listen, "--data-dir=" + dir.sub("b"), "--hugepages=false"},
                          dir.sub("b.log"));
  int status = second.Wait(std::chrono::seconds(20));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status;
  std::ifstream in(dir.sub("b.log"));
  std::string log((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(log.find("cannot listen on 127.0.0.1:"), std::string::npos) << log;
  EXPECT_TRUE(first.proc().running());
}

TEST(StoreIntegration, InlineRoundTripIsByteExact) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=16MiB"});
  StoreClient c(store.address());
  ASSERT_TRUE(c.Health().ok());
  // The NVMe tier has a health entry of its own (NOT_SERVING while degraded).
  ASSERT_TRUE(testing::WaitFor([&] { return c.Health("kvtier.v1.Store/disk").ok(); }));
  EXPECT_FALSE(c.Health("no.such.Service").ok());
  auto ns = c.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  EXPECT_EQ(ns->block_bytes, kBlock);
  auto data = Data(0, 50);
  auto put = c.PutInline(ns->id, Blocks(data, 0));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 50u);
  auto again = c.PutInline(ns->id, Blocks(data, 0));
  EXPECT_EQ(again->already_present, 50u);
  // A chain with a hole: only the leading present blocks come back.
  auto chain = Chain(0, 50);
  chain.push_back(H(999));
  chain.push_back(H(1));
  auto got = c.GetInline(ns->id, chain);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 50u);
  for (size_t i = 0; i < 50; ++i) {
    EXPECT_EQ((*got)[i].index, i);
    EXPECT_EQ((*got)[i].data, data[i]) << i;
    EXPECT_EQ((*got)[i].tier, v1::TIER_RAM);
  }
  auto tiers = c.Lookup(ns->id, chain);
  EXPECT_EQ(tiers->size(), 50u);
}

TEST(StoreIntegration, DemotionThenPromotionIsByteExact) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=1MiB", "--ram-slab-bytes=256KiB"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  auto data = Data(0, 64);  // 4 MiB through a 1 MiB RAM tier
  ASSERT_TRUE(c.PutInline(ns->id, Blocks(data, 0)).ok());
  WaitForDemotions(c);
  auto stats = c.GetStats();
  EXPECT_EQ(stats->tiers(0).items(), 16u);
  EXPECT_EQ(stats->tiers(1).items(), 48u);
  EXPECT_EQ(stats->tiers(0).demotions(), 48u);
  auto got = c.GetInline(ns->id, Chain(0, 64));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 64u);
  int from_disk = 0;
  for (size_t i = 0; i < 64; ++i) {
    EXPECT_EQ((*got)[i].data, data[i]) << i;
    from_disk += (*got)[i].tier == v1::TIER_DISK;
  }
  EXPECT_GE(from_disk, 48);
  stats = c.GetStats();
  EXPECT_GE(stats->tiers(0).promotions(), 48u);
  EXPECT_GE(stats->tiers(1).hits(), 48u);
}

TEST(StoreIntegration, PolicySwitchUnderLoadLosesNothing) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=32MiB"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  std::atomic<bool> failed{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      for (int batch = 0; batch < 15; ++batch) {
        uint64_t first = w * 1000 + batch * 10;
        auto data = Data(first, 10);
        if (!c.PutInline(ns->id, Blocks(data, first)).ok()) failed = true;
        if (!c.GetInline(ns->id, Chain(w * 1000, 5)).ok()) failed = true;
      }
    });
  }
  const char* policies[] = {"lru", "s3fifo", "sieve"};
  for (int i = 0; i < 30; ++i) {
    auto r = c.SetPolicy(i % 2 ? v1::TIER_DISK : v1::TIER_RAM, policies[i % 3]);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->policy(), policies[i % 3]);
  }
  for (auto& t : writers) t.join();
  ASSERT_FALSE(failed);
  for (int w = 0; w < 2; ++w) {
    auto got = c.GetInline(ns->id, Chain(w * 1000, 150));
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->size(), 150u) << "writer " << w << " lost blocks";
    for (size_t i = 0; i < 150; ++i) EXPECT_EQ((*got)[i].data, BlockBytesFor(w * 1000 + i, kBlock));
  }
  EXPECT_EQ(c.GetStats()->tiers(0).evictions(), 0u);
}

TEST(StoreIntegration, RestartAfterKillRecoversTheNvmeTier) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"),
                     {"--ram-bytes=1MiB", "--ram-slab-bytes=256KiB", "--ram-policy=lru"});
  uint64_t ns_id;
  auto data = Data(0, 40);
  {
    StoreClient c(store.address());
    auto ns = c.RegisterNamespace(Spec());
    ns_id = ns->id;
    ASSERT_TRUE(c.PutInline(ns->id, Blocks(data, 0)).ok());
    WaitForDemotions(c);
    auto stats = c.GetStats();
    ASSERT_EQ(stats->tiers(1).items(), 24u) << stats->DebugString();
  }
  store.proc().Kill(SIGKILL);
  store.Start();
  StoreClient c(store.address());
  // No re-registration: the namespace came back from disk too.
  auto tiers = c.Lookup(ns_id, Chain(0, 40));
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  for (int i = 0; i < 40; ++i) {
    auto t = c.Lookup(ns_id, Chain(i, 1));
    fprintf(stderr, "%d:%zu ", i, t->size());
  }
  ASSERT_EQ(tiers->size(), 24u);  // the 24 demoted blocks; RAM's 16 are gone
  ExpectServedFromDisk(c, ns_id, {data.begin(), data.begin() + 24});
}

TEST(StoreIntegration, AStoreStoppedWithPersistOnStopComesBackWithItsRamTierOnNvme) {
  // RAM holds all 40 blocks; nothing was evicted, so nothing is on NVMe
  // until the stop writes it there.
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=8MiB", "--persist-on-stop=20s"});
  uint64_t ns_id;
  auto data = Data(0, 40);
  {
    StoreClient c(store.address());
    auto ns = c.RegisterNamespace(Spec());
    ns_id = ns->id;
    ASSERT_TRUE(c.PutInline(ns->id, Blocks(data, 0)).ok());
    auto stats = c.GetStats();
    ASSERT_EQ(stats->tiers(0).items(), 40u) << stats->DebugString();
    ASSERT_EQ(stats->tiers(1).items(), 0u) << stats->DebugString();
  }
  store.proc().Kill(SIGTERM);
  ASSERT_EQ(store.proc().Wait(std::chrono::seconds(30)), 0) << store.Log();
  EXPECT_NE(store.Log().find("40 blocks written, 0 there already, 0 left"), std::string::npos)
      << store.Log();
  store.Start();
  StoreClient c(store.address());
  auto stats = c.GetStats();
  EXPECT_EQ(stats->tiers(0).items(), 0u) << stats->DebugString();
  EXPECT_EQ(stats->tiers(1).items(), 40u) << stats->DebugString();
  ExpectServedFromDisk(c, ns_id, data);
}

TEST(StoreIntegration, AStoreStoppedWithoutPersistOnStopLosesItsRamTier) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=8MiB"});
  {
    StoreClient c(store.address());
    auto ns = c.RegisterNamespace(Spec());
    ASSERT_TRUE(c.PutInline(ns->id, Blocks(Data(0, 40), 0)).ok());
  }
  store.proc().Kill(SIGTERM);
  ASSERT_EQ(store.proc().Wait(std::chrono::seconds(30)), 0) << store.Log();
  store.Start();
  StoreClient c(store.address());
  auto stats = c.GetStats();
  EXPECT_EQ(stats->tiers(0).items(), 0u) << stats->DebugString();
  EXPECT_EQ(stats->tiers(1).items(), 0u) << stats->DebugString();
}

TEST(StoreIntegration, LeaseExpiresOverTheWire) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--lease-ms=200ms", "--ram-bytes=4MiB"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  v1::BeginPutRequest req;
  req.set_namespace_id(ns->id);
  ToProto(H(1), req.add_hashes());
  v1::BeginPutResponse resp;
  ASSERT_TRUE(c.stub().BeginPut(c.Context().get(), req, &resp).ok());
  ASSERT_EQ(resp.targets(0).disposition(), v1::PUT_RESERVED);
  EXPECT_NE(resp.targets(0).remote_addr(), 0u);
  EXPECT_EQ(resp.targets(0).length(), kBlock);
  EXPECT_EQ(resp.lease_ms(), 200u);
  EXPECT_EQ(c.GetStats()->put_leases(), 1u);
  // Expiry after 200 ms, slots free one lease period later.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto s = c.GetStats();
        return s.ok() && s->tiers(0).used_bytes() == 0;
      },
      std::chrono::seconds(10)));
  auto stats = c.GetStats();
  EXPECT_EQ(stats->put_leases(), 0u);
  EXPECT_EQ(stats->leases_expired(), 1u);
  EXPECT_EQ(stats->tiers(0).used_bytes(), 0u);
  v1::CommitPutRequest commit;
  commit.set_lease_id(resp.lease_id());
  commit.add_checksums(0);
  v1::CommitPutResponse cr;
  grpc::Status st = c.stub().CommitPut(c.Context().get(), commit, &cr);
  EXPECT_EQ(st.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("expired"), std::string::npos);
}

TEST(StoreIntegration, BadRequestsGetClearStatusesAndTheStoreKeepsServing) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=4MiB"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  auto data = Data(0, 3);
  ASSERT_TRUE(c.PutInline(ns->id, Blocks(data, 0)).ok());

  auto lookup = c.Lookup(ns->id ^ 1, Chain(0, 1));
  EXPECT_EQ(lookup.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(lookup.status().message().find("not registered"), std::string::npos);

  std::string short_block(1000, 'x');
  auto put = c.PutInline(ns->id, {{H(10), data[0]}, {H(11), short_block}});
  EXPECT_EQ(put.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(put.status().message().find("message 1"), std::string::npos);
  EXPECT_NE(put.status().message().find("1000 bytes"), std::string::npos);

  v1::EvictRequest no_target;
  EXPECT_EQ(c.Evict(no_target).status().code(), absl::StatusCode::kInvalidArgument);
  v1::SetPolicyRequest sp;
  sp.mutable_policy()->set_policy("lru");
  v1::SetPolicyResponse spr;
  EXPECT_EQ(c.stub().SetPolicy(c.Context().get(), sp, &spr).error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(c.SetPolicy(v1::TIER_RAM, "fifo").status().code(), absl::StatusCode::kInvalidArgument);

  v1::RegisterNamespaceRequest reg;
  v1::RegisterNamespaceResponse regr;
  EXPECT_EQ(c.stub().RegisterNamespace(c.Context().get(), reg, &regr).error_code(),
            grpc::INVALID_ARGUMENT);

  // Raw bytes to a real method, bypassing the client's serialisation.
  auto channel = grpc::CreateChannel(store.address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  auto raw_lookup = [&](const std::string& bytes) {
    grpc::Slice slice(bytes.data(), bytes.size());
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic.UnaryCall(&ctx, "/kvtier.v1.Store/Lookup", {}, &request, &response,
                      [&](grpc::Status s) {
                        std::lock_guard lk(mu);
                        status = s;
                        done = true;
                        cv.notify_one();
                      });
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return done; });
    return status;
  };
  // A malformed (not protobuf) message.
  grpc::Status malformed = raw_lookup(std::string("\xff\xff\xff\xff\x0f garbage", 14));
  EXPECT_EQ(malformed.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(malformed.error_message().find("/kvtier.v1.Store/Lookup"), std::string::npos)
      << malformed.error_message();
  // A valid request cut short in the middle of a field.
  v1::LookupRequest whole;
  whole.set_namespace_id(ns->id);
  ToProto(H(1), whole.add_hashes());
  std::string bytes = whole.SerializeAsString();
  bytes.resize(bytes.size() - 5);
  grpc::Status truncated = raw_lookup(bytes);
  EXPECT_EQ(truncated.error_code(), grpc::INVALID_ARGUMENT) << truncated.error_message();

  // Still serving, nothing lost.
  auto got = c.GetInline(ns->id, Chain(0, 3));
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ((*got)[i].data, data[i]);
  // The stream's first block (before the bad one) was stored; nothing else changed.
  EXPECT_EQ(c.GetStats()->tiers(0).items(), 4u);
}

TEST(StoreIntegration, BadFlagsExitNonZeroNamingTheFlag) {
  testing::TempDir dir;
  struct Case {
    std::string flag, needle;
  } cases[] = {{"--ram-bytes=lots", "--ram-bytes"},
               {"--ram-policy=fifo", "--ram-policy"},
               {"--lease-ms=soon", "--lease-ms"},
               {"--disk-sync=sometimes", "--disk-sync"},
               {"--disk-sync-interval=soon", "--disk-sync-interval"},
               {"--listen=nowhere", "--listen"},
               {"--no-such-flag", "--no-such-flag"}};
  for (const auto& tc : cases) {
    std::string log = dir.sub("flags.log");
    std::remove(log.c_str());
    testing::Process p(KVTIER_STORE_BIN, {tc.flag, "--data-dir=" + dir.sub("db")}, log);
    int st = p.Wait(std::chrono::seconds(10));
    ASSERT_TRUE(WIFEXITED(st)) << tc.flag;
    EXPECT_EQ(WEXITSTATUS(st), 2) << tc.flag;
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_NE(ss.str().find(tc.needle), std::string::npos) << ss.str();
  }
}

// docs/architecture.md: RSS <= --ram-bytes + --demote-queue-bytes + 96 MiB
// (RocksDB memtables and caches, gRPC buffers, the per-block index).
TEST(StoreIntegration, MemoryStaysWithinTheRamBoundPlusDocumentedOverhead) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer shadow memory and quarantine inflate RSS; the bound is checked in "
                  "normal builds";
#endif
  testing::TempDir dir;
  const uint64_t ram = 64ull << 20, queue = 16ull << 20;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=64MiB", "--demote-queue-bytes=16MiB"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  uint64_t peak = 0;
  std::string block = BlockBytesFor(1, kBlock);
  for (uint64_t batch = 0; batch < 40; ++batch) {  // 2,560 blocks: 160 MiB through 64 MiB
    std::vector<std::pair<BlockHash, std::string_view>> blocks;
    for (uint64_t i = 0; i < 64; ++i) blocks.emplace_back(H(batch * 64 + i), block);
    ASSERT_TRUE(c.PutInline(ns->id, blocks).ok());
    ASSERT_TRUE(c.GetInline(ns->id, Chain(batch * 64, 64)).ok());
    peak = std::max(peak, RssBytes(store.proc().pid()));
  }
  WaitForDemotions(c);
  peak = std::max(peak, RssBytes(store.proc().pid()));
  auto stats = c.GetStats();
  EXPECT_LE(stats->tiers(0).used_bytes(), ram);
  EXPECT_GT(stats->tiers(0).evictions(), 0u);
  EXPECT_LE(peak, ram + queue + (96ull << 20)) << "peak RSS " << (peak >> 20) << " MiB";
  std::fprintf(stderr, "peak RSS %lu MiB\n", peak >> 20);
}

TEST(StoreIntegration, AdminRpcsNeedTheAdminToken) {
  testing::TempDir dir;
  std::ofstream(dir.sub("token")) << "s3cret-token\n";
  StoreProcess store(dir.sub("db"), {"--ram-bytes=4MiB", "--admin-token-file=" + dir.sub("token")});
  StoreClient plain(store.address());
  auto ns = plain.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok());  // data-path RPCs need no token
  auto denied = plain.SetPolicy(v1::TIER_RAM, "lru");
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(denied.status().message().find("admin token"), std::string::npos);
  v1::EvictRequest all;
  all.set_all(true);
  EXPECT_EQ(plain.Evict(all).status().code(), absl::StatusCode::kPermissionDenied);
  StoreClientOptions wrong;
  wrong.admin_token = "s3cret-tokem";
  EXPECT_EQ(StoreClient(store.address(), wrong).SetPolicy(v1::TIER_RAM, "lru").status().code(),
            absl::StatusCode::kPermissionDenied);
  StoreClientOptions admin;
  admin.admin_token = "s3cret-token";
  StoreClient op(store.address(), admin);
  EXPECT_TRUE(op.SetPolicy(v1::TIER_RAM, "lru").ok());
  EXPECT_TRUE(op.Evict(all).ok());
}

// Leases count against the connection (or a verified certificate's
// identity: tests/tls_test.cc), not the client_id a request fills in: a
// client cycling ids still stops at the limit, and another connection is
// not affected.
TEST(StoreIntegration, OneClientCannotHoldEveryLease) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=4MiB", "--max-leases-per-client=2"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  // Each its own TCP connection (gRPC would otherwise share one between
  // channels to the same address).
  auto connect = [&] {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return v1::Store::NewStub(
        grpc::CreateCustomChannel(store.address(), grpc::InsecureChannelCredentials(), args));
  };
  auto greedy = connect(), polite = connect();
  auto begin = [&](v1::Store::Stub* stub, const std::string& client, uint64_t n,
                   v1::BeginPutResponse* resp) {
    v1::BeginPutRequest req;
    req.set_namespace_id(ns->id);
    req.set_client_id(client);
    ToProto(H(n), req.add_hashes());
    return stub->BeginPut(c.Context().get(), req, resp);
  };
  v1::BeginPutResponse a, b, d, e;
  ASSERT_TRUE(begin(greedy.get(), "greedy-1", 1, &a).ok());
  ASSERT_TRUE(begin(greedy.get(), "greedy-2", 2, &b).ok());
  grpc::Status third = begin(greedy.get(), "greedy-3", 3, &d);
  EXPECT_EQ(third.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_NE(third.error_message().find("connection ipv4:127.0.0.1:"), std::string::npos)
      << third.error_message();
  // Twenty more fresh ids: none gets a lease.
  for (int i = 0; i < 20; ++i) {
    v1::BeginPutResponse r;
    EXPECT_EQ(begin(greedy.get(), "fresh-" + std::to_string(i), 10 + i, &r).error_code(),
              grpc::RESOURCE_EXHAUSTED);
  }
  EXPECT_TRUE(begin(polite.get(), "greedy-1", 4, &e).ok());  // another connection: unaffected
  v1::AbortPutRequest abort;
  abort.set_lease_id(a.lease_id());
  v1::AbortPutResponse ar;
  ASSERT_TRUE(greedy->AbortPut(c.Context().get(), abort, &ar).ok());
  EXPECT_TRUE(begin(greedy.get(), "greedy-3", 3, &d).ok());
}

// Namespace spam stops at --max-namespaces with RESOURCE_EXHAUSTED (the
// ones registered keep working, registering one again is fine); kvctl
// namespaces rm frees a place, drops the namespace's blocks and survives a
// restart; bad ids, unknown ids and no confirmation change nothing.
TEST(StoreIntegration, NamespacesStopAtTheLimitAndCanBeRemoved) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=4MiB", "--max-namespaces=3"});
  StoreClient c(store.address());
  auto spec = [](int i) {
    NamespaceSpec s = Spec();
    s.model = "spam-" + std::to_string(i);
    return s;
  };
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    auto ns = c.RegisterNamespace(spec(i));
    ASSERT_TRUE(ns.ok()) << ns.status();
    ids.push_back(ns->id);
  }
  auto data = Data(0, 2);
  ASSERT_TRUE(c.PutInline(ids[0], Blocks(data, 0)).ok());
  ASSERT_TRUE(c.PutInline(ids[1], Blocks(data, 0)).ok());
  for (int i = 3; i < 20; ++i) {
    auto over = c.RegisterNamespace(spec(i));
    ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
    EXPECT_NE(over.status().message().find("--max-namespaces 3"), std::string::npos)
        << over.status();
  }
  EXPECT_TRUE(c.RegisterNamespace(spec(1)).ok());  // already there: not a new one
  auto kept = c.Lookup(ids[1], Chain(0, 2));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->size(), 2u);

  const std::string kvctl = std::string(KVTIER_KVCTL_BIN) + " --store " + store.address();
  const std::string victim = NamespaceName(ids[0]);
  ShellResult r = RunShell(kvctl + " namespaces rm " + victim + " 2>&1 </dev/null");
  EXPECT_EQ(r.exit_code, 4) << r.out;  // not confirmed: nothing changed
  EXPECT_EQ(RunShell(kvctl + " namespaces rm nothex --yes 2>&1").exit_code, 2);
  r = RunShell(kvctl + " namespaces rm 00000000000000aa --yes 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("no shard has namespace"), std::string::npos) << r.out;
  EXPECT_EQ(c.Lookup(ids[0], Chain(0, 2))->size(), 2u);
  r = RunShell(kvctl + " namespaces rm " + victim + " --yes 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("dropped 2 RAM"), std::string::npos) << r.out;
  EXPECT_EQ(c.Lookup(ids[0], Chain(0, 2)).status().code(), absl::StatusCode::kNotFound);
  auto fourth = c.RegisterNamespace(spec(3));
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  EXPECT_EQ(c.Lookup(ids[1], Chain(0, 2))->size(), 2u);  // the others' blocks are untouched

  // Removed stays removed across a restart; the limit still holds.
  store.proc().Kill(SIGTERM);
  store.Start();
  StoreClient after(store.address());
  v1::ListNamespacesResponse listed;
  ASSERT_TRUE(after.stub().ListNamespaces(after.Context().get(), {}, &listed).ok());
  std::vector<uint64_t> now;
  for (const auto& n : listed.namespaces()) now.push_back(n.namespace_id());
  EXPECT_EQ(now.size(), 3u);
  EXPECT_EQ(std::count(now.begin(), now.end(), ids[0]), 0);
  EXPECT_EQ(after.RegisterNamespace(spec(0)).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(StoreIntegration, OversizedMessagesAreRefusedAndTheStoreKeepsServing) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=4MiB", "--max-message-bytes=256KiB"});
  StoreClient c(store.address());
  auto ns = c.RegisterNamespace(Spec());
  std::string big(1 << 20, 'x');
  auto r = c.PutInline(ns->id, {{H(1), big}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  auto data = Data(0, 1);
  EXPECT_TRUE(c.PutInline(ns->id, Blocks(data, 0)).ok());
}

TEST(StoreIntegration, SigtermStopsCleanly) {
  testing::TempDir dir;
  StoreProcess store(dir.sub("db"), {"--ram-bytes=4MiB"});
  int st = store.proc().Kill(SIGTERM);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0);
}

}  // namespace
}  // namespace kvtier
