// kvtier-store: the cache service. See --help.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cachestore/router_sink.h"
#include "cachestore/service.h"
#include "cachestore/store.h"
#include "cachestore/store_flags.h"
#include "common/config.h"
#include "common/file_limit.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/metrics.h"
#include "common/rpc/tls.h"
#include "common/tls_stream.h"

int main(int argc, char** argv) {
  // First, before gRPC (TLS credentials, channels) starts any thread.
  kvtier::BlockShutdownSignals();
  kvtier::PrepareGrpcProcess();
  kvtier::RaiseFileLimit();  // a descriptor per client connection
  const kvtier::store::StoreFlags f = kvtier::store::ParseStoreFlags(argc, argv);
  std::vector<std::string> routers;
  for (absl::string_view r : absl::StrSplit(f.routers, ',', absl::SkipEmpty())) {
    if (auto s = kvtier::ValidateHostPort(std::string(r)); !s.ok()) {
      std::fprintf(stderr, "kvtier-store: flag --router: %s\n", std::string(s.message()).c_str());
      return 2;
    }
    routers.emplace_back(r);
  }

  if (f.ram_bytes == 0) {
    std::fprintf(stderr, "kvtier-store: flag --ram-bytes must be above 0\n");
    return 2;
  }
  if (f.disk_sync == "group" &&
      (f.disk_sync_interval_ms == 0 ||
       f.disk_sync_interval_ms > kvtier::limits::kDiskSyncIntervalMaxMs)) {
    std::fprintf(stderr,
                 "kvtier-store: flag --disk-sync-interval must be 1ms to 10s with "
                 "--disk-sync=group (got %lu ms)\n",
                 static_cast<unsigned long>(f.disk_sync_interval_ms));
    return 2;
  }
  if (f.data_max_buffered == 0) {
    std::fprintf(stderr, "kvtier-store: flag --data-max-buffered must be above 0\n");
    return 2;
  }
  if (f.disk_bytes == 0) {
    std::fprintf(stderr, "kvtier-store: flag --disk-bytes must be above 0\n");
    return 2;
  }
  if (f.slab_bytes % 4096 != 0 || f.slab_bytes > f.ram_bytes) {
    std::fprintf(stderr,
                 "kvtier-store: flag --ram-slab-bytes must be a multiple of 4096 and at most "
                 "--ram-bytes\n");
    return 2;
  }
  if (f.max_message_bytes > (1ull << 31) - 1) {
    std::fprintf(stderr, "kvtier-store: flag --max-message-bytes must be below 2GiB\n");
    return 2;
  }

  if (!f.metrics_listen.empty()) {
    if (auto s = kvtier::ValidateHostPort(f.metrics_listen); !s.ok()) {
      std::fprintf(stderr, "kvtier-store: flag --metrics-listen: %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
  }
  if (f.data_hello_timeout_ms == 0 || f.data_idle_timeout_ms == 0) {
    std::fprintf(stderr,
                 "kvtier-store: flags --data-hello-timeout and --data-idle-timeout "
                 "must be positive\n");
    return 2;
  }
  if (!f.data_listen.empty()) {
    if (auto s = kvtier::ValidateHostPort(f.data_listen); !s.ok()) {
      std::fprintf(stderr, "kvtier-store: flag --data-listen: %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
  }
  if (!f.data_advertise.empty()) {
    if (auto s = kvtier::ValidateHostPort(f.data_advertise); !s.ok()) {
      std::fprintf(stderr, "kvtier-store: flag --data-advertise: %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
  }
  if (f.data_tls && (f.tls.cert_file.empty() || f.data_plane != "socket")) {
    std::fprintf(stderr,
                 "kvtier-store: flag --data-tls needs --tls-cert and --tls-key (the certificate "
                 "the data plane serves with) and --data-plane socket\n");
    return 2;
  }
  std::shared_ptr<kvtier::net::TlsContext> data_tls;
  if (f.data_tls) {
    auto ctx = kvtier::net::TlsContext::Server(f.tls.cert_file, f.tls.key_file);
    if (!ctx.ok()) {
      std::fprintf(stderr, "kvtier-store: flag --data-tls: %s\n",
                   std::string(ctx.status().message()).c_str());
      return 2;
    }
    data_tls = std::move(*ctx);
  }
  // Built before --check-config returns, so it checks the TLS files too.
  auto router_security = kvtier::ClientSecurity(f.tls);
  auto server_credentials = kvtier::ServerCredentials(f.tls);
  for (const absl::Status& s : {router_security.status(), server_credentials.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "kvtier-store: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  if (!f.admin_identity.empty() && !f.tls.require_client_cert) {
    std::fprintf(stderr,
                 "kvtier-store: flag --admin-identity needs --tls-require-client-cert (only a "
                 "verified client certificate carries an identity)\n");
    return 2;
  }
  std::shared_ptr<const kvtier::store::Tenants> tenants;
  if (!f.tenants_file.empty()) {
    auto t = kvtier::store::Tenants::Load(f.tenants_file);
    if (!t.ok()) {
      std::fprintf(stderr, "kvtier-store: flag --tenants-file: %s\n",
                   std::string(t.status().message()).c_str());
      return 2;
    }
    tenants = *t;
    if (f.data_plane == "ucx" && !f.data_listen.empty()) {
      std::fprintf(stderr,
                   "kvtier-store: flag --data-plane ucx is refused with --tenants-file: over "
                   "UCX's TCP and shared-memory transports any client can address every "
                   "tenant's blocks; use --data-plane socket (docs/security.md)\n");
      return 2;
    }
    if (f.admin_token_file.empty() && f.admin_identity.empty()) {
      std::fprintf(stderr,
                   "kvtier-store: flag --tenants-file needs --admin-token-file or "
                   "--admin-identity: with tenants, only an operator may evict, set policy or "
                   "list every namespace\n");
      return 2;
    }
    for (const auto& t : tenants->all()) {
      if (t.ram_bytes < f.slab_bytes) {
        std::fprintf(stderr,
                     "kvtier-store: flag --tenants-file: tenant %s's ram=%lu holds no whole RAM "
                     "slab (--ram-slab-bytes %lu)\n",
                     t.name.c_str(), static_cast<unsigned long>(t.ram_bytes),
                     static_cast<unsigned long>(f.slab_bytes));
        return 2;
      }
    }
    uint64_t nvme = 0;
    for (const auto& t : tenants->all()) nvme += t.nvme_bytes;
    if (nvme > f.disk_bytes) {
      std::fprintf(stderr,
                   "kvtier-store: flag --tenants-file: the tenants' nvme= quotas add up to %lu "
                   "bytes; --disk-bytes is %lu (each tenant's NVMe share must be there)\n",
                   static_cast<unsigned long>(nvme), static_cast<unsigned long>(f.disk_bytes));
      return 2;
    }
    if (tenants->ram_bytes() > f.ram_bytes) {
      std::fprintf(stderr,
                   "kvtier-store: flag --tenants-file: the tenants' RAM regions take %lu bytes; "
                   "--ram-bytes is %lu\n",
                   static_cast<unsigned long>(tenants->ram_bytes()),
                   static_cast<unsigned long>(f.ram_bytes));
      return 2;
    }
  }
  if (f.check_config) {
    std::printf(
        "kvtier-store configuration OK: listen=%s data-listen=%s metrics-listen=%s data-dir=%s "
        "ram-bytes=%lu disk-bytes=%lu ram-slab-bytes=%lu ram-policy=%s disk-policy=%s "
        "lease-ms=%lu routers=%zu tls=%s\n",
        f.listen.c_str(), f.data_listen.c_str(), f.metrics_listen.c_str(), f.data_dir.c_str(),
        f.ram_bytes, f.disk_bytes, f.slab_bytes, f.ram_policy.c_str(), f.disk_policy.c_str(),
        f.lease_ms, routers.size(),
        f.tls.cert_file.empty()     ? "off"
        : f.tls.require_client_cert ? "mutual"
                                    : "on");
    return 0;
  }

  // A file-size limit (ulimit -f) then fails the write with EFBIG, which the
  // disk tier handles, instead of killing the process.
  signal(SIGXFSZ, SIG_IGN);

  kvtier::store::StoreOptions o;
  o.ram.bytes = f.ram_bytes;
  o.ram.slab_bytes = f.slab_bytes;
  o.ram.policy = f.ram_policy;
  if (f.ram_policy == "lru") o.ram.policy_params["max_scan"] = static_cast<double>(f.lru_max_scan);
  o.ram.try_hugepages = f.hugepages;
  // With tenants the arena is never a memfd: a same-host process that could
  // open it would map every tenant's region.
  o.ram.shareable = f.local_shm && !tenants;
  o.ram.prefault = f.prefault;
  o.ram.shards = static_cast<int>(f.ram_shards);
  o.disk.dir = f.data_dir;
  o.disk.bytes = f.disk_bytes;
  o.disk.policy = f.disk_policy;
  if (f.disk_policy == "lru") {
    o.disk.policy_params["max_scan"] = static_cast<double>(f.lru_max_scan);
  }
  o.disk.queue_bytes = f.demote_queue_bytes;
  o.disk.reserve_bytes = f.disk_reserve_bytes;
  o.disk.admission = f.disk_admission;
  o.disk.sync = f.disk_sync == "commit"  ? kvtier::store::DiskSync::kCommit
                : f.disk_sync == "group" ? kvtier::store::DiskSync::kGroup
                                         : kvtier::store::DiskSync::kNone;
  o.disk.sync_interval_ms = f.disk_sync_interval_ms;
  o.lease_ms = f.lease_ms;
  o.verify_commits = f.verify_commits;
  o.max_leases_per_client = static_cast<uint64_t>(f.max_leases_per_client);
  o.max_namespaces = static_cast<uint64_t>(f.max_namespaces);
  o.tenants = tenants;
  std::string admin_token;
  if (!f.admin_token_file.empty()) {
    std::ifstream in(f.admin_token_file);
    std::getline(in, admin_token);
    if (!in && admin_token.empty()) {
      std::fprintf(stderr, "kvtier-store: flag --admin-token-file: cannot read \"%s\"\n",
                   f.admin_token_file.c_str());
      return 2;
    }
    if (admin_token.empty()) {
      std::fprintf(stderr, "kvtier-store: flag --admin-token-file: \"%s\" is empty\n",
                   f.admin_token_file.c_str());
      return 2;
    }
  }
  // Declared before the store, so destroyed after it: the store's change
  // feed delivers into the sink until the store is gone.
  std::unique_ptr<kvtier::store::RouterSink> router_sink;
  if (!routers.empty()) {
    std::string advertise = f.advertise_address;
    if (advertise.empty() && !absl::EndsWith(f.listen, ":0") &&
        !absl::StartsWith(f.listen, "0.0.0.0:") && !absl::StartsWith(f.listen, "[::]:")) {
      advertise = f.listen;
    }
    router_sink = std::make_unique<kvtier::store::RouterSink>(
        routers, *router_security, f.store_id.empty() ? "kvtier-store@" + f.listen : f.store_id,
        advertise, /*heartbeat_ms=*/250, f.router_refresh_ms);
    o.changes = router_sink.get();
  }
  auto store = kvtier::store::Store::Open(o);
  if (!store.ok()) {
    std::fprintf(stderr, "kvtier-store: %s\n", std::string(store.status().message()).c_str());
    return 1;
  }
  // Heartbeats carry the shard's fetch figures while the store lives.
  if (router_sink) {
    router_sink->SetFetchFigures([s = store->get()] { return s->FetchFigures(); });
  }
  absl::Cleanup unset_figures = [&] {
    if (router_sink) router_sink->SetFetchFigures(nullptr);
  };

  std::unique_ptr<kvtier::store::DataPlaneServer> dataplane;
  std::unique_ptr<kvtier::store::SocketDataPlane> sockets;
  if (!f.data_listen.empty() && f.data_plane == "socket") {
    kvtier::store::SocketDataPlane::Options so;
    so.max_connections = static_cast<size_t>(f.data_max_connections);
    so.max_unhelloed = static_cast<size_t>(f.data_max_unhelloed);
    so.max_buffered_bytes = f.data_max_buffered;
    so.hello_timeout = std::chrono::milliseconds(f.data_hello_timeout_ms);
    so.idle_timeout = std::chrono::milliseconds(f.data_idle_timeout_ms);
    so.threads = static_cast<size_t>(f.data_threads);
    so.tls = data_tls;
    auto sp = kvtier::store::SocketDataPlane::Start(f.data_listen, so);
    if (!sp.ok()) {
      std::fprintf(stderr, "kvtier-store: socket data plane: %s\n",
                   std::string(sp.status().message()).c_str());
      return 1;
    }
    sockets = std::move(*sp);
  }
  if (!f.data_listen.empty() && f.data_plane == "ucx") {
    kvtier::Log("store",
                "WARNING: --data-plane ucx: clients move blocks by UCX RMA into the RAM "
                "arena, and over UCX's TCP and shared-memory transports nothing bounds what a "
                "client addresses (the whole process: other clients' blocks, the admin token); "
                "use it with trusted clients only (docs/security.md)");
    auto& arena = (*store)->ram().arena();
    // With tenants, each tenant's region is registered on its own.
    std::vector<std::pair<uint64_t, uint64_t>> regions;
    if (tenants) {
      for (const auto& r : (*store)->ram().pool_regions()) regions.emplace_back(r.offset, r.length);
    }
    auto dp =
        kvtier::store::DataPlaneServer::Start(f.data_listen, arena.base(), arena.size(), regions);
    if (!dp.ok()) {
      std::fprintf(stderr, "kvtier-store: UCX data plane: %s\n",
                   std::string(dp.status().message()).c_str());
      return 1;
    }
    dataplane = std::move(*dp);
  }
  kvtier::store::StoreService service(store->get(), dataplane.get(), sockets.get());
  if (f.local_shm && !tenants && (dataplane || sockets)) {
    kvtier::Log("store",
                "--local-shm: data-plane clients on this host running as this user map "
                "the whole RAM arena (one trusted tenant; off with --tenants-file or "
                "--local-shm=false)");
  }
  service.OfferSharedMemory(f.local_shm && !tenants);
  service.SetAdminToken(admin_token);
  service.SetAdminIdentity(f.admin_identity);
  service.SetClientConnectionLimit(static_cast<uint64_t>(f.data_max_connections_per_client));
  service.AdvertiseDataPlane(f.data_advertise);
  auto started = kvtier::StartGrpcServer(
      {"kvtier-store", f.listen, *server_credentials, {&service}, f.max_message_bytes});
  if (!started.ok()) {
    std::fprintf(stderr, "kvtier-store: %s\n", std::string(started.status().message()).c_str());
    return 1;
  }
  grpc::Server* server = started->server.get();
  std::unique_ptr<kvtier::MetricsServer> metrics;
  if (!f.metrics_listen.empty()) {
    auto ms = kvtier::MetricsServer::Start(f.metrics_listen,
                                           [&service] { return service.CollectMetrics(); });
    if (!ms.ok()) {
      std::fprintf(stderr, "kvtier-store: %s\n", std::string(ms.status().message()).c_str());
      return 1;
    }
    metrics = std::move(*ms);
    kvtier::Log("store", "metrics on ", f.metrics_listen, " (port ", metrics->port(), ")/metrics");
  }
  const std::string tls_mode =
      kvtier::TlsModeSuffix(!f.tls.cert_file.empty(), f.tls.require_client_cert);
  kvtier::Log(
      "store", "listening on ", started->address(),
      f.tls.cert_file.empty()     ? ""
      : f.tls.require_client_cert ? ", mutual TLS"
                                  : ", TLS",
      " (RAM ", (*store)->ram().arena().size(), " bytes in ", (*store)->ram().shards(), " shards",
      (*store)->ram().arena().hugepages() ? ", hugepages" : "", "; disk quota ", f.disk_bytes,
      " bytes in ", f.data_dir, ")",
      sockets ? absl::StrCat("; data plane on ", sockets->address(), sockets->tls() ? " (TLS)" : "")
              : "");
  kvtier::AnnounceListening(
      "kvtier-store", *started,
      tls_mode + (dataplane ? ", UCX on " + dataplane->address() : "") +
          (sockets ? (sockets->tls() ? ", data plane (TLS) on " : ", data plane on ") +
                         sockets->address()
                   : ""),
      f.port_file);

  // Health: "" and kvtier.v1.Store stay SERVING while the process serves;
  // "kvtier.v1.Store/disk" follows the NVMe tier (NOT_SERVING while degraded).
  std::atomic<bool> stop_health{false};
  std::thread health([&] {
    auto* hc = server->GetHealthCheckService();
    bool last = true;
    hc->SetServingStatus("kvtier.v1.Store/disk", true);
    while (!stop_health) {
      bool ok = !(*store)->disk().Snapshot().degraded;
      if (ok != last) {
        hc->SetServingStatus("kvtier.v1.Store/disk", ok);
        last = ok;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  kvtier::ServeUntilSignalled(server, "store");
  service.Quiesce();
  stop_health = true;
  health.join();
  metrics.reset();
  service.DetachDataPlane();  // no call may reach the service once the data plane goes
  dataplane.reset();
  sockets.reset();
  if (f.persist_on_stop_ms > 0) {  // no request reaches the store any more
    const auto started = std::chrono::steady_clock::now();
    auto p = (*store)->PersistRam(started + std::chrono::milliseconds(f.persist_on_stop_ms));
    kvtier::Log(
        "store",
        absl::StrCat("kept the RAM tier on NVMe for a restart: ", p.written, " blocks written, ",
                     p.already, " there already, ", p.left, " left (",
                     p.error.ok()
                         ? "--persist-on-stop=" + std::to_string(f.persist_on_stop_ms) + "ms"
                         : std::string(p.error.message()),
                     "), in ",
                     std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::steady_clock::now() - started)
                         .count(),
                     " ms"));
  }
  if (router_sink) router_sink->SetFetchFigures(nullptr);  // before the store goes
  store->reset();                                          // drains the write-back queue
  kvtier::Log("store", "stopped");
  return 0;
}
