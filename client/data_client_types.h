// What callers hand to the data-plane clients and get back: the options
// shared by StoreDataClient and ShardedStoreClient, the blocks of one put or
// get, and their outcomes. A header of its own so that the sharded client's
// header needs only these, not the one-store client's.
//
// Plain values; no status codes.
#pragma once

#include <cstdint>
#include <string>

#include "common/block_key.h"
#include "common/rpc/tls.h"

namespace kvtier {

struct DataClientOptions {
  std::string client_id = "kvtier-client";
  int lanes = 2;  // operations run concurrently, each lane with its own UCX worker and endpoint
  // Connect through the store's sockaddr listener (RDMA-CM / TCP) instead of
  // its worker address. Sockaddr endpoints use network transports only.
  bool use_sockaddr = false;
  // Let UCX use shared memory when client and store share a host (connects
  // to the worker address without peer-failure handling, which UCX 1.13's
  // shared-memory transports need; a dead store then fails operations at
  // their deadline instead of at once). kAuto: on when the store's address
  // is a loopback one.
  enum class SharedMemory { kAuto, kOn, kOff };
  SharedMemory shared_memory = SharedMemory::kAuto;
  int deadline_ms = 10000;                    // per operation, RPCs and transfers together
  uint64_t max_inflight_bytes = 256ull << 20;  // queued + running operations
  uint64_t backoff_min_ms = 50;
  uint64_t backoff_max_ms = 5000;
  ChannelSecurity security;  // of the gRPC control channel (plaintext unless set)
};

struct PutBlock {
  BlockHash hash;
  const void* data;  // block_bytes bytes, valid until the operation completes
};

struct GetBlock {
  BlockHash hash;
  void* dest;  // block_bytes bytes, written by the operation
};

struct PutOutcome {
  uint32_t written = 0;          // sent and committed
  uint32_t already_present = 0;  // the store had them: not sent
  uint32_t busy = 0;             // another writer had them in flight: not sent
  uint32_t no_space = 0;         // the store had no free slot: not sent
};

struct GetOutcome {
  uint32_t blocks = 0;     // leading blocks fetched and verified
  uint32_t from_disk = 0;  // of those, promoted from the store's NVMe tier
};

}  // namespace kvtier
