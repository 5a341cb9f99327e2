// StoreService's Prometheus export: the families a scrape of
// --metrics-listen returns (docs/operations.md lists them).
#include <chrono>

#include "cachestore/service.h"
#include "common/version.h"

namespace kvtier::store {

using Clock = std::chrono::steady_clock;

std::vector<prometheus::MetricFamily> StoreService::CollectMetrics() {
  MetricsBuilder m;
  m.Gauge("kvtier_build_info", "1, labelled with this build's kvtier version", 1,
          {{"version", Version()}, {"component", "store"}});
  StoreStats s = store_->Stats();
  for (const auto& [tier, t] : {std::pair<const char*, const TierSnapshot&>{"ram", s.ram},
                                std::pair<const char*, const TierSnapshot&>{"disk", s.disk}}) {
    MetricsBuilder::Labels l = {{"tier", tier}};
    m.Gauge("kvtier_store_tier_capacity_bytes", "Configured capacity of the tier", t.capacity_bytes,
            l);
    m.Gauge("kvtier_store_tier_used_bytes", "Bytes held by the tier", t.used_bytes, l);
    m.Gauge("kvtier_store_tier_items", "Blocks held by the tier", t.items, l);
    m.Gauge("kvtier_store_tier_degraded", "1 when the tier cannot take writes", t.degraded, l);
    m.Counter("kvtier_store_tier_hits_total", "Block reads served by the tier", t.hits, l);
    m.Counter("kvtier_store_tier_misses_total", "Block reads the tier could not serve", t.misses,
              l);
    m.Counter("kvtier_store_tier_evictions_total", "Blocks evicted to make room", t.evictions, l);
    m.Counter("kvtier_store_tier_promotions_total", "Blocks copied in from a slower tier",
              t.promotions, l);
    m.Counter("kvtier_store_tier_demotions_total", "Blocks copied out to a slower tier",
              t.demotions, l);
    m.Counter("kvtier_store_tier_written_bytes_total", "Payload bytes written into the tier",
              t.bytes_in, l);
    m.Counter("kvtier_store_tier_read_bytes_total", "Payload bytes read from the tier", t.bytes_out,
              l);
  }
  m.Gauge("kvtier_store_demotion_queue_blocks", "Blocks waiting to be written to NVMe",
          s.queue.blocks);
  m.Gauge("kvtier_store_demotion_queue_bytes", "Bytes waiting to be written to NVMe",
          s.queue.bytes);
  m.Counter("kvtier_store_demotion_dropped_total", "Blocks not demoted because the queue was full",
            s.queue.dropped);
  m.Gauge("kvtier_store_leases", "Open leases", s.put_leases, {{"kind", "put"}});
  m.Gauge("kvtier_store_leases", "Open leases", s.get_leases, {{"kind", "get"}});
  m.Counter("kvtier_store_leases_expired_total", "Leases reclaimed at expiry", s.leases_expired);
  m.Counter("kvtier_store_checksum_failures_total", "Blocks refused for a checksum mismatch",
            s.checksum_failures);
  m.Counter("kvtier_store_disk_read_errors_total",
            "Reads of the NVMe tier that failed (I/O errors, not misses)", s.disk_read_errors);
  m.Counter("kvtier_store_dataplane_bytes_total", "Bytes reserved or pinned for the data plane",
            rma_put_bytes_.load(), {{"direction", "put"}});
  m.Counter("kvtier_store_dataplane_bytes_total", "Bytes reserved or pinned for the data plane",
            rma_get_bytes_.load(), {{"direction", "get"}});
  m.Gauge("kvtier_store_disk_index_entries_skipped",
          "NVMe index entries found at start that could not be decoded (their blocks are not "
          "served)",
          store_->disk().skipped_index_entries());
  m.Counter("kvtier_store_disk_syncs_total",
            "Group fsyncs of the NVMe tier's WAL (--disk-sync=group)", store_->disk().syncs());
  m.Counter("kvtier_store_disk_sync_failures_total",
            "Failed fsyncs of the NVMe tier's WAL: their blocks are not counted durable",
            store_->disk().sync_failures());
  m.Gauge("kvtier_store_dataplane_connections",
          "Open data-plane connections (socket connections or UCX endpoints)",
          (dataplane_ ? dataplane_->connections() : 0) + (sockets_ ? sockets_->connections() : 0));
  if (sockets_) {
    const SocketDataPlane::Stats d = sockets_->stats();
    const char* help =
        "Socket data-plane connections turned away or closed by a limit (docs/security.md)";
    for (const auto& [reason, n] :
         {std::pair{"connections", d.refused_full}, std::pair{"unhelloed", d.evicted_unhelloed},
          std::pair{"hello_timeout", d.hello_timeouts}, std::pair{"hello", d.hellos_refused},
          std::pair{"idle", d.idle_closed}, std::pair{"tls_handshake", d.tls_handshakes_failed}}) {
      m.Counter("kvtier_store_dataplane_closed_total", help, n, {{"reason", reason}});
    }
    m.Counter("kvtier_store_dataplane_calls_refused_total",
              "Socket data-plane calls answered RESOURCE_EXHAUSTED: their bodies would pass "
              "the caller's budget of call bodies being read (buffered=, --data-max-buffered)",
              d.calls_refused_buffer, {{"reason", "buffered"}});
    m.Counter("kvtier_store_dataplane_tls_kernel_total",
              "Socket data-plane TLS connections whose records the kernel encrypts (kTLS); "
              "the others are encrypted by OpenSSL in user space",
              d.tls_kernel);
    m.Gauge("kvtier_store_dataplane_unhelloed_connections",
            "Socket data-plane connections that have not presented a session yet",
            sockets_->unhelloed());
    uint64_t clients_refused = 0;
    {
      std::lock_guard lk(conns_->mu);
      clients_refused = conns_->clients_refused;
    }
    m.Counter("kvtier_store_client_dataplane_refused_total",
              "Data-plane connections refused at a client's --data-max-connections-per-client "
              "(a store without tenants)",
              clients_refused);
    uint64_t sessions = 0, released = 0;
    {
      std::lock_guard lk(sessions_->mu);
      sessions = sessions_->by_id.size();
      released = sessions_->released;
    }
    m.Gauge("kvtier_store_dataplane_sessions",
            "Data-plane sessions the store holds (ConnectDataPlane hands one out per client)",
            sessions);
    m.Counter("kvtier_store_dataplane_sessions_released_total",
              "Socket data-plane sessions released as their last connection closed", released);
  }
  if (const Tenants* tenants = store_->tenants()) {
    std::lock_guard lk(conns_->mu);
    for (const Tenant& t : tenants->all()) {
      auto it = conns_->by_tenant.find(t.index);
      const TenantConnections tc = it == conns_->by_tenant.end() ? TenantConnections{} : it->second;
      MetricsBuilder::Labels l = {{"tenant", t.name}};
      m.Gauge("kvtier_store_tenant_dataplane_connections",
              "The tenant's open socket data-plane connections", tc.open, l);
      m.Counter("kvtier_store_tenant_dataplane_refused_total",
                "The tenant's data-plane connections refused at its connections= limit", tc.refused,
                l);
      m.Counter("kvtier_store_tenant_sessions_dropped_total",
                "The tenant's oldest data-plane sessions dropped for newer ones at its sessions= "
                "limit",
                tc.sessions_dropped, l);
      m.Gauge("kvtier_store_tenant_dataplane_buffered_bytes",
              "Bytes of the tenant's data-plane call bodies being read now (buffered= bounds it)",
              tc.buffer ? tc.buffer->used() : 0, l);
    }
  }
  for (const auto& [name, tier] :
       {std::pair{"ram", FetchMeter::kRam}, std::pair{"disk", FetchMeter::kDisk}}) {
    m.Histogram("kvtier_store_fetch_duration_seconds",
                "Whole fetches, a get lease from BeginGet to its release or an inline get, by the "
                "slowest tier they read",
                store_->FetchDurations(tier), {{"tier", name}});
  }
  for (const auto& [rpc, h] : histograms_) {
    auto snap = h->Take();
    m.Histogram("kvtier_store_rpc_duration_seconds", "Latency of store RPCs", snap, {{"rpc", rpc}});
    m.Counter("kvtier_store_rpc_errors_total", "Store RPCs that returned an error", snap.errors,
              {{"rpc", rpc}});
  }
  for (const auto& t : store_->TenantStats()) {
    MetricsBuilder::Labels l = {{"tenant", t.name}};
    m.Gauge("kvtier_store_tenant_ram_capacity_bytes", "Size of the tenant's RAM region",
            t.ram_capacity_bytes, l);
    m.Gauge("kvtier_store_tenant_ram_used_bytes", "Bytes of the tenant's RAM region in use",
            t.ram_used_bytes, l);
    m.Gauge("kvtier_store_tenant_nvme_bytes", "Bytes of the tenant's blocks on NVMe", t.nvme_bytes,
            l);
    m.Gauge("kvtier_store_tenant_nvme_quota_bytes", "The tenant's NVMe quota (0: none of its own)",
            t.nvme_quota_bytes, l);
    m.Gauge("kvtier_store_tenant_leases", "Open leases of the tenant", t.leases, l);
    m.Gauge("kvtier_store_tenant_namespaces", "Namespaces the tenant has registered", t.namespaces,
            l);
  }
  m.Gauge("kvtier_store_uptime_seconds", "Seconds since start",
          std::chrono::duration<double>(Clock::now() - started_).count());
  return m.Take();
}

}  // namespace kvtier::store
