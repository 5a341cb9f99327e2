// A data-plane client of several store shards: each block lives on the shard
// that rendezvous hashing (common/rendezvous.h) picks among the shard
// addresses, so adding or removing a shard moves only the blocks it wins or
// held. One StoreDataClient per shard; an operation runs on its shards at
// once and waits for all of them.
//
// Thread-safe (StoreDataClient is). Statuses: RegisterMemory,
// RegisterNamespace and Lookup return the first failing shard's status
// (RegisterNamespace: INVALID_ARGUMENT with no shards); Put returns the first
// failing shard's status once every shard has answered; Get returns the
// leading blocks every shard delivered, and a failing shard's status only
// when that leaves none. Shard statuses are StoreDataClient's.
//
// Included by client/store_data_client.h, whose users reach these through
// it; so this header needs only the shared types, not StoreDataClient's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/data_client_types.h"
#include "client/store_client.h"
#include "common/block_key.h"

namespace kvtier {

class StoreDataClient;

// Rendezvous (highest-random-weight) placement of a block on one of several
// shards: adding or removing a shard moves only the keys it wins or held.
// REQUIRES: !shards.empty().
size_t RendezvousShard(const BlockKey& key, const std::vector<std::string>& shards);

class ShardedStoreClient {
 public:
  ShardedStoreClient(std::vector<std::string> addresses, DataClientOptions options = {});
  // Out of line: StoreDataClient is incomplete here.
  ~ShardedStoreClient();
  ShardedStoreClient(ShardedStoreClient&&) noexcept;
  ShardedStoreClient& operator=(ShardedStoreClient&&) noexcept;

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
