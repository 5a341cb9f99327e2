// The router's prefix index: block -> the sources holding it (workers on
// GPU, store shards). Not thread-safe: RouterCore guards it.
//
// Memory (docs/router.md, "Memory"): a block is keyed by its 64-bit
// fingerprint (BlockKey::Mix of namespace and 128-bit hash), and its holders
// live inline in the slot (two source numbers; more spill to a side list),
// so a block costs one 16-byte slot plus a control byte -- about 28 bytes at
// the table's typical load. Two distinct blocks with the same fingerprint
// (odds about n^2 / 2^65: 3e-6 at 10 M blocks) would share holders; the
// cost is a route that expects a hit the worker's own exact lookup does not
// find, never a wrong byte.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "common/block_key.h"

namespace kvtier::router {

// A dense number for a source, assigned by RouterCore.
using SourceNum = uint32_t;

// A prompt's block hashes: a vector's, or read in place (from a request)
// through `at`, so a match converts only the ~log n hashes it probes.
class ChainView {
 public:
  ChainView() = default;
  ChainView(std::span<const BlockHash> chain) : data_(chain.data()), n_(chain.size()) {}
  ChainView(const std::vector<BlockHash>& chain) : data_(chain.data()), n_(chain.size()) {}
  ChainView(const void* ctx, size_t n, BlockHash (*at)(const void*, size_t))
      : ctx_(ctx), at_(at), n_(n) {}
  BlockHash operator[](size_t i) const { return data_ != nullptr ? data_[i] : at_(ctx_, i); }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

 private:
  const BlockHash* data_ = nullptr;
  const void* ctx_ = nullptr;
  BlockHash (*at_)(const void*, size_t) = nullptr;
  size_t n_ = 0;
};

struct PrefixMatch {
  // Leading blocks of the chain each worker holds (only workers with >= 1).
  std::vector<std::pair<SourceNum, uint32_t>> gpu_depth;
  // Workers ending at one depth, too many to list (a prefix most of a fleet
  // shares): those holding block `depth - 1` but not block `depth`, not
  // named in gpu_depth (PrefixIndex::InGroup tells them; `workers` counts
  // them when the invariant holds). Valid while the index is unchanged.
  struct Group {
    uint32_t depth = 0;
    const void* before = nullptr;  // the holders of block depth - 1
    const void* after = nullptr;   // the holders of block depth (or null)
    uint32_t workers = 0;
  };
  std::vector<Group> groups;
  // (position, run): blocks held by a store consecutively from `position`,
  // for position 0 and each worker's depth (what a route needs).
  std::vector<std::pair<uint32_t, uint32_t>> store_runs;
  // Blocks some worker or store covers from the start: the deepest worker's
  // depth plus the store's run from there.
  uint32_t walked = 0;
  // Deepest block matched by any worker or store (walked - 1), -1 if none.
  int64_t deepest = -1;
  // Hash-table probes the match made.
  uint32_t probes = 0;

  void Clear() {
    gpu_depth.clear();
    groups.clear();
    store_runs.clear();
    walked = 0;
    deepest = -1;
    probes = 0;
  }
  // The store's run from `position` (0 for a position it was not asked for).
  uint32_t StoreRun(uint32_t position) const {
    for (const auto& [at, run] : store_runs) {
      if (at == position) return run;
    }
    return 0;
  }
};

class PrefixIndex {
 public:
  static uint64_t Fingerprint(const BlockKey& key) { return key.Mix(); }

  // Marks a source as a store shard (or a worker, the default).
  // REQUIRES: the source holds no block.
  void SetStore(SourceNum source, bool store);
  bool IsStore(SourceNum source) const {
    return source < is_store_.size() && is_store_[source] != 0;
  }

  // True if the pair was not there yet.
  bool Add(uint64_t fp, SourceNum source);
  bool Add(const BlockKey& key, SourceNum source) { return Add(Fingerprint(key), source); }
  // Whether `source` holds `fp`.
  bool Has(uint64_t fp, SourceNum source) const {
    auto it = map_.find(fp);
    return it != map_.end() && Holds(&it->second, source);
  }
  // True if the pair was there.
  bool Remove(uint64_t fp, SourceNum source);
  bool Remove(const BlockKey& key, SourceNum source) { return Remove(Fingerprint(key), source); }
  // Drops `source` from every block it holds except those in `keep` (all,
  // when keep is null); returns how many it dropped. One pass over the
  // table: for a source's clear, restart, expiry or snapshot, never for a
  // route or a stored or removed block.
  size_t RemoveSource(SourceNum source, const absl::flat_hash_set<uint64_t>* keep = nullptr);

  // The workers' prefixes of the chain and the store's runs after them in
  // O(log n) probes per distinct depth (docs/router.md, "Matching"). Blocks
  // 0, 1, 3, 7, ... are probed until no worker holds one; between two
  // probes holding different numbers of workers, the interval is halved
  // until each change is one block wide, and the workers holding the block
  // before it but not the block after it end there. Exact when every
  // worker's blocks of the chain are a prefix of it (engines fill front to
  // back and evict from the tail). With holes (the invariant broken) a
  // worker may be reported deeper or shallower than its contiguous prefix,
  // or not at all; a worker reported with depth d always holds block d - 1
  // and lacks block d (d < n). Harmless: the worker's own lookup is exact,
  // so a wrong depth costs a less than ideal route, never a wrong byte. A store's run from a
  // position gallops the same way: exact when the stores' blocks from there are contiguous, never
  // ended by a block a store holds. A change left by more than kGroupFrom workers is reported as a
  // Group, unless `groups` is false (every worker named in gpu_depth).
  static constexpr size_t kGroupFrom = 256;
  void Match(uint64_t ns, const ChainView& chain, PrefixMatch* out, bool groups = true) const;
  // Whether worker `s` belongs to `g` (O(1) for big holder lists).
  bool InGroup(const PrefixMatch::Group& g, SourceNum s) const {
    return !IsStore(s) && Holds(static_cast<const Holders*>(g.before), s) &&
           !Holds(static_cast<const Holders*>(g.after), s);
  }
  // Every worker of every group into gpu_depth (a worker named already is
  // not named again).
  void ExpandGroups(PrefixMatch* m) const;
  // The reference: walks every block from the first while some worker still
  // holds the prefix or a store holds the block (exact with holes too).
  void MatchLinear(uint64_t ns, const ChainView& chain, PrefixMatch* out) const;

  // For each source number, the blocks it alone holds (its only holder,
  // and not a store): (*counts)[num]. One pass over the table: for
  // ListWorkers and metrics, never for a route.
  void SoleHeld(std::vector<uint64_t>* counts) const;

  size_t blocks() const { return map_.size(); }
  size_t replicas() const { return replicas_; }
  // Bytes used by the table (slots, control bytes and spilled holder lists).
  size_t MemoryBytes() const;

 private:
  static constexpr SourceNum kNone = ~SourceNum{0};
  static constexpr SourceNum kSpill = kNone - 1;  // h[1] indexes spill_
  // Up to two holders inline (kNone marks a free place; h[0] is filled
  // first), or {kSpill, index into spill_}.
  struct Holders {
    SourceNum h[2] = {kNone, kNone};
  };
  struct FpHash {
    size_t operator()(uint64_t fp) const { return static_cast<size_t>(fp); }
  };
  // A holder list that outgrew its slot, and how many of it are stores.
  // A holder list that outgrew its slot, and how many of it are stores;
  // from kBitsFrom holders also a bitmap by source number (O(1) membership).
  struct Spill {
    std::vector<SourceNum> list;
    uint32_t stores = 0;
    std::vector<uint64_t> bits;
  };
  static constexpr size_t kBitsFrom = 64;
  static bool Bit(const std::vector<uint64_t>& bits, SourceNum s) {
    return s / 64 < bits.size() && (bits[s / 64] >> (s % 64) & 1) != 0;
  }
  static void SetBit(std::vector<uint64_t>* bits, SourceNum s, bool on) {
    if (s / 64 >= bits->size()) bits->resize(s / 64 + 1, 0);
    if (on)
      (*bits)[s / 64] |= uint64_t{1} << (s % 64);
    else
      (*bits)[s / 64] &= ~(uint64_t{1} << (s % 64));
  }
  bool Holds(const Holders* h, SourceNum s) const {
    if (h == nullptr) return false;
    if (h->h[0] == kSpill) {
      const Spill& sp = spill_[h->h[1]];
      if (!sp.bits.empty()) return Bit(sp.bits, s);
      return std::find(sp.list.begin(), sp.list.end(), s) != sp.list.end();
    }
    return h->h[0] == s || h->h[1] == s;
  }
  std::span<const SourceNum> List(const Holders& h) const {
    if (h.h[0] == kSpill) return spill_[h.h[1]].list;
    return {h.h, static_cast<size_t>(h.h[0] != kNone) + (h.h[1] != kNone)};
  }
  uint32_t Workers(const Holders* h) const {
    if (h == nullptr) return 0;
    if (h->h[0] == kSpill) {
      const Spill& sp = spill_[h->h[1]];
      return static_cast<uint32_t>(sp.list.size()) - sp.stores;
    }
    return (h->h[0] != kNone && !IsStore(h->h[0])) + (h->h[1] != kNone && !IsStore(h->h[1]));
  }
  const Holders* Find(uint64_t ns, const BlockHash& hash, PrefixMatch* out) const;
  // Removes `source` from `h`; true if it was there. Leaves h empty (h[0] ==
  // kNone) when it was the last holder.
  bool Drop(Holders& h, SourceNum source);

  absl::flat_hash_map<uint64_t, Holders, FpHash> map_;
  std::vector<Spill> spill_;
  std::vector<uint8_t> is_store_;  // by SourceNum
  size_t stores_ = 0;
  std::vector<uint32_t> spill_free_;
  size_t replicas_ = 0;
};

}  // namespace kvtier::router
