#include "cachestore/store_flags.h"

#include "common/config.h"

namespace kvtier::store {

using kvtier::FlagSet;

StoreFlags ParseStoreFlags(int argc, char** argv) {
  StoreFlags f;
  FlagSet flags("kvtier-store",
                "The kvtier cache service: keeps KV-cache blocks in a RAM tier and an NVMe tier\n"
                "(RocksDB) and serves them over gRPC (kvtier.v1.Store, grpc.health.v1).\n"
                "Example: kvtier-store --listen 0.0.0.0:7400 --data-dir /var/lib/kvtier "
                "--ram-bytes 64GiB --disk-bytes 1TiB");
  flags.HostPort("listen", &f.listen, "gRPC address HOST:PORT (port 0 picks a free port)");
  flags.String("data-dir", &f.data_dir, "Directory of the NVMe tier's RocksDB database");
  flags.Bytes("ram-bytes", &f.ram_bytes, "Size of the RAM tier arena (e.g. 64MiB, 8GiB)");
  flags.Bytes("disk-bytes", &f.disk_bytes, "Byte quota of the NVMe tier (records incl. header)");
  flags.Bytes("ram-slab-bytes", &f.slab_bytes,
              "Slab size of the RAM arena; the largest block the store accepts");
  flags.Choice("ram-policy", &f.ram_policy, {"lru", "s3fifo", "sieve"}, "RAM eviction policy");
  flags.Int("lru-max-scan", &f.lru_max_scan, 1, static_cast<int64_t>(kvtier::limits::kEvictScanMax),
            "Residents an LRU eviction looks at for one victim (pinned ones are passed over); "
            "past it none is found. The lru policy's max_scan at start (kvctl policy set lru "
            "--param max_scan=N changes it)");
  flags.Choice("disk-policy", &f.disk_policy, {"lru", "s3fifo", "sieve"}, "NVMe eviction policy");
  flags.DurationMs("lease-ms", &f.lease_ms,
                   "How long an uncommitted put or an un-ended get holds its slots (e.g. 10s)");
  flags.Bytes("demote-queue-bytes", &f.demote_queue_bytes,
              "Bound of the RAM->NVMe write-back queue; blocks evicted past it are dropped "
              "(counted)");
  flags.Bytes("disk-reserve-bytes", &f.disk_reserve_bytes,
              "Free space kept on the data dir's filesystem: below it NVMe writes pause (tier "
              "degraded; reads and RAM go on) until space returns");
  flags.Choice("disk-admission", &f.disk_admission, {"all", "reused"},
               "Which evicted RAM blocks go to NVMe: all, or only those read at least once");
  flags.Choice("disk-sync", &f.disk_sync, {"none", "commit", "group"},
               "When an NVMe block is fsynced: none (survives a crash of the store, not of the "
               "host), commit (each write), group (every --disk-sync-interval); lookups say "
               "NVMe only for what the mode makes durable (docs/reliability.md)");
  flags.DurationMs("disk-sync-interval", &f.disk_sync_interval_ms,
                   "The group fsync period of --disk-sync=group (e.g. 10ms; at most 10s)");
  flags.DurationMs("persist-on-stop", &f.persist_on_stop_ms,
                   "On SIGTERM, once serving stopped: write the RAM tier's blocks not yet on NVMe "
                   "to NVMe for at most this long, so a restart keeps them (0: off)");
  flags.Bool("hugepages", &f.hugepages, "Back the RAM arena with 2 MiB hugepages when reserved");
  flags.Bool("local-shm", &f.local_shm,
             "Let data-plane clients on this host, running as this user, map the RAM arena and "
             "move blocks with memcpy instead of UCX (same leases and checksums)");
  flags.Bool("prefault", &f.prefault,
             "Touch the whole RAM arena at start (RSS = --ram-bytes at once; no page faults "
             "on the data path)");
  flags.Int("ram-shards", &f.ram_shards, 0, 256, "Index shards of the RAM tier (0: automatic)");
  flags.Bytes("max-message-bytes", &f.max_message_bytes,
              "Largest gRPC message accepted or sent (bounds inline block size)");
  flags.String("port-file", &f.port_file, "Write the bound gRPC port to this file once serving");
  flags.String("data-listen", &f.data_listen,
               "Data-plane listener HOST:PORT (blocks move between clients and the RAM arena "
               "there, as --data-plane says); empty: inline gRPC path only");
  flags.String("data-advertise", &f.data_advertise,
               "HOST:PORT clients are told to reach the socket data plane at, when that is not "
               "--data-listen's (a proxy, NAT or a port-forward in between) [default: the bound "
               "address; a host of 0.0.0.0 means the host the client reached the store at]");
  flags.String("ucx-listen", &f.data_listen, "Former name of --data-listen (still accepted)");
  flags.Int("data-max-connections", &f.data_max_connections, 1, int64_t{1} << 20,
            "Socket data-plane connections open at once; more are closed at accept (each "
            "tenant has its own connections= within it: docs/security.md)");
  flags.Int("data-max-unhelloed", &f.data_max_unhelloed, 1, int64_t{1} << 20,
            "Socket data-plane connections that have not presented a session yet; past it a "
            "new one evicts the oldest of them");
  flags.Int("data-max-connections-per-client", &f.data_max_connections_per_client, 1,
            int64_t{1} << 20,
            "Socket data-plane connections one client may hold open on a store without tenants "
            "(a client: its certificate's identity under mutual TLS, else its host); tenants "
            "have connections= instead");
  flags.Bytes("data-max-buffered", &f.data_max_buffered,
              "Bytes of socket data-plane call bodies being read at once on a store without "
              "tenants (each tenant has its own buffered= instead); a call past it is answered "
              "RESOURCE_EXHAUSTED");
  flags.DurationMs("data-hello-timeout", &f.data_hello_timeout_ms,
                   "How long a new data-plane connection has to present its session");
  flags.DurationMs("data-idle-timeout", &f.data_idle_timeout_ms,
                   "How long a data-plane connection may wait between requests before it is "
                   "closed (clients reconnect)");
  flags.Int("data-threads", &f.data_threads, 0, 8,
            "Event-loop threads of the socket data plane (each serves its share of the "
            "connections); 0: two per core, at most 8");
  flags.Bool("data-tls", &f.data_tls,
             "Serve the socket data plane over TLS 1.3 with --tls-cert/--tls-key (kernel TLS "
             "where the kernel has it): an eavesdropper then reads no block, session or call; "
             "clients verify the store against their --tls-ca");
  flags.Choice("data-plane", &f.data_plane, {"socket", "ucx"},
               "The data plane's transport: socket (the store checks every transfer against "
               "the caller's lease before it touches its memory; safe with any client), or "
               "ucx (clients RMA into the RAM arena; over TCP and shared memory UCX checks no "
               "bounds, so any client can address the whole store process: trusted clients "
               "only, refused with --tenants-file; docs/security.md)");
  flags.Bool("verify-commits", &f.verify_commits,
             "Hash every block at CommitPut and refuse one whose bytes do not match its "
             "checksum (off: trust the writer; readers still verify)");
  flags.String("admin-token-file", &f.admin_token_file,
               "File holding the token admin RPCs (SetPolicy, Evict) must present; empty: "
               "no check");
  flags.String("admin-identity", &f.admin_identity,
               "Admin RPCs also need a verified client certificate whose common name or a "
               "subject alternative name is this (needs --tls-require-client-cert)");
  flags.String("tenants-file", &f.tenants_file,
               "Tenants who may use this store, each with its RAM region, NVMe quota, lease and "
               "namespace limits, known by certificate name or token (docs/security.md); "
               "empty: one tenant, anyone who connects");
  kvtier::AddTlsFlags(flags, &f.tls, /*serves=*/true, /*dials=*/true);
  flags.Int("max-leases-per-client", &f.max_leases_per_client, 0, int64_t{1} << 30,
            "Open put+get leases one client may hold: a verified certificate's identity, else "
            "a connection (0: no limit)");
  flags.Int("max-namespaces", &f.max_namespaces, 0, int64_t{1} << 20,
            "Namespaces registered at once; past it RegisterNamespace is RESOURCE_EXHAUSTED "
            "(kvctl namespaces rm frees one; 0: no limit)");
  flags.String("metrics-listen", &f.metrics_listen,
               "Serve Prometheus metrics on HOST:PORT/metrics (empty: off)");
  flags.Bool("check-config", &f.check_config,
             "Validate the flags, print the effective configuration and exit 0 (no data dir, "
             "no ports)");
  flags.String("router", &f.routers,
               "Comma-separated kvtier-router addresses to publish this shard's blocks to");
  flags.DurationMs("router-refresh", &f.router_refresh_ms,
                   "How often --router names are resolved again: one publisher per address, so "
                   "every replica behind a headless Service hears this shard (0: once)");
  flags.String("store-id", &f.store_id,
               "This shard's id towards routers [default: kvtier-store@LISTEN]");
  flags.String("advertise-address", &f.advertise_address,
               "The gRPC address routers show for this shard (kvctl workers) [default: --listen "
               "when it names a host and a port, not 0.0.0.0 or port 0]");
  kvtier::ParseFlagsOrExit(flags, argc, argv);
  return f;
}

}  // namespace kvtier::store
