// A C++ client of kvtier-store's gRPC control plane and inline data path.
// Owns one channel; every call has a deadline. Blocks read back are checked
// against their checksums. Thread-safe (gRPC stubs are).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "common/rpc/proto_convert.h"
#include "common/rpc/tls.h"
#include "kvtier/v1/store.grpc.pb.h"

namespace kvtier {

struct StoreClientOptions {
  int deadline_ms = 10000;
  int max_message_bytes = 64 << 20;
  std::string admin_token;  // sent as x-kvtier-admin-token (needed by SetPolicy, Evict)
  // Sent as x-kvtier-tenant-token: whom a store with tenants serves this
  // client as (docs/security.md). Empty: the environment's
  // KVTIER_TENANT_TOKEN, if set.
  std::string tenant_token;
  ChannelSecurity security;  // plaintext unless TLS credentials are set
};

struct RegisteredNamespace {
  uint64_t id = 0;
  uint64_t block_bytes = 0;
};

struct InlinePutSummary {
  uint32_t stored = 0, already_present = 0, no_space = 0;
};

struct FetchedBlock {
  uint32_t index;
  v1::Tier tier;
  std::string data;
};

class StoreClient {
 public:
  explicit StoreClient(const std::string& address, StoreClientOptions options = {});

  absl::StatusOr<RegisteredNamespace> RegisterNamespace(const NamespaceSpec& spec);
  // Tier of each leading present block.
  absl::StatusOr<std::vector<v1::Tier>> Lookup(uint64_t ns, const std::vector<BlockHash>& hashes);
  // Several chains in one round trip (LookupRequest.chain_lengths): each
  // chain's leading present blocks, in order. Every chain is non-empty and
  // together they name at most kMaxBlocksPerRequest hashes. By `deadline`.
  absl::StatusOr<std::vector<uint32_t>> LookupChains(
      uint64_t ns, const std::vector<std::vector<BlockHash>>& chains,
      std::chrono::system_clock::time_point deadline);
  // Asks the store to check its copies of blocks that failed their
  // checksums here and drop the corrupt ones; how many it dropped.
  absl::StatusOr<uint32_t> VerifyBlocks(uint64_t ns, const std::vector<BlockHash>& hashes);
  // Streams the blocks; checksums are computed here.
  absl::StatusOr<InlinePutSummary> PutInline(
      uint64_t ns, const std::vector<std::pair<BlockHash, std::string_view>>& blocks);
  // The leading present blocks, each verified against its checksum
  // (DATA_LOSS if one does not match).
  absl::StatusOr<std::vector<FetchedBlock>> GetInline(uint64_t ns,
                                                      const std::vector<BlockHash>& hashes);
  absl::StatusOr<v1::GetStatsResponse> GetStats();
  absl::StatusOr<v1::EvictResponse> Evict(const v1::EvictRequest& request);
  absl::StatusOr<v1::TierPolicy> SetPolicy(v1::Tier tier, const std::string& policy);
  // SERVING, or the error. service "" is the whole server;
  // "kvtier.v1.Store/disk" is the NVMe tier.
  absl::Status Health(const std::string& service = "");

  v1::Store::Stub& stub() { return *stub_; }
  // A context with this client's deadline.
  std::unique_ptr<grpc::ClientContext> Context() const;
  // A context ending at `deadline` (for calls that share one operation's deadline).
  std::unique_ptr<grpc::ClientContext> Context(
      std::chrono::system_clock::time_point deadline) const;

  // The data-plane session this client's connections share: the store's
  // ConnectDataPlane answer, asked once (by `deadline`) and kept until
  // forgotten, so that a lease one connection opens can be used and ended
  // on another (the store binds a lease to the session it was opened on).
  // *fresh: whether this call asked the store. Thread-safe.
  absl::StatusOr<v1::ConnectDataPlaneResponse> DataPlaneSession(
      const std::string& client_id, std::chrono::system_clock::time_point deadline, bool* fresh);
  // Forgets the kept session if it is `session` (the store refused it: a
  // restarted store, or one that dropped it).
  void ForgetDataPlaneSession(const std::string& session);

 private:
  // A failed call's status. A deadline that passed names the store: gRPC's
  // own message is only "Deadline Exceeded".
  absl::Status Failed(const grpc::Status& s) const;

  std::string address_;
  StoreClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Store::Stub> stub_;
  std::mutex session_mu_;
  std::optional<v1::ConnectDataPlaneResponse> session_;  // guarded by session_mu_
};

}  // namespace kvtier
