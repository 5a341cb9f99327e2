// What an operator asks of the store, and what its stop does: verifying
// blocks a client reported, evicting, the tiers' policies, the figures, and
// writing the RAM tier to NVMe before a restart (kvtier-store
// --persist-on-stop). The data path is in store.cc and store_inline.cc.
#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cachestore/store.h"
#include "common/checksum.h"
#include "common/log.h"

namespace kvtier::store {

Store::Persisted Store::PersistRam(std::chrono::steady_clock::time_point deadline) {
  Persisted p;
  disk_->WaitIdle();
  const std::vector<BlockKey> keys = ram_->ReadyKeys();
  std::string bytes;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!p.error.ok() || std::chrono::steady_clock::now() >= deadline) {
      p.left = keys.size() - i;
      break;
    }
    uint64_t checksum = 0;
    if (disk_->Contains(keys[i])) {
      ++p.already;
    } else if (ram_->CopyOut(keys[i], &bytes, &checksum)) {
      p.error = disk_->Write(keys[i], reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                             checksum);
      if (p.error.ok())
        ++p.written;
      else
        ++p.left;
    }
  }
  return p;
}

absl::StatusOr<VerifyResult> Store::VerifyBlocks(uint64_t ns, std::span<const BlockHash> hashes) {
  auto info = CheckRequest(ns, hashes);
  if (!info.ok()) return info.status();
  VerifyResult r;
  std::vector<std::pair<BlockKey, uint64_t>> corrupt;  // key, the slot that failed
  for (const BlockHash& h : hashes) {
    const BlockKey key{ns, h};
    // Pinned while hashed, so the slot is neither evicted nor reused
    // meanwhile (the pin counts as a read in the tier's figures).
    auto slot = ram_->Pin(key);
    if (!slot) continue;
    ++r.checked;
    if (Checksum(ram_->data(*slot), slot->length) != slot->checksum) {
      corrupt.emplace_back(key, slot->offset);
    }
    ram_->Unpin(key, *slot);
  }
  if (!corrupt.empty()) {
    // Only the copies that failed (not one put again since), and their NVMe
    // copies too: a demotion queued from the bad bytes would bring them back.
    EraseCounts c = ram_->EraseAt(corrupt);
    std::vector<BlockKey> keys;
    for (const auto& [key, offset] : corrupt) keys.push_back(key);
    disk_->Erase(keys);
    r.dropped = static_cast<uint32_t>(c.erased + c.pinned);
    Log("store", "dropped ", r.dropped, " corrupt RAM block(s) of namespace ", NamespaceName(ns),
        " a client reported (", c.pinned, " freed once their readers let go)");
  }
  return r;
}

absl::StatusOr<EvictResult> Store::EvictAll() {
  EraseCounts r = ram_->EraseAll();
  EraseCounts d = disk_->EraseAll();
  Log("store", "evicted all: ", r.erased, " RAM blocks, ", d.erased, " disk blocks, ", r.pinned,
      " pinned");
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::StatusOr<EvictResult> Store::EvictNamespace(uint64_t ns) {
  if (auto info = namespaces_->Find(ns); !info.ok()) return info.status();
  EraseCounts r = ram_->EraseNamespace(ns);
  EraseCounts d = disk_->EraseNamespace(ns);
  Log("store", "evicted namespace ", NamespaceName(ns), ": ", r.erased, " RAM blocks, ", d.erased,
      " disk blocks, ", r.pinned, " pinned");
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::StatusOr<EvictResult> Store::RemoveNamespace(uint64_t ns) {
  // Forgotten first: no new put or get names it while its blocks go.
  if (auto info = namespaces_->Remove(ns); !info.ok()) return info.status();
  EraseCounts r = ram_->EraseNamespace(ns);
  EraseCounts d = disk_->EraseNamespace(ns);
  Log("store", "dropped removed namespace ", NamespaceName(ns), "'s blocks: ", r.erased, " RAM, ",
      d.erased, " disk, ", r.pinned, " pinned");
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::StatusOr<EvictResult> Store::EvictKeys(std::span<const BlockKey> keys) {
  if (keys.empty()) return absl::InvalidArgumentError("evict names no keys");
  if (keys.size() > kMaxBlocksPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat("evict names ", keys.size(), " keys; the limit is ", kMaxBlocksPerRequest));
  }
  std::vector<BlockKey> v(keys.begin(), keys.end());
  EraseCounts r = ram_->Erase(v);
  EraseCounts d = disk_->Erase(v);
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::Status Store::SetPolicy(TierKind tier, const std::string& name,
                              const std::map<std::string, double>& params) {
  absl::Status s = TierFor(tier).SetPolicy(name, params);
  if (s.ok()) Log("store", tier == TierKind::kRam ? "ram" : "disk", " policy set to ", name);
  return s;
}

std::pair<std::string, std::map<std::string, double>> Store::GetPolicy(TierKind tier) const {
  const Tier& t = TierFor(tier);
  return {t.policy(), t.policy_params()};
}

StoreStats Store::Stats() const {
  StoreStats s;
  s.ram = ram_->Snapshot();
  s.disk = disk_->Snapshot();
  s.queue = disk_->QueueStats();
  LeaseCounts leases = leases_->counts();
  s.put_leases = leases.put;
  s.get_leases = leases.get;
  s.leases_expired = leases.expired;
  s.checksum_failures = commit_checksum_failures_.load() + disk_->checksum_failures();
  s.disk_read_errors = disk_read_errors_.load();
  return s;
}

}  // namespace kvtier::store
