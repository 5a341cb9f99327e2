// StoreDataClient's read of pinned blocks, on a lane or through the store's
// arena mapped here: segments posted in a window, each block's checksum
// summed as its bytes land (or, for a large copy through the mapping, on a
// second thread beside the copy).
#include <algorithm>
#include <atomic>
#include <optional>
#include <system_error>
#include <thread>

#include "client/data_plane_connection.h"
#include "client/store_data_detail.h"
#include "common/checksum.h"
#include "common/elapsed.h"
#include "common/parallel.h"

namespace kvtier {

namespace {

// Pieces a copying transport copies and then sums while they are in cache.
constexpr uint64_t kHashPieceBytes = 16 << 10;

// Reads at least this large from a mapped arena sum on a second thread while
// the caller copies. Measured on this VM: copying from memory runs at 10-16
// GB/s and XXH3 at ~30, so in turn they run at ~2/3 of the copy's rate,
// side by side at its rate (a 64 MiB load: 7.1 ms, then 5.3). Smaller reads
// are mostly in cache, where the copy is as fast as the sum and reading the
// pieces from the other core's cache (and starting the thread) cost more
// than they save (a 4 MiB load: 0.23 ms in turn, 0.3-0.5 side by side).
constexpr uint64_t kSumAsideBytes = 8ull << 20;

// Reads copying through a mapped arena in this process right now. A read
// sums aside only while it is the only one: two reads copying at once
// already keep two cores busy, and a summing thread each only took turns
// with them (measured: 32-block gets on two lanes fell from memcpy's rate
// to 0.65-0.8 of it).
std::atomic<int> copying_reads{0};

// Cores this process may run on, read once (glibc reads sysfs for it).
const unsigned kCores = std::thread::hardware_concurrency();

// Sums, on a thread of its own, the pieces a copying read hands it, in the
// order handed (so each block's stream gets its bytes in order).
class SumAside {
 public:
  // REQUIRES: at most `max_pieces` pieces are handed.
  explicit SumAside(size_t max_pieces) : pieces_(max_pieces), thread_([this] { Run(); }) {}
  ~SumAside() { Finish(); }
  SumAside(const SumAside&) = delete;
  SumAside& operator=(const SumAside&) = delete;

  // Hands a copied piece over; `sum` must not be touched until Finish.
  void Add(ChecksumStream* sum, const uint8_t* data, size_t len) {
    const size_t k = added_.load(std::memory_order_relaxed);
    pieces_[k] = {sum, data, len};
    added_.store(k + 1, std::memory_order_release);
  }

  // Returns once every piece handed over is summed.
  void Finish() {
    if (!thread_.joinable()) return;
    finished_.store(true, std::memory_order_release);
    thread_.join();
  }

 private:
  struct Piece {
    ChecksumStream* sum;
    const uint8_t* data;
    size_t len;
  };
  void Run() {
    size_t done = 0;
    for (;;) {
      // Read `finished_` first: once it is set, `added_` is final.
      const bool last = finished_.load(std::memory_order_acquire);
      const size_t ready = added_.load(std::memory_order_acquire);
      for (; done < ready; ++done) pieces_[done].sum->Update(pieces_[done].data, pieces_[done].len);
      if (last) return;
      if (done == ready) std::this_thread::yield();  // ahead of the copy
    }
  }
  std::vector<Piece> pieces_;
  std::atomic<size_t> added_{0};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// Bytes of a read's segments kept in flight ahead of the one waited for.
constexpr uint64_t kReadWindowBytes = 4ull << 20;

}  // namespace

template <typename Transport>
absl::StatusOr<GetOutcome> StoreDataClient::ReadVia(Transport& lane, const Deadline& deadline,
                                                    const PinnedBlocks& pinned,
                                                    uint64_t block_bytes, size_t first,
                                                    size_t count, const ReadPlan& plan) {
  GetOutcome out;
  if (count == 0) return out;
  // Addresses mean something only in the store instance that pinned them.
  if (auto s = lane.EnsureInstance(pinned.instance, deadline.rpcs); !s.ok()) return s;
  if (std::chrono::steady_clock::now() >= pinned.expires) {
    return absl::FailedPreconditionError(
        absl::StrCat("lease ", pinned.lease, " expired before the read; pin the blocks again"));
  }
  const std::vector<uint64_t> whole = {0, block_bytes};
  const std::vector<uint64_t>& bounds = plan.bounds.empty() ? whole : plan.bounds;
  const size_t segments = bounds.size() - 1;
  // Segments are posted in order (a layer-wise load gets layer 0 of every
  // block first). The first goes alone, so it lands as early as it can even
  // on a transport that moves bytes as they are posted (CMA); after it, a
  // window of segments is in flight: enough bytes to keep the transport busy.
  const auto rma_start = std::chrono::steady_clock::now();
  std::vector<std::vector<void*>> reqs(segments);
  std::vector<void*> dests(count * segments);
  uint64_t window_bytes = 0;
  size_t posted = 0;  // segments posted so far
  // Each segment is summed as it lands, while the later ones are in flight;
  // a transport that copies as it posts (the mapped arena) has each piece
  // summed right after it is copied, while its bytes are in cache.
  const bool copies_at_post = lane.CopiesAtPost();
  std::vector<ChecksumStream> sums(count);
  double sum_ms = 0;
  std::optional<SumAside> aside;
  if (copies_at_post) copying_reads.fetch_add(1, std::memory_order_relaxed);
  struct Uncount {
    bool counted;
    ~Uncount() {
      if (counted) copying_reads.fetch_sub(1, std::memory_order_relaxed);
    }
  } uncount{copies_at_post};
  if (copies_at_post && count * block_bytes >= kSumAsideBytes &&
      copying_reads.load(std::memory_order_relaxed) == 1 && kCores > 1) {
    size_t pieces = 0;
    for (size_t s = 0; s < segments; ++s) {
      pieces += count * ((bounds[s + 1] - bounds[s] + kHashPieceBytes - 1) / kHashPieceBytes);
    }
    try {
      aside.emplace(pieces);
    } catch (const std::system_error&) {  // no thread to be had: sum in turn
      aside.reset();
    }
  }
  auto post = [&](size_t s) {
    const uint64_t len = bounds[s + 1] - bounds[s];
    reqs[s].reserve(count);
    for (size_t i = 0; i < count; ++i) {
      auto* d = static_cast<uint8_t*>(plan.dest(first + i, s));
      dests[i * segments + s] = d;
      const uint64_t from = pinned.sources[first + i].remote_addr + bounds[s];
      if (!copies_at_post) {
        reqs[s].push_back(lane.PostGet(d, len, from, pinned.lease));
        continue;
      }
      for (uint64_t off = 0; off < len; off += kHashPieceBytes) {
        const uint64_t n = std::min(kHashPieceBytes, len - off);
        reqs[s].push_back(lane.PostGet(d + off, n, from + off, pinned.lease));
        if (reqs[s].back() != nullptr) continue;  // not copied (outside the arena)
        if (aside) {
          aside->Add(&sums[i], d + off, n);
        } else {
          sums[i].Update(d + off, n);  // copied: sum it now
        }
      }
    }
    window_bytes += len * count;
  };
  auto fill_window = [&](size_t waiting) {
    while (posted < segments &&
           (posted <= waiting ||
            (waiting > 0 && (posted <= waiting + 1 || window_bytes < kReadWindowBytes)))) {
      post(posted++);
    }
  };
  absl::Status moved = absl::OkStatus();
  for (size_t s = 0; s < segments; ++s) {
    if (moved.ok()) fill_window(s);
    if (s >= posted) break;  // failed: nothing later was posted
    // After a failure the endpoint is closed: what was posted completes
    // (with errors) at once, and nothing may still write into the caller's
    // memory.
    const uint64_t len = bounds[s + 1] - bounds[s];
    if (copies_at_post) {  // summed as copied (the time is in rma_ms)
      absl::Status st = lane.Wait(reqs[s], deadline.transfers);
      if (moved.ok()) moved = st;
    } else {
      // Block by block, each summed as soon as it lands, while its bytes
      // are still in cache and the later blocks keep arriving (the kernel
      // buffers them meanwhile). Summing a whole batch after it landed read
      // it back from memory and stalled the transfer for as long.
      std::vector<void*> one(1);
      for (size_t i = 0; i < count; ++i) {
        one[0] = reqs[s][i];
        absl::Status st = lane.Wait(one, deadline.transfers);
        reqs[s][i] = nullptr;
        if (moved.ok()) moved = st;
        if (!moved.ok()) continue;
        const auto sum_start = std::chrono::steady_clock::now();
        sums[i].Update(dests[i * segments + s], len);
        sum_ms += MsSince(sum_start);
      }
    }
    window_bytes -= len * count;
    if (!moved.ok()) continue;
    if (plan.on_segment) plan.on_segment(s);
  }
  if (aside) aside->Finish();  // summed beside the copy (the time is in rma_ms)
  out.times.rma_ms = MsSince(rma_start) - sum_ms;
  out.times.checksum_ms = sum_ms;
  if (!moved.ok()) return moved;
  for (size_t i = 0; i < count; ++i) {
    if (sums[i].Digest() != pinned.sources[first + i].checksum) {
      return absl::DataLossError(absl::StrCat("block ", first + i, " from store ", address_,
                                              " failed its checksum; not used"));
    }
    out.blocks++;
    if (pinned.sources[first + i].from_disk) out.from_disk++;
  }
  return out;
}

std::vector<uint64_t> SumBlocks(const std::vector<const uint8_t*>& blocks, uint64_t block_bytes,
                                int threads) {
  std::vector<uint64_t> sums(blocks.size(), 0);
  // Below a few MiB a thread's start costs more than it saves.
  ParallelFor(blocks.size(), blocks.size() * block_bytes, 4ull << 20, threads,
              [&](size_t i) { sums[i] = Checksum(blocks[i], block_bytes); });
  return sums;
}

size_t VerifyViews(const BlockViews& views, uint64_t block_bytes, int threads) {
  const std::vector<uint64_t> sums = SumBlocks(views.blocks, block_bytes, threads);
  size_t leading = 0;
  while (leading < sums.size() && leading < views.checksums.size() &&
         sums[leading] == views.checksums[leading]) {
    ++leading;
  }
  return leading;
}

template absl::StatusOr<GetOutcome> StoreDataClient::ReadVia<DataPlaneConnection>(
    DataPlaneConnection&, const Deadline&, const PinnedBlocks&, uint64_t, size_t, size_t,
    const ReadPlan&);
template absl::StatusOr<GetOutcome> StoreDataClient::ReadVia<store_data_detail::MappedReads>(
    store_data_detail::MappedReads&, const Deadline&, const PinnedBlocks&, uint64_t, size_t, size_t,
    const ReadPlan&);

}  // namespace kvtier
