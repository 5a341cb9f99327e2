#include "cachestore/namespace_registry.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc/proto_convert.h"

namespace kvtier::store {

namespace {

constexpr char kMetaPrefix[] = "ns/";

std::string SerializeSpec(const NamespaceSpec& s) {
  kvtier::v1::NamespaceSpec p;
  ToProto(s, &p);
  return p.SerializeAsString();
}

bool ParseSpec(const std::string& bytes, NamespaceSpec* s) {
  kvtier::v1::NamespaceSpec p;
  if (!p.ParseFromString(bytes)) return false;
  *s = FromProto(p);
  return true;
}

}  // namespace

NamespaceRegistry::NamespaceRegistry(DiskTier* disk, size_t max_namespaces,
                                     std::shared_ptr<const Tenants> tenants,
                                     NamespaceTenants* owners)
    : disk_(disk), max_namespaces_(max_namespaces), tenants_(std::move(tenants)), owners_(owners) {
  if (tenants_) per_tenant_.assign(tenants_->all().size(), 0);
}

absl::StatusOr<std::unique_ptr<NamespaceRegistry>> NamespaceRegistry::Load(
    DiskTier* disk, size_t max_namespaces, std::shared_ptr<const Tenants> tenants,
    NamespaceTenants* owners) {
  std::unique_ptr<NamespaceRegistry> r(
      new NamespaceRegistry(disk, max_namespaces, std::move(tenants), owners));
  auto records = disk->ScanMeta(kMetaPrefix);
  if (!records.ok()) {
    return absl::Status(records.status().code(), absl::StrCat("loading the store's namespaces: ",
                                                              records.status().message()));
  }
  std::lock_guard lk(r->mu_);
  for (const auto& [key, value] : *records) {
    NamespaceSpec spec;
    if (!ParseSpec(value, &spec)) {
      Log("store", "ignoring unreadable namespace record ", key);
      r->skipped_records_++;
      continue;
    }
    NamespaceInfo info{NamespaceId(spec), spec, 0, -1, 0, spec};
    if (r->tenants_) {
      // A namespace of a tenant no longer in the file (or before tenants)
      // is kept, owned by nobody: no client can name it.
      if (const Tenant* t = r->tenants_->Unsalt(spec, &info.client_spec)) info.tenant = t->index;
    }
    if (!ValidateNamespace(info.client_spec).ok()) {
      Log("store", "ignoring unreadable namespace record ", key);
      r->skipped_records_++;
      continue;
    }
    info.client_id = NamespaceId(info.client_spec);
    info.block_bytes = BlockBytes(spec);
    r->AddLocked(info);
  }
  return r;
}

void NamespaceRegistry::AddLocked(const NamespaceInfo& info) {
  namespaces_[info.id] = info;
  if (info.tenant >= 0) {
    by_tenant_[{info.tenant, info.client_id}] = info.id;
    ++per_tenant_[info.tenant];
    if (owners_) owners_->Set(info.id, info.tenant);
  }
}

absl::StatusOr<NamespaceInfo> NamespaceRegistry::Register(const NamespaceSpec& client_spec,
                                                          uint64_t expected_id,
                                                          uint64_t max_block_bytes,
                                                          const Tenant* tenant) {
  if (auto s = ValidateNamespace(client_spec); !s.ok()) return s;
  uint64_t client_id = NamespaceId(client_spec);
  if (expected_id != 0 && expected_id != client_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace id mismatch: caller computed ", NamespaceName(expected_id), " but the spec \"",
        CanonicalNamespace(client_spec), "\" hashes to ", NamespaceName(client_id)));
  }
  if (tenant) {
    if (auto s = tenant->AllowsModel(client_spec.model); !s.ok()) return s;
  }
  const NamespaceSpec spec = tenant ? tenant->Salted(client_spec) : client_spec;
  const uint64_t id = NamespaceId(spec);
  uint64_t bytes = BlockBytes(spec);
  if (bytes > max_block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace blocks of ", bytes, " bytes exceed the RAM slab size of ", max_block_bytes,
        " bytes; start kvtier-store with --ram-slab-bytes >= ", bytes));
  }
  // How a namespace is named in messages: as its registrant knows it.
  const std::string name = NamespaceName(client_id);
  // The record is written (and synced) outside the lock: every data-plane
  // call looks namespaces up, and an fsync can take seconds on a busy disk.
  {
    std::lock_guard lk(mu_);
    if (auto it = namespaces_.find(id); it != namespaces_.end()) return it->second;
    if (auto s = LimitsAllowLocked(name, client_spec, tenant); !s.ok()) return s;
  }
  const std::string key = kMetaPrefix + NamespaceName(id);
  if (auto s = disk_->PutMeta(key, SerializeSpec(spec)); !s.ok()) {
    Log("store", "namespace ", NamespaceName(id), " not persisted: ", s.message());
  }
  NamespaceInfo info{id, spec, bytes, tenant ? tenant->index : -1, client_id, client_spec};
  {
    std::lock_guard lk(mu_);
    if (auto it = namespaces_.find(id); it != namespaces_.end()) return it->second;  // a twin won
    auto allowed = LimitsAllowLocked(name, client_spec, tenant);
    if (!allowed.ok()) {
      // Another registration took the last place meanwhile: this one's
      // record must not bring it back at the next start.
      (void)disk_->DeleteMeta(key);
      return allowed;
    }
    AddLocked(info);
  }
  Log("store", "registered namespace ", NamespaceName(id), " (", CanonicalNamespace(client_spec),
      tenant ? absl::StrCat(", tenant ", tenant->name, " as ", name) : std::string(),
      "), blocks of ", bytes, " bytes");
  return info;
}

absl::Status NamespaceRegistry::LimitsAllowLocked(const std::string& name,
                                                  const NamespaceSpec& client_spec,
                                                  const Tenant* tenant) const {
  if (tenant && per_tenant_[tenant->index] >= tenant->max_namespaces) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant ", tenant->name, " holds ", per_tenant_[tenant->index],
                     " namespaces, its limit (namespaces= in the tenants file); namespace ", name,
                     " (", CanonicalNamespace(client_spec),
                     ") is not registered. Ask an operator to remove unused "
                     "ones (kvctl namespaces rm ID) or raise namespaces="));
  }
  if (max_namespaces_ != 0 && namespaces_.size() >= max_namespaces_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store holds ", namespaces_.size(), " namespaces, its limit (--max-namespaces ",
        max_namespaces_, "); namespace ", name, " (", CanonicalNamespace(client_spec),
        ") is not registered. Remove unused ones with kvctl namespaces rm ID"));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamespaceInfo> NamespaceRegistry::Resolve(const Tenant& tenant,
                                                         uint64_t client_id) const {
  std::lock_guard lk(mu_);
  auto it = by_tenant_.find({tenant.index, client_id});
  if (it == by_tenant_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace ", NamespaceName(client_id),
                                            " is not registered; call RegisterNamespace first"));
  }
  return namespaces_.at(it->second);
}

absl::StatusOr<NamespaceInfo> NamespaceRegistry::Remove(uint64_t id) {
  std::lock_guard lk(mu_);
  auto it = namespaces_.find(id);
  if (it == namespaces_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace ", NamespaceName(id), " is not registered"));
  }
  NamespaceInfo info = it->second;
  if (auto s = disk_->DeleteMeta(kMetaPrefix + NamespaceName(id)); !s.ok()) {
    // Kept in memory: removing it here but not on disk would bring it back
    // at the next start.
    return absl::UnavailableError(absl::StrCat("namespace ", NamespaceName(id),
                                               " not removed: its record on disk: ", s.message()));
  }
  if (info.tenant >= 0) {
    by_tenant_.erase({info.tenant, info.client_id});
    --per_tenant_[info.tenant];
    // owners_ keeps it: blocks still pinned must stay in the same pool's
    // shard until their leases end, and the id (its tenant's salt in it)
    // can only ever be that tenant's.
  }
  namespaces_.erase(it);
  Log("store", "removed namespace ", NamespaceName(id), " (", CanonicalNamespace(info.client_spec),
      ")");
  return info;
}

absl::StatusOr<NamespaceInfo> NamespaceRegistry::Find(uint64_t id) const {
  std::lock_guard lk(mu_);
  auto it = namespaces_.find(id);
  if (it == namespaces_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace ", NamespaceName(id),
                                            " is not registered; call RegisterNamespace first"));
  }
  return it->second;
}

std::vector<NamespaceInfo> NamespaceRegistry::List(const Tenant* tenant) const {
  std::lock_guard lk(mu_);
  std::vector<NamespaceInfo> out;
  out.reserve(namespaces_.size());
  for (const auto& [id, info] : namespaces_) {
    if (tenant == nullptr || info.tenant == tenant->index) out.push_back(info);
  }
  return out;
}

}  // namespace kvtier::store
