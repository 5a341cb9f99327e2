// An attacker with a tenant's own credentials against a real store process
// (two tenants, the default socket data plane) on 127.0.0.1: it tries to
// read and write store memory outside any lease it holds (the other
// tenant's blocks, the arena past its leases, the store's heap, an unmapped
// address), with UCX directly (rkeys it fabricates, on every port the store
// listens on) and with hand-made data-plane frames (other leases, other
// kinds, other lengths, forged sessions, garbage, a client gone
// mid-transfer). Every attempt must fail with a clear status, the other
// tenant's blocks must read back byte-exact, and the store must keep
// serving. Run with UCX_TLS=tcp and UCX_TLS=all (docs/security.md).
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "cachestore/tenants.h"
#include "client/socket_channel.h"
#include "client/store_client.h"
#include "client/store_data_client.h"
#include "common/data_wire.h"
#include "common/rpc/proto_convert.h"
#include "common/socket_io.h"
#include "common/ucx/calls.h"
#include "common/ucx/ucx.h"
#include "kvtier/v1/store.grpc.pb.h"
#include "tests/raw_hello.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using Clock = std::chrono::steady_clock;

NamespaceSpec Spec() {
  return NamespaceSpec{"adversary-model", "bf16", 1, 1, 128, 512, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 256 << 10;
BlockHash H(uint64_t i) { return BlockHash{0xADD + i, i}; }

constexpr char kAlphaToken[] = "alpha-token-0123456789";
constexpr char kBetaToken[] = "beta-token-9876543210";
constexpr char kAdminToken[] = "admin-token-for-adversary-test";

Clock::time_point Soon() { return Clock::now() + std::chrono::seconds(5); }

// The first address of the store's [heap] mapping (0 if it has none).
uint64_t HeapOf(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("[heap]") != std::string::npos) return std::stoull(line, nullptr, 16);
  }
  return 0;
}

// A raw data-plane connection: frames as the attacker writes them.
class RawConn {
 public:
  // Reads the store's challenge, then (unless `session` is empty) says
  // hello with it: with the proof its key gives when it is one
  // ConnectDataPlane handed out, else as a forger would (testing::HelloFor).
  RawConn(int port, const std::string& session) {
    auto fd = net::Connect("127.0.0.1", port, Soon());
    EXPECT_TRUE(fd.ok()) << fd.status();
    fd_ = fd.ok() ? *fd : -1;
    auto nonce = testing::ReadChallenge(fd_, Soon());
    EXPECT_TRUE(nonce.ok()) << nonce.status();
    nonce_ = nonce.ok() ? *nonce : "";
    if (!session.empty()) Hello(testing::HelloFor(session, nonce_));
  }
  // Says hello with `payload` as it is (what an eavesdropper replays).
  void Hello(const std::string& payload) {
    hello_payload_ = payload;
    hello_ = Send(wire::Frame{wire::kFrameMagic, wire::kHello, 0, 0, 0, payload.size()}, payload);
  }
  const std::string& hello_payload() const { return hello_payload_; }
  ~RawConn() {
    if (fd_ >= 0) close(fd_);
  }
  // Sends a frame (and payload) and reads its reply: the code, the text
  // (data bytes, if any, go to *data).
  std::pair<int, std::string> Send(const wire::Frame& f, const std::string& payload = "",
                                   std::string* data = nullptr) {
    iovec v[2] = {{const_cast<wire::Frame*>(&f), sizeof(f)},
                  {const_cast<char*>(payload.data()), payload.size()}};
    if (!net::WriteAll(fd_, v, 2, Soon()).ok()) return {-1, "write failed"};
    wire::Reply r;
    if (!net::ReadAll(fd_, &r, sizeof(r), Soon()).ok()) return {-1, "closed"};
    std::string text(r.message_bytes, '\0');
    if (!net::ReadAll(fd_, text.data(), text.size(), Soon()).ok()) return {-1, "closed"};
    std::string bytes(r.data_bytes, '\0');
    if (!net::ReadAll(fd_, bytes.data(), bytes.size(), Soon()).ok()) return {-1, "closed"};
    if (data) *data = std::move(bytes);
    return {r.code, text};
  }
  // A control call on the data plane: `req` serialized as the body; the
  // reply's text is the serialized response (or the error).
  std::pair<int, std::string> Call(uint16_t method, const google::protobuf::Message& req) {
    const std::string body = req.SerializeAsString();
    return Send(wire::Frame{wire::kFrameMagic, wire::kCall, method, 0, 0, body.size()}, body);
  }
  std::pair<int, std::string> Get(uint64_t lease, uint64_t addr, uint64_t length,
                                  std::string* data = nullptr) {
    return Send(wire::Frame{wire::kFrameMagic, wire::kGet, 0, lease, addr, length}, "", data);
  }
  std::pair<int, std::string> Put(uint64_t lease, uint64_t addr, uint64_t length) {
    return Send(wire::Frame{wire::kFrameMagic, wire::kPut, 0, lease, addr, length},
                std::string(length, '\x66'));
  }
  int fd() const { return fd_; }
  std::pair<int, std::string> hello_;

 private:
  int fd_ = -1;
  std::string nonce_;
  std::string hello_payload_;
};

class Adversary : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", GetParam().c_str(), 1);
    {
      std::ofstream f(dir_.sub("tenants"));
      f << "secret adversary-test\n"
        << "tenant alpha ram=16MiB token-sha256=" << store::Sha256Hex(kAlphaToken) << "\n"
        << "tenant beta ram=16MiB token-sha256=" << store::Sha256Hex(kBetaToken) << "\n";
      std::ofstream a(dir_.sub("admin"));
      a << kAdminToken << "\n";
    }
    store_ = std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir_.sub("store"),
        std::vector<std::string>{
            "--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0", "--data-dir=" + dir_.sub("db"),
            "--hugepages=false", "--ram-bytes=40MiB", "--lease-ms=3s",
            "--tenants-file=" + dir_.sub("tenants"), "--admin-token-file=" + dir_.sub("admin")});
    ASSERT_GT(store_->port(), 0) << store_->Log();
  }
  std::unique_ptr<StoreDataClient> Data(const std::string& token) {
    DataClientOptions o;
    o.tenant_token = token;
    return std::make_unique<StoreDataClient>(store_->address(), o);
  }
  v1::ConnectDataPlaneResponse Connect(const std::string& token) {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("x-kvtier-tenant-token", token);
    v1::ConnectDataPlaneResponse resp;
    EXPECT_TRUE(stub->ConnectDataPlane(&ctx, {}, &resp).ok());
    return resp;
  }
  // Beta's blocks, all 8 byte-exact and verified by checksum.
  void ExpectBetaIntact(StoreDataClient& beta, uint64_t ns) {
    std::vector<uint8_t> dst(8 * kBlock);
    std::vector<GetBlock> blocks;
    for (uint64_t i = 0; i < 8; ++i) blocks.push_back({H(i), dst.data() + i * kBlock});
    auto r = beta.Get(ns, kBlock, blocks).get();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->blocks, 8u);
    for (uint64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(std::memcmp(dst.data() + i * kBlock, testing::BlockBytesFor(500 + i, kBlock).data(),
                            kBlock),
                0)
          << "beta's block " << i;
    }
  }

  testing::TempDir dir_;
  std::unique_ptr<ServerProcess> store_;
};

TEST_P(Adversary, NoClientAddressesTheStoresMemory) {
  // Beta stores 8 blocks and pins them: their addresses and its lease are
  // what an attacker would most want (assume both leaked).
  auto beta = Data(kBetaToken);
  auto ns_b = beta->control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns_b.ok()) << ns_b.status();
  std::vector<std::string> keep;
  std::vector<PutBlock> put;
  for (uint64_t i = 0; i < 8; ++i) {
    keep.push_back(testing::BlockBytesFor(500 + i, kBlock));
    put.push_back({H(i), keep.back().data()});
  }
  auto wrote = beta->Put(ns_b->id, kBlock, put).get();
  ASSERT_TRUE(wrote.ok()) << wrote.status();
  ASSERT_EQ(wrote->written, 8u);
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < 8; ++i) chain.push_back(H(i));
  auto pinned = beta->Pin(ns_b->id, kBlock, chain);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_EQ(pinned->sources.size(), 8u);
  const uint64_t beta_lease = pinned->lease, beta_addr = pinned->sources[0].remote_addr;

  // Alpha's data plane: a socket address and a session, no UCX at all.
  v1::ConnectDataPlaneResponse a = Connect(kAlphaToken);
  EXPECT_EQ(a.ucx_address(), "");
  EXPECT_EQ(a.worker_address(), "");
  ASSERT_EQ(a.regions_size(), 1);
  EXPECT_EQ(a.regions(0).packed_rkey(), "");
  ASSERT_NE(a.data_address(), "");
  const int data_port = std::stoi(a.data_address().substr(a.data_address().rfind(':') + 1));
  const uint64_t heap = HeapOf(store_->proc().pid());
  ASSERT_NE(heap, 0u);
  const uint64_t region_end = a.regions(0).base_addr() + a.regions(0).length();
  // Beta's block, the first byte past alpha's region, the heap, an
  // unmapped page, the top of the address space.
  const std::vector<uint64_t> targets = {beta_addr, region_end, heap, 0x10, ~uint64_t{0} - 8};

  // 1. UCX directly, on every port the store listens on, with a key it
  // makes up (the ten bytes UCX packs for any TCP region).
  {
    auto ctx = ucx::Context::Create();
    ASSERT_TRUE(ctx.ok());
    auto worker = ucx::Worker::Create(*ctx, false);
    ASSERT_TRUE(worker.ok());
    const std::string fabricated("\x01\0\0\0\0\0\0\0\0\0", 10);
    for (int port : {data_port, store_->port()}) {
      auto ep = ucx::Endpoint::Connect(worker->get(), "127.0.0.1", port);
      if (!ep.ok()) continue;  // refused: nothing to attack with
      auto rkey = (*ep)->Unpack(fabricated);
      if (!rkey.ok()) continue;
      for (uint64_t addr : targets) {
        std::vector<uint8_t> got(64, 0x5A);
        ucp_request_param_t p{};
        std::vector<void*> reqs = {
            ucp_get_nbx((*ep)->get(), got.data(), got.size(), addr, (*rkey)->get(), &p)};
        absl::Status s = (*worker)->WaitAll(reqs, Clock::now() + std::chrono::seconds(2));
        EXPECT_EQ(std::count(got.begin(), got.end(), 0x5A), 64) << "UCX read at " << addr;
        EXPECT_FALSE(s.ok()) << "a UCX get at " << addr << " on port " << port;
        std::vector<uint8_t> junk(64, 0x66);
        reqs = {ucp_put_nbx((*ep)->get(), junk.data(), junk.size(), addr, (*rkey)->get(), &p)};
        (void)(*worker)->WaitAll(reqs, Clock::now() + std::chrono::seconds(2));
        if ((*ep)->failed()) break;
      }
      (*ep)->MarkFailed();
    }
  }

  // 2. The socket data plane, with alpha's own session and a put lease of
  // its own (2 slots in its region).
  auto alpha = Data(kAlphaToken);
  auto ns_a = alpha->control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns_a.ok());
  v1::BeginPutResponse mine;
  {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant-token", kAlphaToken);
    v1::BeginPutRequest req;
    req.set_namespace_id(ns_a->id);
    for (uint64_t i = 0; i < 2; ++i) ToProto(H(100 + i), req.add_hashes());
    ASSERT_TRUE(stub->BeginPut(&ctx, req, &mine).ok());
    ASSERT_EQ(mine.targets_size(), 2);
  }
  const uint64_t slot = mine.targets(0).remote_addr();
  RawConn c(data_port, a.session());
  ASSERT_EQ(c.hello_.first, 0) << c.hello_.second;
  // Another tenant's lease reads as unknown; its blocks are in no slot of ours.
  EXPECT_EQ(c.Get(beta_lease, beta_addr, kBlock).first, 9) << "beta's lease";
  EXPECT_EQ(c.Put(beta_lease, beta_addr, kBlock).first, 9);
  EXPECT_EQ(c.Get(mine.lease_id(), beta_addr, kBlock).first, 3) << "a put lease read";
  for (uint64_t addr : targets) {
    auto r = c.Put(mine.lease_id(), addr, 64);
    EXPECT_EQ(r.first, 3) << addr << ": " << r.second;
    EXPECT_NE(r.second.find("not inside a slot"), std::string::npos) << r.second;
  }
  // The arena past its slots, a slot's neighbour, one byte too many.
  EXPECT_EQ(c.Put(mine.lease_id(), slot + kBlock * 4, kBlock).first, 3);
  EXPECT_EQ(c.Put(mine.lease_id(), slot, kBlock + 1).first, 3);
  EXPECT_EQ(c.Put(mine.lease_id(), slot - 1, 2).first, 3);
  EXPECT_EQ(c.Get(12345, heap, 8).first, 9) << "a lease nobody holds";
  // Its own slot, whole: allowed (the connection went on serving).
  EXPECT_EQ(c.Put(mine.lease_id(), slot, kBlock).first, 0);
  // A forged session is refused; so are garbage, an unknown op, a huge
  // length (then the connection closes), and a client gone mid-get.
  {
    RawConn forged(data_port, std::string(16, 'x'));
    EXPECT_EQ(forged.hello_.first, 16) << forged.hello_.second;
    EXPECT_EQ(forged.Get(beta_lease, beta_addr, kBlock).first, -1) << "the store closed it";
  }
  {
    RawConn g(data_port, a.session());
    EXPECT_EQ(g.Send(wire::Frame{0xdeadbeef, wire::kGet, 0, 1, heap, 8}).first, 3);
  }
  {
    RawConn g(data_port, a.session());
    EXPECT_EQ(g.Send(wire::Frame{wire::kFrameMagic, 99, 0, 1, heap, 8}).first, 3);
  }
  {
    RawConn g(data_port, a.session());
    EXPECT_EQ(g.Send(wire::Frame{wire::kFrameMagic, wire::kPut, 0, mine.lease_id(), slot,
                                 uint64_t{1} << 40})
                  .first,
              3);
  }
  {
    RawConn g(data_port, "");  // no hello: the first frame must be one
    EXPECT_EQ(g.Get(beta_lease, beta_addr, kBlock).first, 3);
  }
  {
    // Beta's own reader, killed mid-get: it asks for its pinned blocks and
    // goes without reading them.
    v1::ConnectDataPlaneResponse b = Connect(kBetaToken);
    RawConn g(data_port, b.session());
    for (const auto& src : pinned->sources) {
      wire::Frame f{wire::kFrameMagic, wire::kGet, 0, beta_lease, src.remote_addr, kBlock};
      ASSERT_TRUE(net::WriteAll(g.fd(), &f, sizeof(f), Soon()).ok());
    }
    shutdown(g.fd(), SHUT_RDWR);
  }
  // An expired lease moves nothing.
  std::this_thread::sleep_for(std::chrono::milliseconds(3300));
  EXPECT_EQ(c.Put(mine.lease_id(), slot, kBlock).first, 9) << "an expired lease";

  // 3. The store kept serving, beta's blocks are whole, alpha can still work.
  beta->Release(beta_lease);
  ExpectBetaIntact(*beta, ns_b->id);
  auto stats = beta->control().GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  int st = 0;
  EXPECT_EQ(waitpid(store_->proc().pid(), &st, WNOHANG), 0) << "the store exited";
}

INSTANTIATE_TEST_SUITE_P(Transports, Adversary, ::testing::Values("tcp", "all"),
                         [](const auto& info) { return info.param; });

// The resource attacks of issue #46, against a store with small limits:
// alpha may hold 32 data-plane connections and 64 sessions; beta has the
// defaults. Each failed on the store before the limits (its only bound was
// 4,096 connections in all, 65,536 sessions in all, 30 s to a hello, and
// no idle timeout).
class DataPlaneLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    {
      std::ofstream f(dir_.sub("tenants"));
      f << "secret adversary-limits\n"
        << "tenant alpha ram=16MiB connections=32 sessions=64 buffered=1MiB token-sha256="
        << store::Sha256Hex(kAlphaToken) << "\n"
        << "tenant beta ram=16MiB token-sha256=" << store::Sha256Hex(kBetaToken) << "\n";
      std::ofstream a(dir_.sub("admin"));
      a << kAdminToken << "\n";
    }
    store_ = std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir_.sub("store"),
        std::vector<std::string>{
            "--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0", "--data-dir=" + dir_.sub("db"),
            "--hugepages=false", "--ram-bytes=40MiB", "--tenants-file=" + dir_.sub("tenants"),
            "--admin-token-file=" + dir_.sub("admin"), "--data-max-connections=256",
            "--data-max-unhelloed=64", "--data-hello-timeout=500ms", "--data-idle-timeout=2s",
            "--metrics-listen=127.0.0.1:" + std::to_string(metrics_port_)});
    ASSERT_GT(store_->port(), 0) << store_->Log();
    const auto b = Connect(kBetaToken);
    data_port_ = std::stoi(b.data_address().substr(b.data_address().rfind(':') + 1));
  }
  v1::ConnectDataPlaneResponse Connect(const std::string& token) {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("x-kvtier-tenant-token", token);
    v1::ConnectDataPlaneResponse resp;
    EXPECT_TRUE(stub->ConnectDataPlane(&ctx, {}, &resp).ok());
    return resp;
  }
  // A data client of `token`'s tenant; *ns: Spec()'s namespace registered
  // through it.
  std::unique_ptr<StoreDataClient> TenantClient(const std::string& token,
                                                absl::StatusOr<RegisteredNamespace>* ns) {
    DataClientOptions o;
    o.tenant_token = token;
    auto c = std::make_unique<StoreDataClient>(store_->address(), o);
    *ns = c->control().RegisterNamespace(Spec());
    return c;
  }
  // Beta writes 8 blocks and reads them back byte-exact, each step within
  // `budget` (its usual latency here is milliseconds).
  void BetaWorks(std::chrono::milliseconds budget) {
    absl::StatusOr<RegisteredNamespace> ns;
    auto beta = TenantClient(kBetaToken, &ns);
    ASSERT_TRUE(ns.ok()) << ns.status();
    std::vector<std::string> keep;
    std::vector<PutBlock> put;
    for (uint64_t i = 0; i < 8; ++i) {
      keep.push_back(testing::BlockBytesFor(700 + i, kBlock));
      put.push_back({H(100 + i), keep.back().data()});
    }
    auto t0 = Clock::now();
    auto wrote = beta->Put(ns->id, kBlock, put).get();
    ASSERT_TRUE(wrote.ok()) << wrote.status();
    EXPECT_LT(Clock::now() - t0, budget);
    std::vector<uint8_t> dst(8 * kBlock);
    std::vector<GetBlock> blocks;
    for (uint64_t i = 0; i < 8; ++i) blocks.push_back({H(100 + i), dst.data() + i * kBlock});
    t0 = Clock::now();
    auto got = beta->Get(ns->id, kBlock, blocks).get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(Clock::now() - t0, budget);
    ASSERT_EQ(got->blocks, 8u);
    for (uint64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(std::memcmp(dst.data() + i * kBlock, keep[i].data(), kBlock), 0) << i;
    }
  }
  double Metric(const std::string& series) {
    std::string page = testing::HttpGet(metrics_port_, "/metrics");
    size_t at = page.find("\n" + series + " ");
    return at == std::string::npos ? -1 : std::stod(page.substr(at + series.size() + 2));
  }
  // Whether the store has closed `fd` (EOF within `wait`; what it sent
  // before, such as its challenge, is read and dropped).
  static bool ClosedWithin(int fd, std::chrono::milliseconds wait) {
    char buf[256];
    const auto deadline = Clock::now() + wait;
    while (Clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 50) > 0 && recv(fd, buf, sizeof(buf), 0) <= 0) return true;
    }
    return false;
  }
  // BeginPut of `n` blocks from H(first) for `token`'s tenant, on a gRPC
  // connection of its own (another client).
  v1::BeginPutResponse BeginPut(const std::string& token, uint64_t ns, uint64_t first, int n) {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("x-kvtier-tenant-token", token);
    v1::BeginPutRequest req;
    req.set_namespace_id(ns);
    for (int i = 0; i < n; ++i) ToProto(H(first + i), req.add_hashes());
    v1::BeginPutResponse resp;
    EXPECT_TRUE(stub->BeginPut(&ctx, req, &resp).ok());
    return resp;
  }
  // AbortPut of `lease` (or of the put begun with `begin_token`) as
  // `token`'s tenant, over gRPC: the status code.
  grpc::StatusCode AbortPut(const std::string& token, uint64_t lease, uint64_t begin_token = 0) {
    auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("x-kvtier-tenant-token", token);
    v1::AbortPutRequest req;
    req.set_lease_id(lease);
    req.set_begin_token(begin_token);
    v1::AbortPutResponse resp;
    return stub->AbortPut(&ctx, req, &resp).error_code();
  }

  testing::TempDir dir_;
  int metrics_port_ = testing::FreePort();
  std::unique_ptr<ServerProcess> store_;
  int data_port_ = 0;
};

TEST_F(DataPlaneLimits, AFloodOfSilentConnectionsNeverLocksATenantOut) {
  // 600 connections that never say hello: more than the store's 256
  // connections in all. Each new one evicts the oldest silent one past 64.
  std::vector<int> flood;
  for (int i = 0; i < 600; ++i) {
    auto fd = net::Connect("127.0.0.1", data_port_, Soon());
    ASSERT_TRUE(fd.ok()) << fd.status();
    flood.push_back(*fd);
  }
  BetaWorks(std::chrono::milliseconds(2000));
  // The oldest were closed long before the hello deadline; the rest go at it.
  EXPECT_TRUE(ClosedWithin(flood.front(), std::chrono::milliseconds(100)));
  EXPECT_TRUE(ClosedWithin(flood.back(), std::chrono::milliseconds(2000)));
  for (int fd : flood) close(fd);
  EXPECT_GE(Metric("kvtier_store_dataplane_closed_total{reason=\"unhelloed\"}"), 600 - 64);
  EXPECT_LE(Metric("kvtier_store_dataplane_unhelloed_connections"), 64);
}

TEST_F(DataPlaneLimits, ATenantAtItsConnectionLimitLeavesTheOtherAlone) {
  const std::string session = Connect(kAlphaToken).session();
  std::vector<std::unique_ptr<RawConn>> held;
  for (int i = 0; i < 32; ++i) {
    held.push_back(std::make_unique<RawConn>(data_port_, session));
    ASSERT_EQ(held.back()->hello_.first, 0) << i << ": " << held.back()->hello_.second;
  }
  for (int i = 0; i < 20; ++i) {
    RawConn more(data_port_, session);
    EXPECT_EQ(more.hello_.first, static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_NE(more.hello_.second.find("connections="), std::string::npos) << more.hello_.second;
    EXPECT_NE(more.hello_.second.find("alpha"), std::string::npos) << more.hello_.second;
  }
  BetaWorks(std::chrono::milliseconds(2000));
  EXPECT_EQ(Metric("kvtier_store_tenant_dataplane_refused_total{tenant=\"alpha\"}"), 20);
  EXPECT_EQ(Metric("kvtier_store_tenant_dataplane_connections{tenant=\"alpha\"}"), 32);
  // One of alpha's goes: alpha may open one again.
  held.pop_back();
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  for (;;) {
    RawConn again(data_port_, session);
    if (again.hello_.first == 0) break;
    ASSERT_LT(Clock::now(), deadline) << "alpha's closed connection was never counted out";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Twenty refusals in well under a second: one log line.
  const std::string log = store_->Log();
  size_t lines = 0;
  for (size_t at = log.find("refused a connection"); at != std::string::npos;
       at = log.find("refused a connection", at + 1)) {
    lines++;
  }
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 3u);
}

TEST_F(DataPlaneLimits, SessionChurnDropsOnlyTheChurningTenantsOwnSessions) {
  const std::string beta_session = Connect(kBetaToken).session();
  const std::string alpha_first = Connect(kAlphaToken).session();
  for (int i = 0; i < 100; ++i) Connect(kAlphaToken);  // past alpha's 64
  RawConn beta(data_port_, beta_session);
  EXPECT_EQ(beta.hello_.first, 0) << beta.hello_.second;
  RawConn old(data_port_, alpha_first);
  EXPECT_EQ(old.hello_.first, static_cast<int>(absl::StatusCode::kUnauthenticated))
      << old.hello_.second;
  RawConn fresh(data_port_, Connect(kAlphaToken).session());
  EXPECT_EQ(fresh.hello_.first, 0) << fresh.hello_.second;
  // 102 sessions of alpha's, 64 kept.
  EXPECT_EQ(Metric("kvtier_store_tenant_sessions_dropped_total{tenant=\"alpha\"}"), 102 - 64);
  EXPECT_EQ(Metric("kvtier_store_tenant_sessions_dropped_total{tenant=\"beta\"}"), 0);
}

// Issue #60: past a tenant's session cap the session idle longest goes, not
// the oldest: a long-lived engine that keeps using its session keeps it
// while another client of the tenant churns through new ones.
TEST_F(DataPlaneLimits, SessionChurnDropsTheIdlestSessionNotALongLivedBusyOne) {
  const std::string engine = Connect(kAlphaToken).session();
  RawConn held(data_port_, engine);  // the engine's pooled connection
  ASSERT_EQ(held.hello_.first, 0) << held.hello_.second;
  for (int i = 0; i < 100; ++i) {
    Connect(kAlphaToken);  // past alpha's 64, many times over
    if (i % 16 == 0) {
      RawConn used(data_port_, engine);
      ASSERT_EQ(used.hello_.first, 0) << "at churn " << i << ": " << used.hello_.second;
    }
  }
  RawConn still(data_port_, engine);
  EXPECT_EQ(still.hello_.first, 0) << still.hello_.second;
}

// Issue #60: a socket session is released when its last connection closes
// (it stayed until its tenant's cap pushed it out); while one of its
// connections lives, the session serves on.
TEST_F(DataPlaneLimits, ASessionIsReleasedWhenItsLastConnectionCloses) {
  const std::string released_series = "kvtier_store_dataplane_sessions_released_total";
  const double released = std::max(0.0, Metric(released_series));
  const std::string session = Connect(kAlphaToken).session();
  const double held = Metric("kvtier_store_dataplane_sessions");
  EXPECT_GE(held, 1);
  auto open = [&] { return Metric("kvtier_store_tenant_dataplane_connections{tenant=\"alpha\"}"); };
  const double before = open();
  auto b = std::make_unique<RawConn>(data_port_, session);
  ASSERT_EQ(b->hello_.first, 0) << b->hello_.second;
  auto a = std::make_unique<RawConn>(data_port_, session);
  ASSERT_EQ(a->hello_.first, 0) << a->hello_.second;
  a.reset();
  ASSERT_TRUE(testing::WaitFor([&] { return open() == before + 1; })) << open();
  auto c = std::make_unique<RawConn>(data_port_, session);
  EXPECT_EQ(c->hello_.first, 0) << "released with a connection open: " << c->hello_.second;
  b.reset();
  c.reset();
  ASSERT_TRUE(testing::WaitFor([&] { return Metric(released_series) == released + 1; }))
      << Metric(released_series);
  EXPECT_EQ(Metric("kvtier_store_dataplane_sessions"), held - 1);
  RawConn late(data_port_, session);
  EXPECT_EQ(late.hello_.first, static_cast<int>(absl::StatusCode::kUnauthenticated))
      << late.hello_.second;
}

TEST_F(DataPlaneLimits, SilentAndIdleConnectionsAreClosedAndClientsReconnect) {
  // No hello: closed at the 500 ms hello deadline (it was 30 s).
  auto silent = net::Connect("127.0.0.1", data_port_, Soon());
  ASSERT_TRUE(silent.ok());
  const auto t0 = Clock::now();
  EXPECT_TRUE(ClosedWithin(*silent, std::chrono::milliseconds(3000)));
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2000));
  close(*silent);
  // Authenticated but idle: closed after 2 s (it was never).
  RawConn idle(data_port_, Connect(kBetaToken).session());
  ASSERT_EQ(idle.hello_.first, 0);
  EXPECT_TRUE(ClosedWithin(idle.fd(), std::chrono::milliseconds(4000)));
  EXPECT_EQ(Metric("kvtier_store_dataplane_closed_total{reason=\"hello_timeout\"}"), 1);
  EXPECT_GE(Metric("kvtier_store_dataplane_closed_total{reason=\"idle\"}"), 1);
  // A client whose pooled connections the store closed while idle
  // reconnects before its next operation: nothing fails.
  DataClientOptions o;
  o.tenant_token = kBetaToken;
  StoreDataClient beta(store_->address(), o);
  auto ns = beta.control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  const std::string bytes = testing::BlockBytesFor(900, kBlock);
  std::vector<PutBlock> put = {{H(200), bytes.data()}};
  auto wrote = beta.Put(ns->id, kBlock, put).get();
  ASSERT_TRUE(wrote.ok()) << wrote.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(2600));
  std::vector<uint8_t> dst(kBlock);
  std::vector<GetBlock> get = {{H(200), dst.data()}};
  auto got = beta.Get(ns->id, kBlock, get).get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->blocks, 1u);
  EXPECT_EQ(std::memcmp(dst.data(), bytes.data(), kBlock), 0);
}

TEST_F(DataPlaneLimits, ASniffedHelloOpensNoConnectionAndCommitsNothing) {
  // Alpha's client says hello; an eavesdropper reads all of it off the wire
  // (the session id, the store's nonce, the proof) and replays it, or sends
  // the id as a session the way a hello used to carry it. (Before the
  // challenge, the hello was the session itself: a replay was alpha.)
  const std::string session = Connect(kAlphaToken).session();
  ASSERT_EQ(session.size(), wire::kSocketSessionBytes);
  RawConn alpha(data_port_, session);
  ASSERT_EQ(alpha.hello_.first, 0) << alpha.hello_.second;
  const std::string sniffed = alpha.hello_payload();
  const std::string id = sniffed.substr(0, wire::kSessionIdBytes);
  absl::StatusOr<RegisteredNamespace> ns;
  auto owner = TenantClient(kAlphaToken, &ns);
  ASSERT_TRUE(ns.ok()) << ns.status();
  v1::BeginPutRequest begin;
  begin.set_namespace_id(ns->id);
  ToProto(H(900), begin.add_hashes());
  for (int attempt = 0; attempt < 3; ++attempt) {
    RawConn thief(data_port_, "");
    if (attempt == 0) thief.Hello(sniffed);  // the whole hello, replayed
    if (attempt == 1) thief.Hello(id);       // the id as the session
    if (attempt == 2) thief.Hello(id + std::string(wire::kProofBytes, '\0'));  // a guessed proof
    EXPECT_NE(thief.hello_.first, 0) << attempt;
    if (attempt != 1) {
      EXPECT_EQ(thief.hello_.first, static_cast<int>(absl::StatusCode::kUnauthenticated));
      EXPECT_NE(thief.hello_.second.find("proof"), std::string::npos) << thief.hello_.second;
    }
    // Whatever it sends next finds the connection closed: no BeginPut, so
    // no slot to write and nothing to commit.
    EXPECT_EQ(thief.Call(ucx::kCallBeginPut, begin).first, -1) << attempt;
  }
  // Nothing of the thief's is stored, and alpha's own connection serves on.
  auto found = owner->control().Lookup(ns->id, {H(900)});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE(found->empty()) << "a block the thief began";
  EXPECT_EQ(alpha.Call(ucx::kCallBeginPut, begin).first, 0);
  EXPECT_GE(Metric("kvtier_store_dataplane_closed_total{reason=\"hello\"}"), 2);
}

TEST_F(DataPlaneLimits, ALeaseIdNamesNoOtherClientsLease) {
  // Two clients of one tenant: the second, knowing its own lease id, tries
  // the ids around it against the first's put. (Ids came from a counter:
  // the first's was the second's minus one.)
  absl::StatusOr<RegisteredNamespace> ns;
  auto alpha = TenantClient(kAlphaToken, &ns);
  ASSERT_TRUE(ns.ok()) << ns.status();
  const v1::BeginPutResponse first = BeginPut(kAlphaToken, ns->id, 300, 1);
  const v1::BeginPutResponse second = BeginPut(kAlphaToken, ns->id, 310, 1);
  ASSERT_NE(first.lease_id(), 0u);
  ASSERT_NE(second.lease_id(), 0u);
  for (int64_t d = -64; d <= 64; ++d) {
    if (d == 0) continue;
    const uint64_t guess = second.lease_id() + static_cast<uint64_t>(d);
    EXPECT_EQ(AbortPut(kAlphaToken, guess), grpc::FAILED_PRECONDITION) << d;
  }
  // The first client's lease is still its own to end.
  EXPECT_EQ(AbortPut(kAlphaToken, first.lease_id()), grpc::OK);
  EXPECT_EQ(AbortPut(kAlphaToken, second.lease_id()), grpc::OK);
}

TEST_F(DataPlaneLimits, ALeaseIsOnlyTheSessionsThatOpenedIt) {
  // Two sessions of one tenant (two clients of alpha). A put lease opened
  // by a call on the first was usable by the second: it could write the
  // slot and commit it. Now only the opening session's connections may.
  absl::StatusOr<RegisteredNamespace> ns;
  auto alpha = TenantClient(kAlphaToken, &ns);
  ASSERT_TRUE(ns.ok()) << ns.status();
  RawConn owner(data_port_, Connect(kAlphaToken).session());
  RawConn other(data_port_, Connect(kAlphaToken).session());
  ASSERT_EQ(owner.hello_.first, 0) << owner.hello_.second;
  ASSERT_EQ(other.hello_.first, 0) << other.hello_.second;
  v1::BeginPutRequest begin;
  begin.set_namespace_id(ns->id);
  ToProto(H(900), begin.add_hashes());
  auto [code, text] = owner.Call(ucx::kCallBeginPut, begin);
  ASSERT_EQ(code, 0) << text;
  v1::BeginPutResponse put;
  ASSERT_TRUE(put.ParseFromString(text));
  ASSERT_EQ(put.targets_size(), 1);
  const uint64_t addr = put.targets(0).remote_addr();
  v1::CommitPutRequest commit;
  commit.set_lease_id(put.lease_id());
  commit.set_store_checksums(true);
  // The other session: no such lease, for its transfers and its calls.
  const int gone = static_cast<int>(absl::StatusCode::kFailedPrecondition);
  auto refused = other.Put(put.lease_id(), addr, kBlock);
  EXPECT_EQ(refused.first, gone) << refused.second;
  EXPECT_NE(refused.second.find("unknown"), std::string::npos) << refused.second;
  refused = other.Call(ucx::kCallCommitPut, commit);
  EXPECT_EQ(refused.first, gone) << refused.second;
  // The opening session writes and commits it.
  auto wrote = owner.Put(put.lease_id(), addr, kBlock);
  ASSERT_EQ(wrote.first, 0) << wrote.second;
  auto [committed, reply] = owner.Call(ucx::kCallCommitPut, commit);
  ASSERT_EQ(committed, 0) << reply;
  v1::CommitPutResponse done;
  ASSERT_TRUE(done.ParseFromString(reply));
  EXPECT_EQ(done.committed(), 1u);
  // And the tenant reads back the owner's bytes, not anything else.
  std::vector<uint8_t> dst(kBlock);
  auto got = alpha->Get(ns->id, kBlock, {{H(900), dst.data()}}).get();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->blocks, 1u);
  EXPECT_EQ(dst, std::vector<uint8_t>(kBlock, 0x66));
}

// Issue #60: AbortPut by a BeginPut's abandon token ends only that put: not
// when another tenant presents the token, and the writer's own abandon (over
// gRPC, for a put begun on its data-plane session) ends it for good.
TEST_F(DataPlaneLimits, AnAbandonTokenEndsOnlyItsWritersPut) {
  absl::StatusOr<RegisteredNamespace> ns;
  auto alpha = TenantClient(kAlphaToken, &ns);
  ASSERT_TRUE(ns.ok()) << ns.status();
  RawConn writer(data_port_, Connect(kAlphaToken).session());
  ASSERT_EQ(writer.hello_.first, 0) << writer.hello_.second;
  auto begin = [&](uint64_t block, uint64_t token) {
    v1::BeginPutRequest req;
    req.set_namespace_id(ns->id);
    req.set_abandon_token(token);
    ToProto(H(block), req.add_hashes());
    auto [code, text] = writer.Call(ucx::kCallBeginPut, req);
    EXPECT_EQ(code, 0) << text;
    v1::BeginPutResponse put;
    EXPECT_TRUE(put.ParseFromString(text));
    EXPECT_EQ(put.targets_size(), 1);
    return put;
  };
  auto abandon = [&](const std::string& token, uint64_t begin_token) {
    return AbortPut(token, 0, begin_token);
  };
  const uint64_t kept_token = 0x9e3779b97f4a7c15, dropped_token = 0x2545f4914f6cdd1d;
  const v1::BeginPutResponse kept = begin(950, kept_token);
  const v1::BeginPutResponse dropped = begin(951, dropped_token);
  // Beta presenting alpha's token: answered, and nothing of alpha's ends.
  EXPECT_EQ(abandon(kBetaToken, kept_token), grpc::OK);
  auto wrote = writer.Put(kept.lease_id(), kept.targets(0).remote_addr(), kBlock);
  ASSERT_EQ(wrote.first, 0) << wrote.second;
  v1::CommitPutRequest commit;
  commit.set_lease_id(kept.lease_id());
  commit.set_store_checksums(true);
  auto [committed, reply] = writer.Call(ucx::kCallCommitPut, commit);
  ASSERT_EQ(committed, 0) << reply;
  // The writer's own abandon ends its put: no transfer, no commit.
  EXPECT_EQ(abandon(kAlphaToken, dropped_token), grpc::OK);
  auto refused = writer.Put(dropped.lease_id(), dropped.targets(0).remote_addr(), kBlock);
  EXPECT_EQ(refused.first, static_cast<int>(absl::StatusCode::kFailedPrecondition))
      << refused.second;
  auto found = alpha->control().Lookup(ns->id, {H(950), H(951)});
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->size(), 1u);
}

TEST_F(DataPlaneLimits, DeclaredCallsTakeNoMemoryAndATenantsBodiesStayInItsBudget) {
  // 31 of alpha's connections each declare a call of the largest size
  // (4 MiB) and send none of it. The store allocated each declared length
  // at once: 124 MiB resident for nothing sent. Now a body is read as it
  // arrives, and alpha's bodies being read stay within its buffered=1MiB.
  const std::string session = Connect(kAlphaToken).session();
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < 31; ++i) {
    conns.push_back(std::make_unique<RawConn>(data_port_, session));
    ASSERT_EQ(conns.back()->hello_.first, 0) << conns.back()->hello_.second;
  }
  // What the calls add is measured from here.
  const uint64_t before = RssBytes(store_->proc().pid());
  // The first declares 768 KiB (within the budget) and sends nothing.
  wire::Frame big{wire::kFrameMagic, wire::kCall, ucx::kCallBeginPut, 0, 0, 768 << 10};
  ASSERT_TRUE(net::WriteAll(conns[0]->fd(), &big, sizeof(big), Soon()).ok());
  // The others: past the budget, each is answered at once, naming it.
  for (size_t i = 1; i < conns.size(); ++i) {
    wire::Frame f{wire::kFrameMagic, wire::kCall, ucx::kCallBeginPut, 0, 0, wire::kMaxMessageBytes};
    ASSERT_TRUE(net::WriteAll(conns[i]->fd(), &f, sizeof(f), Soon()).ok());
    wire::Reply r;
    ASSERT_TRUE(net::ReadAll(conns[i]->fd(), &r, sizeof(r), Soon()).ok()) << i;
    std::string text(r.message_bytes, '\0');
    ASSERT_TRUE(net::ReadAll(conns[i]->fd(), text.data(), text.size(), Soon()).ok());
    EXPECT_EQ(r.code, static_cast<int>(absl::StatusCode::kResourceExhausted)) << text;
    EXPECT_NE(text.find("buffered= of tenant alpha"), std::string::npos) << text;
  }
  EXPECT_EQ(Metric("kvtier_store_dataplane_calls_refused_total{reason=\"buffered\"}"), 30);
  EXPECT_EQ(Metric("kvtier_store_tenant_dataplane_buffered_bytes{tenant=\"alpha\"}"), 768 << 10);
  const uint64_t after = RssBytes(store_->proc().pid());
  EXPECT_LT(after, before + (8ull << 20)) << "resident bytes grew by " << (after - before);
  // Beta is untouched by alpha's budget.
  BetaWorks(std::chrono::milliseconds(2000));
  EXPECT_EQ(Metric("kvtier_store_tenant_dataplane_buffered_bytes{tenant=\"beta\"}"), 0);
  // Alpha's declared call goes with its connection; its budget comes back.
  conns[0].reset();
  ASSERT_TRUE(testing::WaitFor([&] {
    return Metric("kvtier_store_tenant_dataplane_buffered_bytes{tenant=\"alpha\"}") == 0;
  }));
}

TEST_F(DataPlaneLimits, ATrickledPutHoldsNoCommitThread) {
  // Alpha reserves a block and trickles its bytes on one connection (half
  // sent, the rest withheld), then commits and aborts on others. The commit
  // waited for the transfer, parking a gRPC thread until the lease's
  // deadline (10 s here); one such per connection ties up the server.
  absl::StatusOr<RegisteredNamespace> ns;
  auto alpha = TenantClient(kAlphaToken, &ns);
  ASSERT_TRUE(ns.ok()) << ns.status();
  const v1::BeginPutResponse put = BeginPut(kAlphaToken, ns->id, 400, 1);
  ASSERT_EQ(put.targets_size(), 1);
  RawConn c(data_port_, Connect(kAlphaToken).session());
  ASSERT_EQ(c.hello_.first, 0) << c.hello_.second;
  wire::Frame f{
      wire::kFrameMagic, wire::kPut, 0, put.lease_id(), put.targets(0).remote_addr(), kBlock};
  const std::string half(kBlock / 2, 'x');
  ASSERT_TRUE(net::WriteAll(c.fd(), &f, sizeof(f), Soon()).ok());
  ASSERT_TRUE(net::WriteAll(c.fd(), half.data(), half.size(), Soon()).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the store reads into the slot
  auto stub = v1::Store::NewStub(OpenChannel(store_->address(), {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  ctx.AddMetadata("x-kvtier-tenant-token", kAlphaToken);
  v1::CommitPutRequest commit;
  commit.set_lease_id(put.lease_id());
  commit.add_checksums(0);
  v1::CommitPutResponse committed;
  const auto t0 = Clock::now();
  const grpc::Status st = stub->CommitPut(&ctx, commit, &committed);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1)) << "the commit waited on the transfer";
  EXPECT_EQ(st.error_code(), grpc::UNAVAILABLE) << st.error_message();
  EXPECT_NE(st.error_message().find("still under way"), std::string::npos) << st.error_message();
  // Ending it does not wait either; the transfer's end releases it.
  const auto t1 = Clock::now();
  EXPECT_EQ(AbortPut(kAlphaToken, put.lease_id()), grpc::OK);
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(1)) << "the abort waited on the transfer";
  BetaWorks(std::chrono::milliseconds(2000));
  // The rest of the bytes land in the slot the store still held for them;
  // nothing of the aborted put is stored.
  ASSERT_TRUE(net::WriteAll(c.fd(), half.data(), half.size(), Soon()).ok());
  wire::Reply r;
  ASSERT_TRUE(net::ReadAll(c.fd(), &r, sizeof(r), Soon()).ok());
  auto found = alpha->control().Lookup(ns->id, {H(400)});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE(found->empty());
}

TEST(DataPlaneClients, IdleConnectionsTakeNoThreadsAndLittleMemory) {
  // 1,500 authenticated connections that say nothing more. The store ran a
  // thread per connection: 1,500 threads (and their stacks) for nothing.
  // Now a few event loops serve them all, and another client's transfers
  // stay byte-exact and prompt meanwhile.
  constexpr int kIdle = 1500;
  testing::TempDir dir;
  auto store = testing::StartLoopbackStore(
      dir.sub("store"), {"--data-max-connections=4096", "--data-max-connections-per-client=4096",
                         "--data-max-unhelloed=2048"});
  ASSERT_GT(store->port(), 0) << store->Log();
  auto stub = v1::Store::NewStub(OpenChannel(store->address(), {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ConnectDataPlaneResponse first;
  ASSERT_TRUE(stub->ConnectDataPlane(&ctx, {}, &first).ok());
  const int port = std::stoi(first.data_address().substr(first.data_address().rfind(':') + 1));
  // A working client first, so its own connections are in `before`.
  StoreDataClient client(store->address());
  auto ns = client.control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto round_trip = [&](uint64_t salt) {
    std::vector<std::string> keep;
    std::vector<PutBlock> put;
    for (uint64_t i = 0; i < 8; ++i) {
      keep.push_back(testing::BlockBytesFor(salt + i, kBlock));
      put.push_back({H(salt + i), keep.back().data()});
    }
    auto wrote = client.Put(ns->id, kBlock, put).get();
    ASSERT_TRUE(wrote.ok()) << wrote.status();
    std::vector<uint8_t> dst(8 * kBlock);
    std::vector<GetBlock> blocks;
    for (uint64_t i = 0; i < 8; ++i) blocks.push_back({H(salt + i), dst.data() + i * kBlock});
    const auto t0 = Clock::now();
    auto got = client.Get(ns->id, kBlock, blocks).get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
    ASSERT_EQ(got->blocks, 8u);
    for (uint64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(std::memcmp(dst.data() + i * kBlock, keep[i].data(), kBlock), 0) << i;
    }
  };
  round_trip(1000);
  const pid_t pid = store->proc().pid();
  const int threads_before = ThreadCount(pid);
  const uint64_t rss_before = RssBytes(pid);
  std::vector<std::unique_ptr<RawConn>> idle;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<RawConn>(port, first.session()));
    ASSERT_EQ(idle.back()->hello_.first, 0) << i << ": " << idle.back()->hello_.second;
  }
  const int threads_after = ThreadCount(pid);
  const uint64_t rss_after = RssBytes(pid);
  EXPECT_LT(threads_after - threads_before, 8)
      << threads_before << " threads before the idle connections, " << threads_after << " after";
  EXPECT_LT(rss_after, rss_before + (32ull << 20))
      << "resident bytes grew by " << (rss_after - rss_before) << " for " << kIdle
      << " idle connections";
  round_trip(2000);
}

TEST(DataPlaneClients, AClientOfAStoreWithoutTenantsHoldsAtMostItsConnections) {
  // No tenants: one client (here, its host) may not take every connection.
  // A new gRPC connection, and so a new session, is still the same client.
  testing::TempDir dir;
  const int metrics_port = testing::FreePort();
  auto store = testing::StartLoopbackStore(
      dir.sub("store"), {"--data-max-connections-per-client=8",
                         "--metrics-listen=127.0.0.1:" + std::to_string(metrics_port)});
  ASSERT_GT(store->port(), 0) << store->Log();
  auto connect = [&] {
    auto stub = v1::Store::NewStub(OpenChannel(store->address(), {}));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ConnectDataPlaneResponse resp;
    EXPECT_TRUE(stub->ConnectDataPlane(&ctx, {}, &resp).ok());
    return resp;
  };
  const auto first = connect();
  const int port = std::stoi(first.data_address().substr(first.data_address().rfind(':') + 1));
  std::vector<std::unique_ptr<RawConn>> held;
  for (int i = 0; i < 8; ++i) {
    held.push_back(std::make_unique<RawConn>(port, first.session()));
    ASSERT_EQ(held.back()->hello_.first, 0) << i << ": " << held.back()->hello_.second;
  }
  for (const auto& session : {first.session(), connect().session()}) {
    RawConn more(port, session);
    EXPECT_EQ(more.hello_.first, static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_NE(more.hello_.second.find("--data-max-connections-per-client"), std::string::npos)
        << more.hello_.second;
  }
  const std::string page = testing::HttpGet(metrics_port, "/metrics");
  EXPECT_NE(page.find("\nkvtier_store_client_dataplane_refused_total 2"), std::string::npos);
  // One closes: the client may open one again.
  held.pop_back();
  EXPECT_TRUE(testing::WaitFor([&] {
    RawConn again(port, first.session());
    return again.hello_.first == 0;
  }));
}

}  // namespace
}  // namespace kvtier
