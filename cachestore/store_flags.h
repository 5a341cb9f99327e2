// kvtier-store's command line: every flag, its default and its help text.
#pragma once

#include <cstdint>
#include <string>

#include "common/limits.h"
#include "common/rpc/tls.h"

namespace kvtier::store {

struct StoreFlags {
  std::string listen = "127.0.0.1:7400";
  std::string data_dir = "./kvtier-data";
  uint64_t ram_bytes = 1ull << 30;
  uint64_t disk_bytes = 8ull << 30;
  uint64_t slab_bytes = 4ull << 20;
  std::string ram_policy = "s3fifo";
  int64_t lru_max_scan = static_cast<int64_t>(kvtier::limits::kEvictScan);
  std::string disk_policy = "lru";
  uint64_t lease_ms = 10000;
  uint64_t demote_queue_bytes = 64ull << 20;
  uint64_t disk_reserve_bytes = 64ull << 20;
  std::string disk_admission = "all";
  std::string disk_sync = "none";
  uint64_t persist_on_stop_ms = 0;
  uint64_t disk_sync_interval_ms = kvtier::limits::kDiskSyncIntervalMs;
  bool hugepages = true;
  bool local_shm = true;
  bool prefault = true;
  int64_t ram_shards = 0;
  uint64_t max_message_bytes = 64ull << 20;
  std::string port_file;
  std::string routers;
  uint64_t router_refresh_ms = 5000;
  std::string store_id, advertise_address;
  std::string data_listen;
  std::string data_advertise;
  std::string data_plane = "socket";
  bool data_tls = false;
  bool verify_commits = true;
  std::string metrics_listen;
  bool check_config = false;
  std::string admin_token_file;
  std::string admin_identity;
  std::string tenants_file;
  kvtier::TlsFlags tls;
  int64_t max_leases_per_client = 1024;
  int64_t max_namespaces = 1024;
  int64_t data_max_connections = kvtier::limits::kDataConnections;
  int64_t data_max_unhelloed = kvtier::limits::kDataUnhelloed;
  uint64_t data_max_buffered = kvtier::limits::kDataBufferedBytes;
  int64_t data_max_connections_per_client =
      static_cast<int64_t>(kvtier::limits::kClientDataConnections);
  uint64_t data_hello_timeout_ms = kvtier::limits::kDataHelloMs;
  uint64_t data_idle_timeout_ms = kvtier::limits::kDataIdleMs;
  int64_t data_threads = 0;
};

// The flags of argv (exits with the usage on --help or a bad flag).
StoreFlags ParseStoreFlags(int argc, char** argv);

}  // namespace kvtier::store
