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

NamespaceRegistry::NamespaceRegistry(DiskTier* disk, size_t max_namespaces)
    : disk_(disk), max_namespaces_(max_namespaces) {
  for (const auto& [key, value] : disk_->ScanMeta(kMetaPrefix)) {
    NamespaceSpec spec;
    if (!ParseSpec(value, &spec) || !ValidateNamespace(spec).ok()) {
      Log("store", "ignoring unreadable namespace record ", key);
      continue;
    }
    uint64_t id = NamespaceId(spec);
    namespaces_[id] = NamespaceInfo{id, spec, BlockBytes(spec)};
  }
}

absl::StatusOr<NamespaceInfo> NamespaceRegistry::Register(const NamespaceSpec& spec,
                                                          uint64_t expected_id,
                                                          uint64_t max_block_bytes) {
  if (auto s = ValidateNamespace(spec); !s.ok()) return s;
  uint64_t id = NamespaceId(spec);
  if (expected_id != 0 && expected_id != id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace id mismatch: caller computed ", NamespaceName(expected_id), " but the spec \"",
        CanonicalNamespace(spec), "\" hashes to ", NamespaceName(id)));
  }
  uint64_t bytes = BlockBytes(spec);
  if (bytes > max_block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace blocks of ", bytes, " bytes exceed the RAM slab size of ", max_block_bytes,
        " bytes; start kvtier-store with --ram-slab-bytes >= ", bytes));
  }
  std::lock_guard lk(mu_);
  if (auto it = namespaces_.find(id); it != namespaces_.end()) return it->second;
  if (max_namespaces_ != 0 && namespaces_.size() >= max_namespaces_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store holds ", namespaces_.size(), " namespaces, its limit (--max-namespaces ",
        max_namespaces_, "); namespace ", NamespaceName(id), " (", CanonicalNamespace(spec),
        ") is not registered. Remove unused ones with kvctl namespaces rm ID"));
  }
  if (auto s = disk_->PutMeta(kMetaPrefix + NamespaceName(id), SerializeSpec(spec)); !s.ok()) {
    Log("store", "namespace ", NamespaceName(id), " not persisted: ", s.message());
  }
  NamespaceInfo info{id, spec, bytes};
  namespaces_[id] = info;
  Log("store", "registered namespace ", NamespaceName(id), " (", CanonicalNamespace(spec),
      "), blocks of ", bytes, " bytes");
  return info;
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
  namespaces_.erase(it);
  Log("store", "removed namespace ", NamespaceName(id), " (", CanonicalNamespace(info.spec), ")");
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

std::vector<NamespaceInfo> NamespaceRegistry::List() const {
  std::lock_guard lk(mu_);
  std::vector<NamespaceInfo> out;
  out.reserve(namespaces_.size());
  for (const auto& [id, info] : namespaces_) out.push_back(info);
  return out;
}

}  // namespace kvtier::store
