// Store's inline path: blocks whose bytes travel in the gRPC messages
// themselves (PutBlocks / GetBlocks), for clients without a data plane.
#include "cachestore/store.h"

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"

namespace kvtier::store {

absl::StatusOr<InlinePutResult> Store::PutInline(uint64_t ns, const BlockHash& hash,
                                                 std::string_view data, uint64_t checksum) {
  auto info = CheckRequest(ns, std::span<const BlockHash>(&hash, 1));
  if (!info.ok()) return info.status();
  if (data.size() != info->block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", ToHex(hash), " carries ", data.size(), " bytes; blocks of namespace ",
        NamespaceName(ns), " are ", info->block_bytes, " bytes"));
  }
  uint64_t actual = Checksum(data.data(), data.size());
  if (actual != checksum) {
    commit_checksum_failures_.fetch_add(1);
    return absl::DataLossError(absl::StrFormat(
        "checksum mismatch on block %s: client says %016x, the bytes hash to %016x; not stored",
        ToHex(hash), checksum, actual));
  }
  BlockKey k{ns, hash};
  if (disk_->Contains(k)) return InlinePutResult{InlinePutResult::kAlreadyPresent};
  Slot slot;
  switch (ram_->InsertCopy(k, reinterpret_cast<const uint8_t*>(data.data()), data.size(), checksum,
                           false, false, &slot)) {
    case Placement::kReserved:
      return InlinePutResult{InlinePutResult::kStored};
    case Placement::kPresent:
      return InlinePutResult{InlinePutResult::kAlreadyPresent};
    case Placement::kBusy:
      return absl::AbortedError(absl::StrCat("block ", ToHex(hash),
                                             " is being written by another put lease right now; "
                                             "retry after it commits or expires"));
    case Placement::kNoSpace:
      break;
  }
  return InlinePutResult{InlinePutResult::kNoSpace};
}

absl::Status Store::GetInline(
    uint64_t ns, std::span<const BlockHash> hashes,
    const std::function<bool(uint32_t, TierKind, std::string_view, uint64_t)>& emit) {
  auto info = CheckRequest(ns, hashes);
  if (!info.ok()) return info.status();
  // The call is the fetch: its time is shared by the blocks it served.
  const auto start = std::chrono::steady_clock::now();
  uint64_t served[2] = {0, 0}, served_bytes[2] = {0, 0};
  fetch_meter_.Started();
  absl::Cleanup metered = [&] {
    const auto now = std::chrono::steady_clock::now();
    const uint64_t blocks = served[0] + served[1];
    usage_.Read(ns, hashes.size(), blocks);
    const double took = std::chrono::duration<double>(now - start).count();
    if (blocks)
      fetch_meter_.Fetched(served[FetchMeter::kDisk] ? FetchMeter::kDisk : FetchMeter::kRam, took);
    const double share = blocks ? took / static_cast<double>(blocks) : 0;
    for (int t : {0, 1}) {
      fetch_meter_.Served(static_cast<FetchMeter::Tier>(t), served[t], served_bytes[t],
                          share * served[t], now);
    }
    fetch_meter_.Ended();
  };
  for (uint32_t i = 0; i < hashes.size(); ++i) {
    BlockKey k{ns, hashes[i]};
    if (auto slot = ram_->Pin(k)) {
      served[FetchMeter::kRam]++;
      served_bytes[FetchMeter::kRam] += slot->length;
      bool more =
          emit(i, TierKind::kRam,
               std::string_view(reinterpret_cast<const char*>(ram_->data(*slot)), slot->length),
               slot->checksum);
      ram_->Unpin(k, *slot);
      if (!more) break;
      continue;
    }
    uint64_t checksum;
    auto bytes = disk_->Read(k, &checksum);
    if (!bytes.ok()) {
      // As BeginGet: an I/O error is counted, said, and the get's error
      // when nothing came before it.
      if (absl::IsUnavailable(bytes.status())) {
        absl::Status failed = DiskReadFailed(k, bytes.status());
        if (i == 0) return failed;
      }
      break;
    }
    Slot slot;
    // Promote when there is room; serve from the disk copy either way.
    ram_->InsertCopy(k, reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size(), checksum,
                     false, true, &slot);
    served[FetchMeter::kDisk]++;
    served_bytes[FetchMeter::kDisk] += bytes->size();
    if (!emit(i, TierKind::kDisk, *bytes, checksum)) break;
  }
  return absl::OkStatus();
}

}  // namespace kvtier::store
