// Tenants (kvtier-store --tenants-file): a real store process on 127.0.0.1
// serving two tenants known by token, driven over gRPC and the UCX data
// plane. Each test names the isolation property it checks.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "cachestore/tenants.h"
#include "client/store_client.h"
#include "client/store_data_client.h"
#include "kvtier/v1/store.grpc.pb.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;

// 2 x 1 layer x 1 head x 128 dim x 2 bytes x 512 tokens = 256 KiB.
NamespaceSpec Spec(const std::string& model = "tenant-model") {
  return NamespaceSpec{model, "bf16", 1, 1, 128, 512, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 256 << 10;
BlockHash H(uint64_t i) { return BlockHash{0x7E7A + i, i}; }

constexpr char kAlphaToken[] = "alpha-token-0123456789";
constexpr char kBetaToken[] = "beta-token-9876543210";
constexpr char kAdminToken[] = "admin-token-for-tenants-test";

TEST(TenantsFile, ParsesAndNamesWhatIsWrong) {
  const std::string ok =
      "secret s3\n"
      "tenant a ram=8MiB nvme=1GiB leases=4 namespaces=2 identities=worker-a,worker-a2 "
      "models=meta-llama/*  # comment\n"
      "tenant b ram=8MiB token-sha256=" +
      store::Sha256Hex("tok") + "\n";
  auto t = store::Tenants::Parse(ok);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ((*t)->all().size(), 2u);
  const auto& a = (*t)->all()[0];
  EXPECT_EQ(a.ram_bytes, 8u << 20);
  EXPECT_EQ(a.nvme_bytes, 1ull << 30);
  EXPECT_EQ(a.max_leases, 4u);
  EXPECT_EQ(a.max_namespaces, 2u);
  EXPECT_EQ((*t)->ByIdentity({"x", "worker-a2"}), &a);
  EXPECT_EQ((*t)->ByToken("tok"), &(*t)->all()[1]);
  EXPECT_EQ((*t)->ByToken("tok2"), nullptr);
  EXPECT_TRUE(a.AllowsModel("meta-llama/Llama-3.1-8B").ok());
  EXPECT_EQ(a.AllowsModel("qwen").code(), absl::StatusCode::kPermissionDenied);
  // Salts differ per tenant and per secret; a salted spec unsalts back.
  EXPECT_NE(a.salt, (*t)->all()[1].salt);
  auto other = store::Tenants::Parse("secret s4\n" + ok.substr(ok.find('\n') + 1));
  EXPECT_NE((*other)->all()[0].salt, a.salt);
  NamespaceSpec mine = Spec();
  mine.cache_salt = "user-salt";
  NamespaceSpec back;
  EXPECT_EQ((*t)->Unsalt(a.Salted(mine), &back), &a);
  EXPECT_EQ(back.cache_salt, "user-salt");
  EXPECT_NE(NamespaceId(a.Salted(mine)), NamespaceId(mine));
  EXPECT_EQ((*other)->Unsalt(a.Salted(mine), &back), nullptr);  // another secret: not a's

  for (const auto& [text, says] : std::vector<std::pair<std::string, std::string>>{
           {"tenant a identities=x\n", "needs ram="},
           {"tenant a ram=8MiB\n", "nobody could act as it"},
           {"tenant a ram=8MiB identities=x\ntenant a ram=1MiB identities=y\n", "listed twice"},
           {"tenant a ram=8MiB identities=x\ntenant b ram=1MiB identities=x\n", "two tenants"},
           {"tenant a ram=8MiB identities=x colour=red\n", "unknown key \"colour\""},
           {"tenant a ram=lots identities=x\n", "line 1: ram"},
           {"tenant a ram=8MiB token-sha256=abc\n", "64 hex digits"},
           {"tenant a/b ram=8MiB identities=x\n", "must be 1..64"},
           {"tenant a ram=8MiB identities=x\nsecret late\n", "before the first tenant"},
           {"# nothing\n", "no tenant"},
           {"tenant a ram=8MiB identities=x\n", "no \"secret SECRET\" line"},
           {"secret a\nsecret b\n", "a second secret"},
           {"tenant a ram=8MiB ram=9MiB identities=x\n", "ram= is given twice"},
           {"tenant a ram=2251799813685248 identities=x\n", "at most 1 PiB each"},
       }) {
    auto bad = store::Tenants::Parse(text);
    ASSERT_FALSE(bad.ok()) << text;
    EXPECT_NE(bad.status().message().find(says), std::string_view::npos)
        << text << " -> " << bad.status();
  }
}

class Tenants : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    {
      std::ofstream f(dir_.sub("tenants"));
      f << "secret tenants-test\n"
        << "tenant alpha ram=16MiB nvme=4MiB leases=3 namespaces=2 token-sha256="
        << store::Sha256Hex(kAlphaToken) << "\n"
        << "tenant beta ram=16MiB token-sha256=" << store::Sha256Hex(kBetaToken) << "\n";
      std::ofstream a(dir_.sub("admin"));
      a << kAdminToken << "\n";
    }
    Start();
  }
  void Start() {
    store_ = testing::StartOnFreePorts(KVTIER_STORE_BIN, dir_.sub("store"), [&] {
      metrics_port_ = testing::FreePort();
      return std::vector<std::string>{
          "--listen=127.0.0.1:0",
          "--data-listen=127.0.0.1:0",
          "--data-dir=" + dir_.sub("db"),
          "--hugepages=false",
          "--ram-bytes=40MiB",
          "--disk-bytes=256MiB",
          "--tenants-file=" + dir_.sub("tenants"),
          "--admin-token-file=" + dir_.sub("admin"),
          "--metrics-listen=127.0.0.1:" + std::to_string(metrics_port_)};
    });
    ASSERT_GT(store_->port(), 0) << store_->Log();
  }
  std::unique_ptr<StoreClient> Control(const std::string& token) {
    StoreClientOptions o;
    o.tenant_token = token;
    o.admin_token = token == kAdminToken ? token : "";
    return std::make_unique<StoreClient>(store_->address(), o);
  }
  std::unique_ptr<StoreDataClient> Data(const std::string& token) {
    DataClientOptions o;
    o.tenant_token = token;
    o.shared_memory = DataClientOptions::SharedMemory::kOff;
    return std::make_unique<StoreDataClient>(store_->address(), o);
  }
  // Puts blocks [first, first + n) of pattern `seed` through the data plane.
  absl::StatusOr<PutOutcome> Put(StoreDataClient& c, uint64_t ns, uint64_t first, uint64_t n,
                                 uint64_t seed, std::vector<std::string>* keep) {
    std::vector<PutBlock> blocks;
    for (uint64_t i = first; i < first + n; ++i) {
      keep->push_back(testing::BlockBytesFor(seed * 1000 + i, kBlock));
      blocks.push_back({H(i), keep->back().data()});
    }
    return c.Put(ns, kBlock, blocks).get();
  }
  // Gets blocks [0, n) and checks each against pattern `seed`; how many came back right.
  uint32_t GetExact(StoreDataClient& c, uint64_t ns, uint64_t n, uint64_t seed) {
    std::vector<uint8_t> dst(n * kBlock);
    std::vector<GetBlock> blocks;
    for (uint64_t i = 0; i < n; ++i) blocks.push_back({H(i), dst.data() + i * kBlock});
    auto r = c.Get(ns, kBlock, blocks).get();
    if (!r.ok()) return 0;
    uint32_t exact = 0;
    for (uint64_t i = 0; i < r->blocks; ++i) {
      std::string want = testing::BlockBytesFor(seed * 1000 + i, kBlock);
      exact += std::memcmp(dst.data() + i * kBlock, want.data(), kBlock) == 0 ? 1 : 0;
    }
    return exact;
  }
  // A raw stub call with a tenant token (or none).
  template <typename Req, typename Resp, typename Call>
  grpc::Status Raw(Call call, const std::string& token, const Req& req, Resp* resp) {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx.AddMetadata("x-kvtier-tenant-token", token);
    return ((*stub).*call)(&ctx, req, resp);
  }
  std::vector<BlockHash> Chain(uint64_t n) {
    std::vector<BlockHash> c;
    for (uint64_t i = 0; i < n; ++i) c.push_back(H(i));
    return c;
  }

  // The value of a metric line that starts with `series` in a scrape; -1 if absent.
  double Metric(const std::string& series) {
    std::string page = testing::HttpGet(metrics_port_, "/metrics");
    size_t at = page.find("\n" + series + " ");
    return at == std::string::npos ? -1 : std::stod(page.substr(at + series.size() + 2));
  }

  testing::TempDir dir_;
  int metrics_port_ = 0;
  std::unique_ptr<ServerProcess> store_;
};

// The same prompt from two tenants is two blocks: what one stored, the
// other neither finds, pins, nor reads, not even by the store's own id for
// it; and that holds across a restart.
TEST_F(Tenants, TwoTenantsNeverShareOrProbeEachOthersBlocks) {
  auto alpha = Data(kAlphaToken);
  auto beta = Data(kBetaToken);
  auto na = alpha->control().RegisterNamespace(Spec());
  auto nb = beta->control().RegisterNamespace(Spec());
  ASSERT_TRUE(na.ok()) << na.status();
  ASSERT_TRUE(nb.ok()) << nb.status();
  // Both name it as they would without tenants.
  EXPECT_EQ(na->id, NamespaceId(Spec()));
  EXPECT_EQ(nb->id, NamespaceId(Spec()));
  std::vector<std::string> keep;
  auto put = Put(*alpha, na->id, 0, 8, /*seed=*/1, &keep);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->written, 8u);
  EXPECT_EQ(alpha->control().Lookup(na->id, Chain(8))->size(), 8u);
  EXPECT_EQ(GetExact(*alpha, na->id, 8, 1), 8u);

  // beta: nothing by lookup, pin, RMA get or inline get.
  EXPECT_EQ(beta->control().Lookup(nb->id, Chain(8))->size(), 0u);
  auto pin = beta->Pin(nb->id, kBlock, Chain(8));
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->sources.size(), 0u);
  EXPECT_EQ(GetExact(*beta, nb->id, 8, 1), 0u);
  auto inl = beta->control().GetInline(nb->id, Chain(8));
  ASSERT_TRUE(inl.ok()) << inl.status();
  EXPECT_EQ(inl->size(), 0u);

  // The operator sees two namespaces, keyed apart; beta naming alpha's
  // store-side id finds no namespace (worded as for any unknown one).
  auto admin = Control(kAdminToken);
  v1::ListNamespacesResponse all;
  ASSERT_TRUE(
      Raw(&v1::Store::Stub::ListNamespaces, "", v1::ListNamespacesRequest(), &all).error_code() ==
      grpc::UNAUTHENTICATED);
  {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-admin-token", kAdminToken);
    ASSERT_TRUE(stub->ListNamespaces(&ctx, {}, &all).ok());
  }
  ASSERT_EQ(all.namespaces_size(), 2);
  EXPECT_NE(all.namespaces(0).namespace_id(), all.namespaces(1).namespace_id());
  for (const auto& n : all.namespaces()) {
    EXPECT_NE(n.namespace_id(), NamespaceId(Spec()));
    v1::LookupRequest req;
    req.set_namespace_id(n.namespace_id());
    *req.add_hashes() = v1::BlockHash();
    v1::LookupResponse resp;
    grpc::Status s = Raw(&v1::Store::Stub::Lookup, kBetaToken, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
  }
  // A tenant lists only its own, under its own id.
  v1::ListNamespacesResponse mine;
  ASSERT_TRUE(
      Raw(&v1::Store::Stub::ListNamespaces, kBetaToken, v1::ListNamespacesRequest(), &mine).ok());
  ASSERT_EQ(mine.namespaces_size(), 1);
  EXPECT_EQ(mine.namespaces(0).namespace_id(), NamespaceId(Spec()));
  EXPECT_EQ(mine.namespaces(0).spec().cache_salt(), "");

  // No token: refused, saying what to present.
  v1::LookupRequest req;
  req.set_namespace_id(na->id);
  *req.add_hashes() = v1::BlockHash();
  v1::LookupResponse resp;
  grpc::Status s = Raw(&v1::Store::Stub::Lookup, "", req, &resp);
  EXPECT_EQ(s.error_code(), grpc::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("x-kvtier-tenant-token"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Raw(&v1::Store::Stub::Lookup, "wrong-token", req, &resp).error_code(),
            grpc::UNAUTHENTICATED);

  // beta's own copy of the same hashes is a new block, with its own bytes.
  auto put_b = Put(*beta, nb->id, 0, 8, /*seed=*/2, &keep);
  ASSERT_TRUE(put_b.ok()) << put_b.status();
  EXPECT_EQ(put_b->written, 8u);
  EXPECT_EQ(put_b->already_present, 0u);
  EXPECT_EQ(GetExact(*beta, nb->id, 8, 2), 8u);
  EXPECT_EQ(GetExact(*alpha, na->id, 8, 1), 8u);

  // alpha's blocks 0..7 go to NVMe (its region fills with 64 newer ones),
  // and after a restart they come back to alpha, and still not to beta.
  ASSERT_TRUE(Put(*alpha, na->id, 100, 64, /*seed=*/3, &keep).ok());
  auto admin_stats = [&] { return admin->GetStats()->demotion_queue_blocks() == 0; };
  ASSERT_TRUE(testing::WaitFor(admin_stats));
  auto on_disk = alpha->control().Lookup(na->id, Chain(8));
  ASSERT_EQ(on_disk->size(), 8u);
  EXPECT_EQ((*on_disk)[0], v1::TIER_DISK);
  EXPECT_EQ(store_->proc().Kill(SIGTERM), 0) << store_->Log();
  Start();
  alpha = Data(kAlphaToken);
  beta = Data(kBetaToken);
  EXPECT_EQ(alpha->control().Lookup(na->id, Chain(8))->size(), 8u) << store_->Log();
  EXPECT_EQ(GetExact(*alpha, na->id, 8, 1), 8u);
  EXPECT_EQ(beta->control().Lookup(nb->id, Chain(8))->size(), 0u);
  EXPECT_EQ(GetExact(*beta, nb->id, 8, 1), 0u);
}

// A tenant's namespaces stop at its limit; another tenant still registers.
TEST_F(Tenants, NamespaceSpamStopsAtTheTenantsLimit) {
  auto alpha = Control(kAlphaToken);
  auto beta = Control(kBetaToken);
  EXPECT_TRUE(alpha->RegisterNamespace(Spec("m1")).ok());
  EXPECT_TRUE(alpha->RegisterNamespace(Spec("m2")).ok());
  EXPECT_TRUE(alpha->RegisterNamespace(Spec("m2")).ok());  // again: the same one
  auto third = alpha->RegisterNamespace(Spec("m3"));
  ASSERT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_NE(third.status().message().find("tenant alpha holds 2 namespaces"),
            std::string_view::npos)
      << third.status();
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(beta->RegisterNamespace(Spec("b" + std::to_string(i))).ok());
  }
}

// Leases count against the tenant, whatever client_id or connection a
// call uses; a tenant cannot end another tenant's lease.
TEST_F(Tenants, LeasesCountAgainstTheTenant) {
  auto setup = Control(kAlphaToken);
  auto ns = setup->RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok());
  ASSERT_TRUE(Control(kBetaToken)->RegisterNamespace(Spec()).ok());
  int n = 0;
  auto begin = [&](const std::string& token, v1::BeginPutResponse* resp) {
    v1::BeginPutRequest req;
    req.set_namespace_id(ns->id);
    req.set_client_id("cycling-id-" + std::to_string(n));
    *req.add_hashes() = v1::BlockHash();
    req.mutable_hashes(0)->set_hi(900 + n);
    req.mutable_hashes(0)->set_lo(++n);
    return Raw(&v1::Store::Stub::BeginPut, token, req, resp);
  };
  std::vector<uint64_t> held;
  for (int i = 0; i < 3; ++i) {
    v1::BeginPutResponse r;
    ASSERT_TRUE(begin(kAlphaToken, &r).ok());
    held.push_back(r.lease_id());
  }
  v1::BeginPutResponse r;
  grpc::Status s = begin(kAlphaToken, &r);
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("tenant alpha"), std::string::npos) << s.error_message();
  EXPECT_TRUE(begin(kBetaToken, &r).ok());  // beta has its own count

  // beta cannot abort alpha's lease (it reads as unknown); alpha can.
  v1::AbortPutRequest abort;
  abort.set_lease_id(held[0]);
  v1::AbortPutResponse ar;
  EXPECT_EQ(Raw(&v1::Store::Stub::AbortPut, kBetaToken, abort, &ar).error_code(),
            grpc::FAILED_PRECONDITION);
  EXPECT_TRUE(Raw(&v1::Store::Stub::AbortPut, kAlphaToken, abort, &ar).ok());
  EXPECT_TRUE(begin(kAlphaToken, &r).ok());  // the slot came back
}

// A tenant that fills its RAM region evicts its own blocks, never
// another's; one whose region is all held by leases is refused
// RESOURCE_EXHAUSTED, while the other tenant goes on byte-exact. Its NVMe
// bytes stay within its quota.
TEST_F(Tenants, ATenantOverQuotaIsRefusedAndTheOthersAreUnaffected) {
  auto alpha = Data(kAlphaToken);
  auto beta = Data(kBetaToken);
  auto na = alpha->control().RegisterNamespace(Spec());
  auto nb = beta->control().RegisterNamespace(Spec());
  ASSERT_TRUE(na.ok() && nb.ok());
  std::vector<std::string> keep;
  ASSERT_TRUE(Put(*beta, nb->id, 0, 32, /*seed=*/5, &keep).ok());
  // alpha writes 4x its 16 MiB region.
  for (uint64_t first = 0; first < 256; first += 32) {
    auto r = Put(*alpha, na->id, first, 32, /*seed=*/6, &keep);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->written, 32u);
  }
  auto tiers = beta->control().Lookup(nb->id, Chain(32));
  ASSERT_TRUE(tiers.ok());
  ASSERT_EQ(tiers->size(), 32u);
  for (auto t : *tiers) EXPECT_EQ(t, v1::TIER_RAM);  // none of beta's was pushed out
  EXPECT_EQ(GetExact(*beta, nb->id, 32, 5), 32u);
  // alpha's NVMe share: at most its 4 MiB quota (plus record headers).
  auto admin = Control(kAdminToken);
  ASSERT_TRUE(testing::WaitFor([&] { return admin->GetStats()->demotion_queue_blocks() == 0; }));
  auto stats = admin->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->tiers(1).used_bytes(), 0u);
  EXPECT_LE(stats->tiers(1).used_bytes(), (4u << 20) + 16 * 4096);
  // The same, per tenant, in the metrics.
  EXPECT_EQ(Metric("kvtier_store_tenant_ram_capacity_bytes{tenant=\"alpha\"}"), 16 << 20);
  EXPECT_EQ(Metric("kvtier_store_tenant_ram_used_bytes{tenant=\"alpha\"}"), 16 << 20);
  EXPECT_EQ(Metric("kvtier_store_tenant_ram_used_bytes{tenant=\"beta\"}"), 32 * kBlock);
  EXPECT_EQ(Metric("kvtier_store_tenant_nvme_bytes{tenant=\"alpha\"}"),
            stats->tiers(1).used_bytes());
  EXPECT_EQ(Metric("kvtier_store_tenant_nvme_bytes{tenant=\"beta\"}"), 0);
  EXPECT_EQ(Metric("kvtier_store_tenant_nvme_quota_bytes{tenant=\"alpha\"}"), 4 << 20);
  EXPECT_EQ(Metric("kvtier_store_tenant_namespaces{tenant=\"beta\"}"), 1);

  // alpha reserves its whole region (64 slots) under one lease...
  v1::BeginPutRequest big;
  big.set_namespace_id(na->id);
  for (uint64_t i = 0; i < 64; ++i)
    *big.add_hashes() = v1::BlockHash(), big.mutable_hashes(i)->set_hi(5000 + i);
  v1::BeginPutResponse held;
  ASSERT_TRUE(Raw(&v1::Store::Stub::BeginPut, kAlphaToken, big, &held).ok());
  int reserved = 0;
  for (const auto& t : held.targets()) reserved += t.disposition() == v1::PUT_RESERVED ? 1 : 0;
  EXPECT_EQ(reserved, 64);
  EXPECT_EQ(Metric("kvtier_store_tenant_leases{tenant=\"alpha\"}"), 1);
  // ... so its next put has nowhere to go.
  v1::BeginPutRequest one;
  one.set_namespace_id(na->id);
  *one.add_hashes() = v1::BlockHash();
  one.mutable_hashes(0)->set_hi(9999);
  v1::BeginPutResponse refused;
  grpc::Status s = Raw(&v1::Store::Stub::BeginPut, kAlphaToken, one, &refused);
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("tenant alpha's RAM region"), std::string::npos)
      << s.error_message();
  // beta is unaffected: new blocks go in, old ones read back exact.
  auto more = Put(*beta, nb->id, 32, 16, /*seed=*/5, &keep);
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(more->written, 16u);
  EXPECT_EQ(GetExact(*beta, nb->id, 48, 5), 48u);
}

// Each tenant is handed its own registered region of the arena only (its
// base, length and key), regions do not overlap, every slot it is given
// lies in its region, and no tenant is offered the arena's memfd.
TEST_F(Tenants, EachTenantGetsOnlyItsOwnRegionsKey) {
  auto connect = [&](const std::string& token, v1::ConnectDataPlaneResponse* resp) {
    return Raw(&v1::Store::Stub::ConnectDataPlane, token, v1::ConnectDataPlaneRequest(), resp);
  };
  v1::ConnectDataPlaneResponse a, b, none;
  ASSERT_TRUE(connect(kAlphaToken, &a).ok());
  ASSERT_TRUE(connect(kBetaToken, &b).ok());
  EXPECT_EQ(connect("", &none).error_code(), grpc::UNAUTHENTICATED);
  ASSERT_EQ(a.regions_size(), 1);
  ASSERT_EQ(b.regions_size(), 1);
  const auto &ra = a.regions(0), &rb = b.regions(0);
  EXPECT_EQ(ra.length(), 16u << 20);
  EXPECT_EQ(rb.length(), 16u << 20);
  EXPECT_TRUE(ra.base_addr() + ra.length() <= rb.base_addr() ||
              rb.base_addr() + rb.length() <= ra.base_addr());
  // (Over TCP, as here, UCX's keys carry no bounds: the two are equal and
  // only RDMA hardware enforces a region; docs/security.md.)
  EXPECT_EQ(ra.shm_path(), "");
  EXPECT_EQ(rb.shm_path(), "");
  // Nor does the store hold one a same-host process could open.
  int memfds = 0;
  for (const auto& e : std::filesystem::directory_iterator(
           "/proc/" + std::to_string(store_->proc().pid()) + "/fd")) {
    std::error_code ec;
    auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().find("kvtier-ram-tier") != std::string::npos) ++memfds;
  }
  EXPECT_EQ(memfds, 0);
  // Every address a put hands alpha lies in alpha's region.
  auto ctl = Control(kAlphaToken);
  auto ns = ctl->RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok());
  v1::BeginPutRequest req;
  req.set_namespace_id(ns->id);
  for (uint64_t i = 0; i < 8; ++i)
    *req.add_hashes() = v1::BlockHash(), req.mutable_hashes(i)->set_hi(77 + i);
  v1::BeginPutResponse r;
  ASSERT_TRUE(Raw(&v1::Store::Stub::BeginPut, kAlphaToken, req, &r).ok());
  ASSERT_EQ(r.targets_size(), 8);
  for (const auto& t : r.targets()) {
    EXPECT_GE(t.remote_addr(), ra.base_addr());
    EXPECT_LE(t.remote_addr() + t.length(), ra.base_addr() + ra.length());
  }
}

// An operator removes a tenant's namespace while some of its blocks are
// pinned: the pins end normally later, and the tenant registers it again
// and goes on (its blocks stay in its own region throughout; beta, whose
// region is not the first, would show a block changing pools).
TEST_F(Tenants, RemovingANamespaceWithPinnedBlocksKeepsServing) {
  auto beta = Data(kBetaToken);
  auto nb = beta->control().RegisterNamespace(Spec());
  ASSERT_TRUE(nb.ok());
  std::vector<std::string> keep;
  ASSERT_TRUE(Put(*beta, nb->id, 0, 4, /*seed=*/7, &keep).ok());
  v1::BeginGetRequest get;
  get.set_namespace_id(nb->id);
  for (const auto& h : Chain(4)) {
    auto* p = get.add_hashes();
    p->set_hi(h.hi);
    p->set_lo(h.lo);
  }
  v1::BeginGetResponse pinned;
  ASSERT_TRUE(Raw(&v1::Store::Stub::BeginGet, kBetaToken, get, &pinned).ok());
  ASSERT_EQ(pinned.sources_size(), 4);
  // The operator finds it by the store's id and removes it.
  auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
  v1::ListNamespacesResponse all;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-admin-token", kAdminToken);
    ASSERT_TRUE(stub->ListNamespaces(&ctx, {}, &all).ok());
  }
  ASSERT_EQ(all.namespaces_size(), 1);
  v1::RemoveNamespaceRequest rm;
  rm.set_namespace_id(all.namespaces(0).namespace_id());
  v1::RemoveNamespaceResponse removed;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-admin-token", kAdminToken);
    ASSERT_TRUE(stub->RemoveNamespace(&ctx, rm, &removed).ok());
  }
  EXPECT_EQ(removed.pinned_blocks(), 4u);
  // A tenant cannot remove namespaces (an operator's RPC).
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant-token", kBetaToken);
    EXPECT_EQ(stub->RemoveNamespace(&ctx, rm, &removed).error_code(), grpc::PERMISSION_DENIED);
  }
  v1::EndGetRequest end;
  end.set_lease_id(pinned.lease_id());
  v1::EndGetResponse ended;
  EXPECT_TRUE(Raw(&v1::Store::Stub::EndGet, kBetaToken, end, &ended).ok());
  // The pinned blocks left beta's region when their pins ended.
  EXPECT_EQ(Metric("kvtier_store_tenant_ram_used_bytes{tenant=\"beta\"}"), 0);
  EXPECT_EQ(beta->control().Lookup(nb->id, Chain(4)).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(beta->control().RegisterNamespace(Spec()).ok());
  EXPECT_EQ(beta->control().Lookup(nb->id, Chain(4))->size(), 0u);
  ASSERT_TRUE(Put(*beta, nb->id, 0, 4, /*seed=*/8, &keep).ok());
  EXPECT_EQ(GetExact(*beta, nb->id, 4, 8), 4u);
  EXPECT_TRUE(store_->proc().running()) << store_->Log();
}

// Misconfigurations are refused at start, naming the flag.
TEST(TenantsConfig, TheStoreRefusesTenantsWithoutAnOperatorOrRoom) {
  testing::TempDir dir;
  {
    std::ofstream f(dir.sub("tenants"));
    f << "secret s\ntenant a ram=64MiB identities=x\n";
    std::ofstream a(dir.sub("admin"));
    a << "t\n";
  }
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"--data-dir=" + dir.sub("db"), "--hugepages=false",
                               "--tenants-file=" + dir.sub("tenants"), "--check-config"});
    Process p(KVTIER_STORE_BIN, args, dir.sub("log"));
    int status = p.Wait(std::chrono::seconds(20));
    std::ifstream in(dir.sub("log"));
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                          std::string(std::istreambuf_iterator<char>(in), {}));
  };
  auto [rc1, out1] = run({"--ram-bytes=128MiB"});
  EXPECT_EQ(rc1, 2);
  EXPECT_NE(out1.find("needs --admin-token-file or --admin-identity"), std::string::npos) << out1;
  auto [rc2, out2] = run({"--ram-bytes=32MiB", "--admin-token-file=" + dir.sub("admin")});
  EXPECT_EQ(rc2, 2);
  EXPECT_NE(out2.find("--ram-bytes is"), std::string::npos) << out2;
  auto [rc3, out3] = run({"--ram-bytes=128MiB", "--admin-token-file=" + dir.sub("admin")});
  EXPECT_EQ(rc3, 0) << out3;
  auto [rc4, out4] = run(
      {"--ram-bytes=128MiB", "--ram-slab-bytes=128MiB", "--admin-token-file=" + dir.sub("admin")});
  EXPECT_EQ(rc4, 2);
  EXPECT_NE(out4.find("tenant a's ram=67108864 holds no whole RAM slab"), std::string::npos)
      << out4;
  auto [rc5, out5] =
      run({"--ram-bytes=128MiB", "--disk-bytes=64MiB", "--admin-token-file=" + dir.sub("admin")});
  EXPECT_EQ(rc5, 0) << out5;
  {
    std::ofstream f(dir.sub("tenants"));
    f << "secret s\ntenant a ram=64MiB nvme=100MiB identities=x\n";
  }
  auto [rc6, out6] =
      run({"--ram-bytes=128MiB", "--disk-bytes=64MiB", "--admin-token-file=" + dir.sub("admin")});
  EXPECT_EQ(rc6, 2);
  EXPECT_NE(out6.find("nvme= quotas add up to"), std::string::npos) << out6;
}

}  // namespace
}  // namespace kvtier
