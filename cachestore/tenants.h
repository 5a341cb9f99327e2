// Tenants of a store (kvtier-store --tenants-file): who may use it, and
// what each may hold. A tenant is a set of principals (certificate names,
// bearer tokens) that share blocks; different tenants never do.
//
// File format, one tenant a line, # comments:
//
//   secret SECRET                       (required, once, first: keys the salts)
//   tenant NAME ram=SIZE [nvme=SIZE] [leases=N] [namespaces=N]
//          [connections=N] [sessions=N] [buffered=SIZE]
//          [identities=NAME,...] [token-sha256=HEX,...] [models=PATTERN,...]
//
// ram: the tenant's own region of the RAM arena (its RAM quota; it gets
// only that region's UCX key). nvme: most bytes of its blocks on NVMe (0:
// only the store's quota). leases: open leases at once (default: the
// store's --max-leases-per-client). namespaces: registered at once (default
// 16). connections: data-plane connections open at once (default 1024);
// sessions: data-plane sessions kept, its oldest dropped first (default
// 4096; common/limits.h); buffered: bytes of data-plane call bodies being
// read at once on its connections (default 64MiB). identities: certificate names (CN or a SAN) that
// act as the tenant. token-sha256: SHA-256 (hex) of bearer tokens a client presents in metadata
// x-kvtier-tenant-token. models: the models it may register (a trailing * is a prefix); default
// any.
//
// A tenant's salt -- first 16 bytes of SHA-256("kvtier-tenant" | secret |
// NAME), so nobody without the file can compute it -- enters the identity
// of each of its namespaces (common/block_key.h):
// the store keys its blocks under NamespaceId of the spec with cache_salt
// "tenant:NAME:SALT|<the client's own cache_salt>", so the same prompt of
// two tenants is two blocks, and a tenant can name only its own.
// Immutable after Parse; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "common/limits.h"

namespace kvtier::store {

struct Tenant {
  std::string name;
  int index = 0;     // position in the file: its RAM pool
  std::string salt;  // 32 hex digits
  uint64_t ram_bytes = 0;
  uint64_t nvme_bytes = 0;  // 0: no tenant limit
  uint64_t max_leases = 0;  // 0: the store's per-client limit
  uint64_t max_namespaces = 16;
  // Data-plane connections open at once, and sessions kept (its oldest
  // goes first).
  uint64_t max_connections = limits::kTenantDataConnections;
  uint64_t max_sessions = limits::kTenantSessions;
  uint64_t max_buffered = limits::kTenantBufferedBytes;
  std::vector<std::string> identities;
  std::vector<std::string> token_sha256;  // lowercase hex
  std::vector<std::string> models;        // empty: any

  // INVALID_ARGUMENT naming the model pattern list when spec.model is not
  // in it.
  absl::Status AllowsModel(const std::string& model) const;
  // spec as the store keys it for this tenant (its salt in cache_salt).
  NamespaceSpec Salted(const NamespaceSpec& spec) const;
};

// Whom a tenant's leases count against (LeaseTable holders).
inline std::string TenantLeaseHolder(const Tenant& t) { return "tenant " + t.name; }

class Tenants {
 public:
  // INVALID_ARGUMENT naming the line and what is wrong.
  static absl::StatusOr<std::shared_ptr<const Tenants>> Parse(std::string_view text);
  static absl::StatusOr<std::shared_ptr<const Tenants>> Load(const std::string& path);

  const std::vector<Tenant>& all() const { return tenants_; }
  // The tenant one of these certificate names belongs to; null if none.
  const Tenant* ByIdentity(const std::vector<std::string>& names) const;
  // The tenant whose token this is (compared as SHA-256); null if none.
  const Tenant* ByToken(std::string_view token) const;
  // For a spec the store keeps (Tenant::Salted): its tenant and the spec as
  // the tenant registered it. Null tenant for an unsalted spec or one of a
  // tenant no longer in the file.
  const Tenant* Unsalt(const NamespaceSpec& stored, NamespaceSpec* client) const;
  uint64_t ram_bytes() const;  // all tenants' RAM quotas

 private:
  std::vector<Tenant> tenants_;
};

// Lowercase hex SHA-256 of data.
std::string Sha256Hex(std::string_view data);

}  // namespace kvtier::store

namespace kvtier::store {

// Which tenant each namespace the store keys belongs to: read on every RAM
// tier operation (which pool) and NVMe write (whose quota). The registry
// sets an entry when a tenant's namespace appears and never changes it: a
// store-side id has its tenant's salt in it, so it is only ever that
// tenant's, and a block's pool must not change while it is resident.
// Thread-safe; its lock is a leaf (taken under the tiers' locks, never the
// other way round).
class NamespaceTenants {
 public:
  void Set(uint64_t ns, int tenant) {
    std::unique_lock lk(mu_);
    map_[ns] = tenant;
  }
  // The tenant's index, or -1 for a namespace of no tenant.
  int Of(uint64_t ns) const {
    std::shared_lock lk(mu_);
    auto it = map_.find(ns);
    return it == map_.end() ? -1 : it->second;
  }

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<uint64_t, int> map_;
};

}  // namespace kvtier::store
