// gRPC over TLS and mutual TLS between real kvtier processes on loopback,
// with certificates made by openssl for each test run: plaintext and
// unknown-CA clients are refused, mTLS refuses clients without a CA-signed
// certificate, --admin-identity keeps a worker's certificate from the admin
// RPCs, a store, a router and a worker talk to each other over mTLS, and a
// store's socket data plane under --data-tls shows an eavesdropper nothing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "client/router_client.h"
#include "client/store_client.h"
#include "client/store_data_client.h"
#include "common/block_key.h"
#include "common/rpc/tls.h"
#include "common/tls_stream.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "tests/fault_proxy.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

// A CA, leaf certificates it signs (127.0.0.1 and localhost in each, usable
// as server and client certificates) and a second, unrelated CA.
class Pki {
 public:
  explicit Pki(const std::string& dir) : dir_(dir) {
    ok_ = MakeCa("ca") && MakeCa("rogue-ca") && MakeLeaf("server", "ca", "kvtier-server") &&
          MakeLeaf("worker", "ca", "worker") && MakeLeaf("admin", "ca", "kvctl-admin") &&
          MakeLeaf("rogue", "rogue-ca", "kvctl-admin") &&
          MakeLeaf("tls-store", "ca", "tls-store") && MakeLeaf("tls-worker", "ca", "tls-worker") &&
          MakeLeaf("worker-a", "ca", "worker-a") && MakeLeaf("worker-b", "ca", "worker-b");
  }
  bool ok() const { return ok_; }
  std::string log() const { return log_; }
  std::string pem(const std::string& name) const { return dir_ + "/" + name + ".pem"; }
  std::string key(const std::string& name) const { return dir_ + "/" + name + ".key"; }
  // Server flags: serve with the server certificate; mutual TLS when asked.
  std::vector<std::string> ServerFlags(bool mutual, const std::string& leaf = "server") const {
    std::vector<std::string> f = {"--tls-cert=" + pem(leaf), "--tls-key=" + key(leaf),
                                  "--tls-ca=" + pem("ca")};
    if (mutual) f.push_back("--tls-require-client-cert");
    return f;
  }
  // Client security: trust `ca`; present `leaf` when not empty.
  ChannelSecurity Client(const std::string& ca, const std::string& leaf = "",
                         const std::string& server_name = "") const {
    TlsFlags t;
    t.ca_file = pem(ca);
    if (!leaf.empty()) {
      t.cert_file = pem(leaf);
      t.key_file = key(leaf);
    }
    t.server_name = server_name;
    auto s = ClientSecurity(t);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : ChannelSecurity{};
  }

 private:
  bool Run(const std::string& cmd) {
    ShellResult r = RunShell("cd " + dir_ + " && " + cmd + " 2>&1");
    log_ += r.out;
    return r.exit_code == 0;
  }
  bool MakeCa(const std::string& name) {
    return Run(
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " +
        name + ".key -out " + name + ".pem -days 2 -subj /CN=" + name);
  }
  bool MakeLeaf(const std::string& name, const std::string& ca, const std::string& cn) {
    std::ofstream(dir_ + "/" + name + ".ext")
        << "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:" << cn << "\n"
        << "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n";
    return Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " +
               name + ".key -out " + name + ".csr -subj /CN=" + cn) &&
           Run("openssl x509 -req -in " + name + ".csr -CA " + ca + ".pem -CAkey " + ca +
               ".key -set_serial " + std::to_string(++serial_) + " -days 2 -extfile " + name +
               ".ext -out " + name + ".pem");
  }
  std::string dir_, log_;
  bool ok_ = false;
  int serial_ = 0;
};

StoreClient Client(const ServerProcess& s, ChannelSecurity security) {
  StoreClientOptions o;
  o.deadline_ms = 3000;
  o.security = std::move(security);
  return StoreClient(s.address(), o);
}

class Tls : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(pki_.ok()) << pki_.log(); }
  ServerProcess Store(std::vector<std::string> extra) {
    std::vector<std::string> args = {"--listen=127.0.0.1:0", "--data-dir=" + dir_.sub("db"),
                                     "--hugepages=false", "--ram-bytes=4MiB"};
    args.insert(args.end(), extra.begin(), extra.end());
    return ServerProcess(KVTIER_STORE_BIN, dir_.sub("store"), args);
  }
  testing::TempDir dir_;
  Pki pki_{dir_.path()};
};

TEST_F(Tls, StoreServesTlsAndRefusesPlaintextAndUnknownCas) {
  ServerProcess store = Store(pki_.ServerFlags(/*mutual=*/false));
  ASSERT_GT(store.port(), 0) << store.Log();
  EXPECT_NE(store.Log().find(", TLS ("), std::string::npos) << store.Log();

  EXPECT_TRUE(Client(store, pki_.Client("ca")).GetStats().ok());
  EXPECT_TRUE(Client(store, pki_.Client("ca", "", "localhost")).GetStats().ok());

  auto plain = Client(store, {}).GetStats();
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable) << plain.status();
  auto rogue = Client(store, pki_.Client("rogue-ca")).GetStats();
  EXPECT_EQ(rogue.status().code(), absl::StatusCode::kUnavailable) << rogue.status();
  // The certificate does not name this host.
  auto misnamed = Client(store, pki_.Client("ca", "", "store.elsewhere")).GetStats();
  EXPECT_EQ(misnamed.status().code(), absl::StatusCode::kUnavailable) << misnamed.status();
  // The refusals left the store serving.
  EXPECT_TRUE(Client(store, pki_.Client("ca")).Health().ok());
}

TEST_F(Tls, MutualTlsRefusesClientsWithoutACertificateSignedByTheCa) {
  ServerProcess store = Store(pki_.ServerFlags(/*mutual=*/true));
  ASSERT_GT(store.port(), 0) << store.Log();
  EXPECT_NE(store.Log().find(", mutual TLS ("), std::string::npos) << store.Log();

  auto none = Client(store, pki_.Client("ca")).GetStats();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
  auto rogue = Client(store, pki_.Client("ca", "rogue")).GetStats();
  EXPECT_EQ(rogue.status().code(), absl::StatusCode::kUnavailable) << rogue.status();
  auto plain = Client(store, {}).GetStats();
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable) << plain.status();

  StoreClient worker = Client(store, pki_.Client("ca", "worker"));
  EXPECT_TRUE(worker.GetStats().ok());
  EXPECT_TRUE(
      worker.RegisterNamespace(NamespaceSpec{"m", "fp16", 2, 2, 64, 16, 0, 1, "", "", ""}).ok());
}

TEST_F(Tls, AdminIdentityKeepsAWorkersCertificateFromTheAdminRpcs) {
  std::vector<std::string> flags = pki_.ServerFlags(/*mutual=*/true);
  flags.push_back("--admin-identity=kvctl-admin");
  ServerProcess store = Store(flags);
  ASSERT_GT(store.port(), 0) << store.Log();

  StoreClient worker = Client(store, pki_.Client("ca", "worker"));
  ASSERT_TRUE(
      worker.RegisterNamespace(NamespaceSpec{"m", "fp16", 2, 2, 64, 16, 0, 1, "", "", ""}).ok());
  auto denied = worker.SetPolicy(v1::TIER_RAM, "lru");
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(denied.status().message().find("\"kvctl-admin\""), std::string::npos)
      << denied.status();
  EXPECT_NE(denied.status().message().find("\"worker\""), std::string::npos) << denied.status();
  v1::EvictRequest all;
  all.set_all(true);
  EXPECT_EQ(worker.Evict(all).status().code(), absl::StatusCode::kPermissionDenied);

  // kvctl, as an operator would run it, with each certificate.
  std::string common = std::string(KVTIER_KVCTL_BIN) + " policy set --tier ram lru --store " +
                       store.address() + " --tls-ca " + pki_.pem("ca");
  ShellResult as_worker = RunShell(common + " --tls-cert " + pki_.pem("worker") + " --tls-key " +
                                   pki_.key("worker") + " 2>&1");
  EXPECT_EQ(as_worker.exit_code, 1) << as_worker.out;
  EXPECT_NE(as_worker.out.find("kvctl-admin"), std::string::npos) << as_worker.out;
  ShellResult as_admin = RunShell(common + " --tls-cert " + pki_.pem("admin") + " --tls-key " +
                                  pki_.key("admin") + " 2>&1");
  EXPECT_EQ(as_admin.exit_code, 0) << as_admin.out;
  auto policy = worker.GetStats();
  ASSERT_TRUE(policy.ok());
  // Same common name, other CA: refused at the handshake (exit 3: unreachable).
  ShellResult as_rogue = RunShell(common + " --tls-cert " + pki_.pem("rogue") + " --tls-key " +
                                  pki_.key("rogue") + " 2>&1");
  EXPECT_EQ(as_rogue.exit_code, 3) << as_rogue.out;

  // kvctl health, as a probe would run it.
  ShellResult health =
      RunShell(std::string(KVTIER_KVCTL_BIN) + " health " + store.address() + " --tls-ca " +
               pki_.pem("ca") + " --tls-cert " + pki_.pem("admin") + " --tls-key " +
               pki_.key("admin") + " --service kvtier.v1.Store/disk 2>&1");
  EXPECT_EQ(health.exit_code, 0) << health.out;
  EXPECT_NE(health.out.find("SERVING"), std::string::npos) << health.out;
  ShellResult plain_health =
      RunShell(std::string(KVTIER_KVCTL_BIN) + " health " + store.address() + " --timeout 1s 2>&1");
  EXPECT_EQ(plain_health.exit_code, 3) << plain_health.out;
}

TEST_F(Tls, StoreRouterAndWorkerTalkOverMutualTls) {
  ServerProcess router(KVTIER_ROUTER_BIN, dir_.sub("router"), [&] {
    std::vector<std::string> a = pki_.ServerFlags(true);
    a.push_back("--listen=127.0.0.1:0");
    a.push_back("--heartbeat-deadline=2s");
    return a;
  }());
  ASSERT_GT(router.port(), 0) << router.Log();
  // Each source presents a certificate naming its id (the router binds them).
  std::vector<std::string> store_flags = pki_.ServerFlags(true, "tls-store");
  store_flags.push_back("--router=" + router.address());
  store_flags.push_back("--store-id=tls-store");
  store_flags.push_back("--data-listen=127.0.0.1:0");
  setenv("UCX_TLS", "tcp", 1);
  ServerProcess store = Store(store_flags);
  ASSERT_GT(store.port(), 0) << store.Log();
  std::vector<std::string> worker_flags = pki_.ServerFlags(true, "tls-worker");
  for (std::string a : {std::string("--listen=127.0.0.1:0"), "--store=" + store.address(),
                        "--router=" + router.address(), std::string("--worker-id=tls-worker"),
                        std::string("--pages=64"), std::string("--offload=write-through"),
                        std::string("--heartbeat=100ms")}) {
    worker_flags.push_back(a);
  }
  ServerProcess worker(KVTIER_SIM_WORKER_BIN, dir_.sub("worker"), worker_flags);
  ASSERT_GT(worker.port(), 0) << worker.Log();

  // A request to the worker, over mTLS: its blocks reach the store.
  ChannelSecurity frontend = pki_.Client("ca", "admin");
  auto wstub = v1::SimWorker::NewStub(OpenChannel(worker.address(), frontend));
  v1::SubmitRequest req;
  for (int i = 0; i < 100; ++i) req.mutable_tokens()->add_ids(i);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::SubmitResponse resp;
  grpc::Status st = wstub->Submit(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << worker.Log();
  StoreClient sc = Client(store, frontend);
  EXPECT_TRUE(WaitFor(
      [&] {
        auto s = sc.GetStats();
        return s.ok() && s->tiers(0).items() == 6;  // 100 tokens of 16: 6 full blocks
      },
      std::chrono::seconds(10)))
      << store.Log() << worker.Log();

  // The router hears both sources over mTLS and routes the prompt to the worker.
  auto rstub = v1::Router::NewStub(OpenChannel(router.address(), frontend));
  EXPECT_TRUE(WaitFor(
      [&] {
        grpc::ClientContext c;
        v1::ListWorkersResponse r;
        if (!rstub->ListWorkers(&c, {}, &r).ok()) return false;
        int connected = 0;
        for (const auto& s : r.sources()) connected += s.connected() ? 1 : 0;
        return connected == 2;
      },
      std::chrono::seconds(10)))
      << router.Log();
  // A plaintext client of the same router is refused.
  auto plain = v1::Router::NewStub(OpenChannel(router.address(), {}));
  grpc::ClientContext pc;
  pc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::ListWorkersResponse pr;
  EXPECT_EQ(plain->ListWorkers(&pc, {}, &pr).error_code(), grpc::UNAVAILABLE);

  // With TLS set up before serving, SIGTERM still reaches the shutdown path
  // of each (gRPC's threads must not take the signal).
  for (ServerProcess* p : {&worker, &store, &router}) {
    int status = p->proc().Kill(SIGTERM);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n"
                                                               << p->Log();
  }
}

// Under mutual TLS leases count against the certificate's identity: two
// connections presenting the same certificate share one limit, whatever
// client_id they send; another identity is unaffected.
TEST_F(Tls, LeasesCountAgainstTheCertificateIdentity) {
  std::vector<std::string> flags = pki_.ServerFlags(/*mutual=*/true);
  flags.push_back("--max-leases-per-client=2");
  ServerProcess store = Store(flags);
  ASSERT_GT(store.port(), 0) << store.Log();
  StoreClient setup = Client(store, pki_.Client("ca", "admin"));
  auto ns = setup.RegisterNamespace(NamespaceSpec{"m", "fp16", 2, 2, 64, 16, 0, 1, "", "", ""});
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto connect = [&](const std::string& leaf) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    ChannelSecurity sec = pki_.Client("ca", leaf);
    return v1::Store::NewStub(grpc::CreateCustomChannel(store.address(), sec.credentials, args));
  };
  auto one = connect("worker"), two = connect("worker"), other = connect("admin");
  int n = 0;
  auto begin = [&](v1::Store::Stub* stub, std::string* error = nullptr) {
    v1::BeginPutRequest req;
    req.set_namespace_id(ns->id);
    req.set_client_id("id-" + std::to_string(n));
    auto* h = req.add_hashes();
    h->set_hi(1000 + n);
    h->set_lo(++n);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::BeginPutResponse resp;
    grpc::Status s = stub->BeginPut(&ctx, req, &resp);
    if (error != nullptr) *error = s.error_message();
    return s.error_code();
  };
  EXPECT_EQ(begin(one.get()), grpc::OK);
  EXPECT_EQ(begin(two.get()), grpc::OK);
  std::string error;
  EXPECT_EQ(begin(one.get(), &error), grpc::RESOURCE_EXHAUSTED);
  EXPECT_NE(error.find("identity worker"), std::string::npos) << error;
  EXPECT_EQ(begin(two.get()), grpc::RESOURCE_EXHAUSTED);
  EXPECT_EQ(begin(other.get()), grpc::OK);
}

// With tenants under mutual TLS a certificate's name is the tenant: two
// tenants' clients store the same block apart, neither finds the other's,
// and a certificate no tenant names is refused.
TEST_F(Tls, CertificateNamesSelectTheTenant) {
  {
    std::ofstream f(dir_.sub("tenants"));
    f << "secret tls-test\n"
      << "tenant team-a ram=2MiB identities=worker-a\n"
      << "tenant team-b ram=2MiB identities=worker-b\n";
    std::ofstream a(dir_.sub("admin-token"));
    a << "admin-secret\n";
  }
  std::vector<std::string> flags = pki_.ServerFlags(/*mutual=*/true);
  flags.insert(flags.end(), {"--ram-bytes=8MiB", "--ram-slab-bytes=1MiB",
                             "--tenants-file=" + dir_.sub("tenants"),
                             "--admin-token-file=" + dir_.sub("admin-token")});
  ServerProcess store = Store(flags);
  ASSERT_GT(store.port(), 0) << store.Log();
  StoreClient a = Client(store, pki_.Client("ca", "worker-a"));
  StoreClient b = Client(store, pki_.Client("ca", "worker-b"));
  StoreClient nobody = Client(store, pki_.Client("ca", "admin"));
  const NamespaceSpec spec{"m", "fp16", 2, 2, 64, 16, 0, 1, "", "", ""};
  auto na = a.RegisterNamespace(spec);
  auto nb = b.RegisterNamespace(spec);
  ASSERT_TRUE(na.ok()) << na.status();
  ASSERT_TRUE(nb.ok()) << nb.status();
  EXPECT_EQ(na->id, nb->id);  // each names it by its own spec
  const BlockHash h{42, 43};
  std::string bytes_a = testing::BlockBytesFor(1, na->block_bytes);
  auto put = a.PutInline(na->id, {{h, bytes_a}});
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, 1u);
  auto got_a = a.GetInline(na->id, {h});
  ASSERT_TRUE(got_a.ok()) << got_a.status();
  ASSERT_EQ(got_a->size(), 1u);
  EXPECT_EQ((*got_a)[0].data, bytes_a);
  EXPECT_EQ(b.Lookup(nb->id, {h})->size(), 0u);
  EXPECT_EQ(b.GetInline(nb->id, {h})->size(), 0u);
  auto refused = nobody.Lookup(na->id, {h});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
}

// A worker's hello and one block, published over `channel` as `id`.
grpc::Status PublishAs(const std::shared_ptr<grpc::Channel>& channel, const std::string& id,
                       uint64_t epoch, const std::string& endpoint, v1::SourceKind kind,
                       std::string* error = nullptr) {
  auto stub = v1::Router::NewStub(channel);
  v1::PublishRequest req;
  auto* h = req.add_messages()->mutable_hello();
  h->set_source_id(id);
  h->set_kind(kind);
  h->set_endpoint(endpoint);
  h->set_namespace_id(kind == v1::SOURCE_WORKER ? 7 : 0);
  h->set_block_tokens(kind == v1::SOURCE_WORKER ? 16 : 0);
  h->set_epoch(epoch);
  req.add_messages()->mutable_snapshot()->set_last(true);  // holds nothing yet: no resync
  auto* ev = req.add_messages()->mutable_event();
  ev->set_seq(1);
  ev->mutable_stored()->set_namespace_id(7);
  auto* bh = ev->mutable_stored()->add_hashes();
  bh->set_hi(1);
  bh->set_lo(2);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::PublishResponse resp;
  grpc::Status s = stub->Publish(&ctx, req, &resp);
  if (error != nullptr) *error = s.error_message();
  return s;
}

// What the router knows of `id`: "endpoint epoch", or "" when it does not.
std::string Known(const std::shared_ptr<grpc::Channel>& channel, const std::string& id) {
  auto stub = v1::Router::NewStub(channel);
  grpc::ClientContext ctx;
  v1::ListWorkersResponse r;
  if (!stub->ListWorkers(&ctx, {}, &r).ok()) return "unreachable";
  for (const auto& s : r.sources()) {
    if (s.source_id() == id) return s.endpoint() + " " + std::to_string(s.epoch());
  }
  return "";
}

// Mutual TLS binds a hello to its certificate: another source's id is
// refused, naming both, and neither the index nor the source list changes;
// a stream is refused the same way; the owner keeps publishing and routes
// keep going to its endpoint.
TEST_F(Tls, AForgedHelloIsRefusedAndChangesNothing) {
  ServerProcess router(KVTIER_ROUTER_BIN, dir_.sub("router"), [&] {
    std::vector<std::string> a = pki_.ServerFlags(true);
    a.push_back("--listen=127.0.0.1:0");
    return a;
  }());
  ASSERT_GT(router.port(), 0) << router.Log();
  EXPECT_NE(router.Log().find("bound to their client certificates"), std::string::npos)
      << router.Log();
  auto as_a = OpenChannel(router.address(), pki_.Client("ca", "worker-a"));
  auto as_b = OpenChannel(router.address(), pki_.Client("ca", "worker-b"));
  ASSERT_TRUE(PublishAs(as_a, "worker-a", 1, "10.0.0.1:8000", v1::SOURCE_WORKER).ok());
  ASSERT_EQ(Known(as_a, "worker-a"), "10.0.0.1:8000 1");

  std::string error;
  grpc::Status forged = PublishAs(as_b, "worker-a", 2, "10.6.6.6:8000", v1::SOURCE_WORKER, &error);
  EXPECT_EQ(forged.error_code(), grpc::PERMISSION_DENIED) << error;
  EXPECT_NE(error.find("\"worker-a\""), std::string::npos) << error;
  EXPECT_NE(error.find("\"worker-b\""), std::string::npos) << error;
  // Over a stream too.
  {
    auto stub = v1::Router::NewStub(as_b);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto stream = stub->StreamEvents(&ctx);
    v1::SourceMessage m;
    m.mutable_hello()->set_source_id("worker-a");
    m.mutable_hello()->set_kind(v1::SOURCE_WORKER);
    m.mutable_hello()->set_endpoint("10.6.6.6:8000");
    m.mutable_hello()->set_namespace_id(7);
    m.mutable_hello()->set_block_tokens(16);
    m.mutable_hello()->set_epoch(3);
    stream->Write(m);
    stream->WritesDone();
    v1::RouterCommand c;
    while (stream->Read(&c)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::PERMISSION_DENIED);
  }
  // Nothing changed: same endpoint and epoch, the block still routes to a.
  EXPECT_EQ(Known(as_a, "worker-a"), "10.0.0.1:8000 1");
  auto stub = v1::Router::NewStub(as_a);
  v1::RouteRequest rr;
  rr.set_namespace_id(7);
  auto* bh = rr.mutable_hashes()->add_hashes();
  bh->set_hi(1);
  bh->set_lo(2);
  bh = rr.mutable_hashes()->add_hashes();  // a block nobody holds: the first one is a hit
  bh->set_hi(3);
  bh->set_lo(4);
  grpc::ClientContext rc;
  v1::RouteResponse route;
  ASSERT_TRUE(stub->Route(&rc, rr, &route).ok());
  EXPECT_EQ(route.endpoint(), "10.0.0.1:8000");
  EXPECT_EQ(route.gpu_hit_blocks(), 1u);
  // b may be b, and a may go on publishing.
  EXPECT_TRUE(PublishAs(as_b, "worker-b", 1, "10.0.0.2:8000", v1::SOURCE_WORKER).ok());
  EXPECT_TRUE(PublishAs(as_a, "worker-a", 1, "10.0.0.1:8000", v1::SOURCE_WORKER).ok());
  EXPECT_NE(router.Log().find("refused a hello"), std::string::npos) << router.Log();
}

// --source-identities: listed certificates claim the ids (and the kind) the
// file gives them, prefixes included; a certificate not listed publishes
// nothing; the file needs mutual TLS and a well-formed line.
TEST_F(Tls, SourceIdentitiesDecideWhoMayClaimWhichSource) {
  std::ofstream(dir_.sub("identities")) << "# identity kind ids\n"
                                        << "worker-b worker worker-b pool-*\n"
                                        << "tls-store store\n";
  ServerProcess router(KVTIER_ROUTER_BIN, dir_.sub("router"), [&] {
    std::vector<std::string> a = pki_.ServerFlags(true);
    a.push_back("--listen=127.0.0.1:0");
    a.push_back("--source-identities=" + dir_.sub("identities"));
    return a;
  }());
  ASSERT_GT(router.port(), 0) << router.Log();
  auto as_a = OpenChannel(router.address(), pki_.Client("ca", "worker-a"));
  auto as_b = OpenChannel(router.address(), pki_.Client("ca", "worker-b"));
  auto as_store = OpenChannel(router.address(), pki_.Client("ca", "tls-store"));
  std::string error;
  EXPECT_TRUE(PublishAs(as_b, "pool-3", 1, "10.0.0.3:8000", v1::SOURCE_WORKER).ok());
  EXPECT_TRUE(PublishAs(as_b, "worker-b", 1, "10.0.0.2:8000", v1::SOURCE_WORKER).ok());
  EXPECT_EQ(PublishAs(as_b, "worker-a", 1, "10.0.0.2:8000", v1::SOURCE_WORKER, &error).error_code(),
            grpc::PERMISSION_DENIED);
  EXPECT_NE(error.find("claim no such worker"), std::string::npos) << error;
  // Listed as a worker, not as a store.
  EXPECT_EQ(PublishAs(as_b, "pool-4", 1, "", v1::SOURCE_STORE, &error).error_code(),
            grpc::PERMISSION_DENIED);
  EXPECT_TRUE(PublishAs(as_store, "tls-store", 1, "", v1::SOURCE_STORE).ok());
  // worker-a's certificate is not in the file: not even its own id.
  EXPECT_EQ(PublishAs(as_a, "worker-a", 1, "10.0.0.1:8000", v1::SOURCE_WORKER, &error).error_code(),
            grpc::PERMISSION_DENIED);
  EXPECT_NE(error.find("none of which --source-identities lists"), std::string::npos) << error;
  EXPECT_EQ(Known(as_b, "worker-a"), "");
  EXPECT_EQ(Known(as_b, "pool-3"), "10.0.0.3:8000 1");

  // Refused at start: without mutual TLS, and a bad line.
  std::ofstream(dir_.sub("bad-identities")) << "worker-b robot\n";
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--source-identities " + dir_.sub("identities"), "needs mutual TLS"},
           {"--tls-cert " + pki_.pem("server") + " --tls-key " + pki_.key("server") + " --tls-ca " +
                pki_.pem("ca") + " --tls-require-client-cert --source-identities " +
                dir_.sub("bad-identities"),
            "line 1: kind \"robot\""}}) {
    ShellResult r = RunShell(std::string(KVTIER_ROUTER_BIN) + " --check-config " + args + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find(expect), std::string::npos) << r.out;
  }
}

// 64 KiB blocks: 2 x 1 layer x 1 head x 128 dim x 2 bytes x 128 tokens.
constexpr uint64_t kTlsBlock = 64 << 10;
const NamespaceSpec kTlsSpec{"tls-model", "bf16", 1, 1, 128, 128, 0, 1, "", "", ""};

// A data client of `store` trusting `ca`, over its socket data plane (no
// shared memory: the bytes cross the socket).
DataClientOptions SocketClientOptions(const Pki& pki) {
  DataClientOptions o;
  o.security = pki.Client("ca");
  o.shared_memory = DataClientOptions::SharedMemory::kOff;
  return o;
}

// Puts `block` as `hash` and reads it back: both must succeed, byte-exact.
void RoundTrip(StoreDataClient& c, uint64_t ns, BlockHash hash, const std::string& block) {
  auto put = c.Put(ns, kTlsBlock, {{hash, block.data()}}).get();
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->written, 1u);
  std::string back(kTlsBlock, '\0');
  auto got = c.Get(ns, kTlsBlock, {{hash, back.data()}}).get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->blocks, 1u);
  EXPECT_TRUE(back == block);
}

// --data-tls: the socket data plane speaks TLS 1.3 from its first byte.
// Through a tap that keeps every byte it forwards (an eavesdropper on the
// link), a put and a get move a block whole and the link carries none of
// its bytes. The same through a plaintext data plane carries them in the
// clear, so the tap would have seen them.
TEST_F(Tls, OnATlsDataPlaneAnEavesdropperReadsNoBlock) {
  const std::string secret = "kvtier-secret-block-bytes@";
  std::string block;
  while (block.size() < kTlsBlock) block += secret + std::to_string(block.size()) + ";";
  block.resize(kTlsBlock);
  for (bool tls : {false, true}) {
    SCOPED_TRACE(tls ? "--data-tls" : "plaintext data plane");
    const std::string name = tls ? "tls" : "plain";
    const int data_port = testing::FreePort();
    testing::FaultProxy tap(data_port);
    std::vector<std::string> args = pki_.ServerFlags(/*mutual=*/false);
    args.insert(args.end(), {"--listen=127.0.0.1:0", "--data-dir=" + dir_.sub("db-" + name),
                             "--hugepages=false", "--ram-bytes=4MiB", "--local-shm=false",
                             "--data-listen=127.0.0.1:" + std::to_string(data_port),
                             "--data-advertise=" + tap.address()});
    if (tls) args.push_back("--data-tls");
    ServerProcess store(KVTIER_STORE_BIN, dir_.sub("store-" + name), args);
    ASSERT_GT(store.port(), 0) << store.Log();
    EXPECT_EQ(store.Log().find(absl::StrCat("data plane on 127.0.0.1:", data_port, " (TLS)")) !=
                  std::string::npos,
              tls)
        << store.Log();

    StoreDataClient c(store.address(), SocketClientOptions(pki_));
    auto ns = c.control().RegisterNamespace(kTlsSpec);
    ASSERT_TRUE(ns.ok()) << ns.status();
    RoundTrip(c, ns->id, BlockHash{7, 9}, block);
    if (HasFatalFailure()) return;

    const std::string seen = tap.Seen();
    EXPECT_GT(seen.size(), 2 * kTlsBlock);  // both transfers crossed the tap
    EXPECT_EQ(seen.find(secret) != std::string::npos, !tls) << seen.size() << " bytes seen";
  }
}

// A peer that does not speak TLS to a --data-tls data plane is closed and
// counted; a client whose security has no data-plane trust is told what it
// lacks; and the store serves TLS clients on.
TEST_F(Tls, APlaintextPeerOnATlsDataPlaneIsClosedAndTheStoreServesOn) {
  const int data_port = testing::FreePort();
  const int metrics_port = testing::FreePort();
  std::vector<std::string> args = pki_.ServerFlags(/*mutual=*/false);
  args.insert(args.end(),
              {"--data-listen=127.0.0.1:" + std::to_string(data_port), "--data-tls",
               "--local-shm=false", "--metrics-listen=127.0.0.1:" + std::to_string(metrics_port)});
  ServerProcess store = Store(args);
  ASSERT_GT(store.port(), 0) << store.Log();

  // A plaintext hello frame where a TLS ClientHello belongs.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(data_port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  const std::string frame(56, 'x');
  ASSERT_EQ(send(fd, frame.data(), frame.size(), MSG_NOSIGNAL), 56);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  ssize_t n;
  std::string answer;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, static_cast<size_t>(n));
  close(fd);
  EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << "not closed: " << std::strerror(errno);
  EXPECT_EQ(answer.find("challenge"), std::string::npos);  // no plaintext protocol answered
  const auto handshakes_failed = [&] {
    const std::string m = testing::HttpGet(metrics_port, "/metrics");
    const std::string key = "kvtier_store_dataplane_closed_total{reason=\"tls_handshake\"} ";
    const size_t at = m.find(key);
    return at == std::string::npos ? -1.0 : std::stod(m.substr(at + key.size()));
  };
  ASSERT_TRUE(WaitFor([&] { return handshakes_failed() == 1; }, std::chrono::seconds(5)))
      << testing::HttpGet(metrics_port, "/metrics");
  EXPECT_NE(store.Log().find("failed its TLS handshake"), std::string::npos) << store.Log();

  // Trust for the control plane but none for the data plane: said so.
  DataClientOptions untrusting = SocketClientOptions(pki_);
  untrusting.security.data_plane.reset();
  StoreDataClient u(store.address(), untrusting);
  auto ns = u.control().RegisterNamespace(kTlsSpec);
  ASSERT_TRUE(ns.ok()) << ns.status();
  std::string block(kTlsBlock, 'b');
  auto refused = u.Put(ns->id, kTlsBlock, {{BlockHash{1, 1}, block.data()}}).get();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("--tls-ca"), std::string::npos) << refused.status();

  StoreDataClient c(store.address(), SocketClientOptions(pki_));
  RoundTrip(c, ns->id, BlockHash{1, 1}, block);
}

// TlsStream::Send over a socket that blocks every few KiB, with the bytes
// offered growing between calls (as a channel posts more operations while
// a write is blocked) and pieces of every size: the peer reads every byte,
// once, in order, and every call's count is what it sent.
TEST_F(Tls, ATlsStreamDeliversEveryByteInOrderThroughBlockedWrites) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
  const int small = 4096;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  auto server_ctx = net::TlsContext::Server(pki_.pem("server"), pki_.key("server"));
  auto client_ctx = net::TlsContext::Client(pki_.pem("ca"));
  ASSERT_TRUE(server_ctx.ok()) << server_ctx.status();
  ASSERT_TRUE(client_ctx.ok()) << client_ctx.status();
  auto sender = net::TlsStream::Connect(**client_ctx, sv[0], "127.0.0.1");
  auto receiver = net::TlsStream::Accept(**server_ctx, sv[1]);
  bool sent_done = false, received_done = false;
  for (int i = 0; i < 1000 && !(sent_done && received_done); ++i) {
    if (!sent_done) {
      auto st = sender->Handshake();
      ASSERT_NE(st, net::TlsStream::Step::kFailed) << sender->error();
      sent_done = st == net::TlsStream::Step::kDone;
    }
    if (!received_done) {
      auto st = receiver->Handshake();
      ASSERT_NE(st, net::TlsStream::Step::kFailed) << receiver->error();
      received_done = st == net::TlsStream::Step::kDone;
    }
  }
  ASSERT_TRUE(sent_done && received_done);

  // Pieces of 1 B to 100 KiB, each byte numbered by its place in the stream.
  std::vector<std::string> pieces;
  std::string all;
  for (size_t i = 0; all.size() < (2u << 20); ++i) {
    const size_t n = std::vector<size_t>{40, 1, 16384, 100000, 7, 16383, 16385, 3000}[i % 8];
    std::string p(n, '\0');
    for (size_t j = 0; j < n; ++j) p[j] = static_cast<char>((all.size() + j) * 131 % 251);
    all += p;
    pieces.push_back(std::move(p));
  }
  std::string got;
  size_t piece = 0, at = 0, offered = 1, blocked = 0;
  char buf[1 << 16];
  while (got.size() < all.size()) {
    if (piece < pieces.size()) {
      // More pieces are offered each round, whether or not a write blocked.
      offered = std::min(pieces.size(), offered + 2);
      std::vector<iovec> iov;
      iov.push_back({const_cast<char*>(pieces[piece].data()) + at, pieces[piece].size() - at});
      for (size_t j = piece + 1; j < offered; ++j) {
        iov.push_back({const_cast<char*>(pieces[j].data()), pieces[j].size()});
      }
      const ssize_t w = sender->Send(iov.data(), iov.size());
      if (w < 0) {
        ASSERT_EQ(errno, EAGAIN) << sender->error();
        blocked++;
      }
      for (size_t left = w > 0 ? static_cast<size_t>(w) : 0; left > 0;) {
        const size_t take = std::min(left, pieces[piece].size() - at);
        at += take;
        left -= take;
        if (at == pieces[piece].size()) {
          piece++;
          at = 0;
        }
      }
      // Nothing reaches the peer that a call has not counted.
      size_t counted = at;
      for (size_t j = 0; j < piece; ++j) counted += pieces[j].size();
      ASSERT_LE(got.size(), counted);
    }
    for (;;) {
      const ssize_t r = receiver->Recv(buf, sizeof(buf));
      if (r <= 0) {
        ASSERT_TRUE(r < 0 && errno == EAGAIN) << r << " " << receiver->error();
        break;
      }
      got.append(buf, static_cast<size_t>(r));
    }
  }
  EXPECT_GT(blocked, 10u);  // the socket did block, many times
  EXPECT_TRUE(got == all) << got.size() << " of " << all.size();
  sender.reset();
  receiver.reset();
  close(sv[0]);
  close(sv[1]);
}

TEST_F(Tls, BadTlsFlagsAreRefusedNamingTheFlag) {
  std::ofstream(dir_.sub("not-pem")) << "hello\n";
  struct Case {
    std::string binary, args, expect;
  };
  std::string cert = pki_.pem("server"), key = pki_.key("server"), ca = pki_.pem("ca");
  std::vector<Case> cases = {
      {KVTIER_STORE_BIN, "--check-config --tls-cert " + cert, "--tls-key"},
      {KVTIER_STORE_BIN,
       "--check-config --tls-cert " + cert + " --tls-key " + key + " --tls-require-client-cert",
       "--tls-ca"},
      {KVTIER_STORE_BIN, "--check-config --tls-ca /nonexistent/ca.pem",
       "cannot read \"/nonexistent/ca.pem\""},
      {KVTIER_STORE_BIN, "--check-config --tls-ca " + dir_.sub("not-pem"), "not a PEM file"},
      {KVTIER_STORE_BIN,
       "--check-config --tls-cert " + cert + " --tls-key " + key + " --admin-identity x",
       "--tls-require-client-cert"},
      {KVTIER_STORE_BIN, "--check-config --data-listen 127.0.0.1:0 --data-tls",
       "--data-tls needs --tls-cert"},
      {KVTIER_ROUTER_BIN, "--check-config --tls-key " + key, "--tls-cert"},
      // Refused before it serves.
      {KVTIER_SIM_WORKER_BIN, "--listen 127.0.0.1:0 --tls-server-name x", "--tls-ca"},
      {KVTIER_KVCTL_BIN, "stats --tls-ca /nonexistent/ca.pem", "/nonexistent/ca.pem"},
  };
  for (const Case& c : cases) {
    ShellResult r = RunShell(c.binary + " " + c.args + " 2>&1 </dev/null");
    EXPECT_EQ(r.exit_code, 2) << c.binary << " " << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
  // A good set passes --check-config and says TLS is on.
  ShellResult good =
      RunShell(std::string(KVTIER_STORE_BIN) + " --check-config --tls-cert " + cert +
               " --tls-key " + key + " --tls-ca " + ca + " --tls-require-client-cert 2>&1");
  EXPECT_EQ(good.exit_code, 0) << good.out;
  EXPECT_NE(good.out.find("tls=mutual"), std::string::npos) << good.out;
}

}  // namespace
}  // namespace kvtier
