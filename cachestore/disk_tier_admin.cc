// The NVMe tier's operator side (disk_tier.h): its eviction policy, the
// store's metadata column, and its figures.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cachestore/disk_tier.h"

namespace kvtier::store {

absl::Status DiskTier::SetPolicy(const std::string& name,
                                 const std::map<std::string, double>& params) {
  auto p = MakePolicy(name, params);
  if (!p.ok()) return p.status();
  std::lock_guard wl(write_mu_);  // not while a write has victims out of the policy
  std::lock_guard lk(mu_);
  // Seqs are write order: hand the survivors to the new policy in that order.
  std::vector<uint64_t> seqs;
  seqs.reserve(by_seq_.size());
  for (const auto& [seq, k] : by_seq_) seqs.push_back(seq);
  std::sort(seqs.begin(), seqs.end());
  for (uint64_t s : seqs) (*p)->Insert(s);
  policy_ = std::move(*p);
  return absl::OkStatus();
}

std::string DiskTier::policy() const {
  std::lock_guard lk(mu_);
  return policy_->name();
}

std::map<std::string, double> DiskTier::policy_params() const {
  std::lock_guard lk(mu_);
  return policy_->params();
}

absl::Status DiskTier::PutMeta(const std::string& key, const std::string& value) {
  if (auto s = WritesStopped(); !s.ok()) return s;
  WriteBatch b;
  b.Put(Column::kMeta, key, value);
  absl::Status s = backend_->Write(b, /*sync=*/true);
  if (!s.ok()) WriteFailed("writing store metadata", s);
  return s;
}

absl::Status DiskTier::DeleteMeta(const std::string& key) {
  if (auto s = WritesStopped(); !s.ok()) return s;
  WriteBatch b;
  b.Delete(Column::kMeta, key);
  absl::Status s = backend_->Write(b, /*sync=*/true);
  if (!s.ok()) WriteFailed("deleting store metadata", s);
  return s;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> DiskTier::ScanMeta(
    const std::string& prefix) const {
  std::vector<std::pair<std::string, std::string>> out;
  absl::Status s =
      backend_->Scan(Column::kMeta, prefix, [&](absl::string_view k, absl::string_view v) {
        out.emplace_back(std::string(k), std::string(v));
        return true;
      });
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("reading the store's metadata at ",
                                               backend_->location(), ": ", s.message()));
  }
  return out;
}

void DiskTier::WaitIdle() { queue_->WaitIdle(); }

DiskQueueStats DiskTier::QueueStats() const {
  return DiskQueueStats{queue_->blocks(), queue_->bytes(), dropped_.load()};
}

TierSnapshot DiskTier::Snapshot() const {
  TierSnapshot s;
  Fill(counters_, &s);
  s.capacity_bytes = options_.bytes;
  s.policy = policy();
  std::lock_guard lk(degraded_mu_);
  s.degraded = degraded_;
  s.degraded_reason = degraded_reason_;
  return s;
}

}  // namespace kvtier::store
