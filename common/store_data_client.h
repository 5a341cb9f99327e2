// The data-plane client of one kvtier-store shard: a gRPC control channel
// (StoreClient) plus UCX endpoints to the store's RAM arena, one per lane;
// each lane is a background thread that owns its UCX worker, so one
// operation's RPCs overlap another's transfers.
//
// Put: BeginPut -> ucp_put_nbx of every reserved block (all in flight at
// once, checksums computed meanwhile) -> one flush -> CommitPut. Get:
// BeginGet -> ucp_get_nbx of every pinned block -> EndGet -> every block
// checked against its checksum. Operations are asynchronous (futures) and
// bounded by max_inflight_bytes: a caller past the bound blocks until earlier
// operations finish (back-pressure). A dead store, a reset connection or a
// missed deadline fails the operation with a status; the next operation
// reconnects, with exponential back-off between attempts.
//
// Memory: blocks may live anywhere in host memory; ranges registered with
// RegisterMemory move zero-copy. Thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "common/store_client.h"

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

class StoreDataClient {
 public:
  explicit StoreDataClient(const std::string& address, DataClientOptions options = {});
  ~StoreDataClient();
  StoreDataClient(const StoreDataClient&) = delete;
  StoreDataClient& operator=(const StoreDataClient&) = delete;

  // Registers [addr, addr + length) for zero-copy transfers.
  absl::Status RegisterMemory(void* addr, size_t length);

  std::future<absl::StatusOr<PutOutcome>> Put(uint64_t ns, uint64_t block_bytes,
                                              std::vector<PutBlock> blocks);
  std::future<absl::StatusOr<GetOutcome>> Get(uint64_t ns, uint64_t block_bytes,
                                              std::vector<GetBlock> blocks);

  StoreClient& control() { return control_; }
  const std::string& address() const { return address_; }

 private:
  struct Lane;  // the UCX state, touched only by the background thread
  using Job = std::function<void(Lane&)>;
  void Submit(uint64_t bytes, Job job);
  // Connects the lane's endpoint if it is not (or no longer) connected.
  absl::Status EnsureConnected(Lane& lane, std::chrono::system_clock::time_point rpc_deadline);
  bool UseSharedMemory() const;
  void Run(Lane& lane);

  std::string address_;
  DataClientOptions options_;
  StoreClient control_;
  std::shared_ptr<void> ucx_context_;  // ucx::Context, shared by the lanes
  std::mutex regions_mu_;
  std::vector<std::shared_ptr<void>> regions_;  // ucx::MemoryRegion
  std::vector<std::unique_ptr<Lane>> lanes_;
  absl::Status init_error_;

  mutable std::mutex mu_;
  std::condition_variable cv_, space_cv_;
  std::deque<std::pair<uint64_t, Job>> jobs_;
  uint64_t inflight_bytes_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Rendezvous (highest-random-weight) placement of a block on one of several
// shards: adding or removing a shard moves only the keys it wins or held.
size_t RendezvousShard(const BlockKey& key, const std::vector<std::string>& shards);

// A client of several store shards: each block lives on the shard that
// rendezvous hashing picks among the shard addresses.
class ShardedStoreClient {
 public:
  ShardedStoreClient(std::vector<std::string> addresses, DataClientOptions options = {});

  absl::Status RegisterMemory(void* addr, size_t length);
  // Registers the namespace on every shard.
  absl::StatusOr<RegisteredNamespace> RegisterNamespace(const NamespaceSpec& spec);
  // Leading blocks of the chain present on their shards.
  absl::StatusOr<uint32_t> Lookup(uint64_t ns, const std::vector<BlockHash>& chain);
  absl::StatusOr<PutOutcome> Put(uint64_t ns, uint64_t block_bytes,
                                 const std::vector<PutBlock>& blocks);
  // Fetches the chain's leading present blocks; returns how many.
  absl::StatusOr<GetOutcome> Get(uint64_t ns, uint64_t block_bytes,
                                 const std::vector<GetBlock>& blocks);

  size_t shards() const { return shards_.size(); }
  StoreDataClient& shard(size_t i) { return *shards_[i]; }

 private:
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<StoreDataClient>> shards_;
};

}  // namespace kvtier
