// ShardedStoreClient and RendezvousShard (sharded_store_client.h, which
// states their guarantees): placement of blocks on shards, and merging the
// shards' answers.
#include "client/sharded_store_client.h"

#include <algorithm>
#include <future>
#include <utility>

#include "client/store_data_client.h"
#include "common/rendezvous.h"

namespace kvtier {

namespace {

const BlockHash& HashOf(const BlockHash& h) { return h; }
const BlockHash& HashOf(const PutBlock& b) { return b.hash; }
const BlockHash& HashOf(const GetBlock& b) { return b.hash; }

// Which of `blocks` each shard holds: indices into blocks, in order, so a
// shard's part of a chain is itself a chain.
template <typename Block>
std::vector<std::vector<size_t>> ByShard(uint64_t ns, const std::vector<Block>& blocks,
                                         const std::vector<std::string>& shards) {
  std::vector<std::vector<size_t>> indices(shards.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    indices[RendezvousShard({ns, HashOf(blocks[i])}, shards)].push_back(i);
  }
  return indices;
}

// The blocks at `indices`, in that order.
template <typename Block>
std::vector<Block> Select(const std::vector<Block>& blocks, const std::vector<size_t>& indices) {
  std::vector<Block> out;
  out.reserve(indices.size());
  for (size_t i : indices) out.push_back(blocks[i]);
  return out;
}

}  // namespace

size_t RendezvousShard(const BlockKey& key, const std::vector<std::string>& shards) {
  return RendezvousPick(RendezvousKey(key), shards);
}

ShardedStoreClient::ShardedStoreClient(std::vector<std::string> addresses,
                                       DataClientOptions options)
    : addresses_(std::move(addresses)) {
  for (const auto& a : addresses_) shards_.push_back(std::make_unique<StoreDataClient>(a, options));
}

ShardedStoreClient::~ShardedStoreClient() = default;
ShardedStoreClient::ShardedStoreClient(ShardedStoreClient&&) noexcept = default;
ShardedStoreClient& ShardedStoreClient::operator=(ShardedStoreClient&&) noexcept = default;

absl::Status ShardedStoreClient::RegisterMemory(void* addr, size_t length) {
  for (auto& s : shards_) {
    if (auto st = s->RegisterMemory(addr, length); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisteredNamespace> ShardedStoreClient::RegisterNamespace(
    const NamespaceSpec& spec) {
  absl::StatusOr<RegisteredNamespace> r = absl::InvalidArgumentError("no shards");
  for (auto& s : shards_) {
    r = s->control().RegisterNamespace(spec);
    if (!r.ok()) return r;
  }
  return r;
}

absl::StatusOr<uint32_t> ShardedStoreClient::Lookup(uint64_t ns,
                                                    const std::vector<BlockHash>& chain) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, chain, addresses_);
  size_t prefix = chain.size();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    auto tiers = shards_[s]->control().Lookup(ns, Select(chain, parts[s]));
    if (!tiers.ok()) return tiers.status();
    if (tiers->size() < parts[s].size()) prefix = std::min(prefix, parts[s][tiers->size()]);
  }
  return static_cast<uint32_t>(prefix);
}

absl::StatusOr<PutOutcome> ShardedStoreClient::Put(uint64_t ns, uint64_t block_bytes,
                                                   const std::vector<PutBlock>& blocks) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, blocks, addresses_);
  std::vector<std::future<absl::StatusOr<PutOutcome>>> futures;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    futures.push_back(shards_[s]->Put(ns, block_bytes, Select(blocks, parts[s])));
  }
  PutOutcome total;
  absl::Status first = absl::OkStatus();
  for (auto& f : futures) {
    auto r = f.get();
    if (!r.ok()) {
      if (first.ok()) first = r.status();
      continue;
    }
    total.written += r->written;
    total.already_present += r->already_present;
    total.busy += r->busy;
    total.no_space += r->no_space;
  }
  if (!first.ok()) return first;
  return total;
}

absl::StatusOr<GetOutcome> ShardedStoreClient::Get(uint64_t ns, uint64_t block_bytes,
                                                   const std::vector<GetBlock>& blocks) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, blocks, addresses_);
  std::vector<std::pair<size_t, std::future<absl::StatusOr<GetOutcome>>>> futures;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    futures.emplace_back(s, shards_[s]->Get(ns, block_bytes, Select(blocks, parts[s])));
  }
  size_t prefix = blocks.size();
  uint32_t from_disk = 0;
  absl::Status first = absl::OkStatus();
  for (auto& [s, f] : futures) {
    auto r = f.get();
    if (!r.ok()) {
      if (first.ok()) first = r.status();
      prefix = std::min(prefix, parts[s][0]);
      continue;
    }
    if (r->blocks < parts[s].size()) prefix = std::min(prefix, parts[s][r->blocks]);
    from_disk += r->from_disk;
  }
  if (!first.ok() && prefix == 0) return first;
  return GetOutcome{static_cast<uint32_t>(prefix), from_disk};
}

}  // namespace kvtier
