#include "worker/page_pool.h"

#include <cstdlib>
#include <cstring>

#include "common/huge_pages.h"

namespace kvtier::worker {

PagePool::PagePool(const gpu::KvLayout& layout) : layout_(layout), pages_(layout.num_pages) {
  for (uint32_t l = 0; l < layout_.layers; ++l) {
    // Huge pages where the kernel gives them (common/huge_pages.h): a load
    // copies into pages scattered over every layer, and with 4 KiB pages
    // each piece missed the TLB (a nested page walk in a VM). Measured: 4 MiB
    // loads from a mapped store copied at 7-12 GB/s into 4 KiB pages.
    const size_t bytes = (layout_.layer_bytes() + 4095) / 4096 * 4096;
    auto* p = static_cast<uint8_t*>(bytes >= (2u << 20) ? AllocateHugePageBacked(bytes)
                                                        : std::aligned_alloc(4096, bytes));
    std::memset(p, 0, bytes);  // touch it now, not on the data path
    bases_.push_back(p);
  }
  for (uint64_t i = layout_.num_pages; i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
}

PagePool::~PagePool() {
  for (uint8_t* p : bases_) std::free(p);
}

std::vector<std::pair<uint8_t*, size_t>> PagePool::regions() const {
  std::vector<std::pair<uint8_t*, size_t>> r;
  for (uint8_t* p : bases_) r.emplace_back(p, layout_.layer_bytes());
  return r;
}

void PagePool::RemoveFromLruLocked(Page& p) {
  if (p.in_lru) {
    lru_.erase(p.lru);
    p.in_lru = false;
  }
}

size_t PagePool::Match(const std::vector<BlockHash>& chain) const {
  std::lock_guard lk(mu_);
  size_t n = 0;
  while (n < chain.size() && index_.count(chain[n])) ++n;
  return n;
}

std::vector<uint32_t> PagePool::MatchAndRef(const std::vector<BlockHash>& chain) {
  std::lock_guard lk(mu_);
  std::vector<uint32_t> out;
  for (const auto& h : chain) {
    auto it = index_.find(h);
    if (it == index_.end()) break;
    Page& p = pages_[it->second];
    RemoveFromLruLocked(p);
    ++p.refs;
    ++p.hits;
    out.push_back(it->second);
  }
  return out;
}

std::optional<uint32_t> PagePool::Allocate() {
  std::unique_lock lk(mu_);
  uint32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    id = lru_.back();
    Page& p = pages_[id];
    RemoveFromLruLocked(p);
    index_.erase(p.hash);
    ++evictions_;
    // Offload hook: the page's bytes are intact until we hand it out below.
    p.state = State::kFilling;
    p.refs = 1;
    BlockHash h = p.hash;
    lk.unlock();
    if (on_evict_) on_evict_(h, id);
    return id;
  } else {
    return std::nullopt;
  }
  Page& p = pages_[id];
  p.state = State::kFilling;
  p.refs = 1;
  return id;
}

uint32_t PagePool::Commit(const BlockHash& hash, uint32_t page) {
  std::lock_guard lk(mu_);
  auto it = index_.find(hash);
  if (it != index_.end() && it->second != page) {
    // Someone cached the same block meanwhile: keep theirs.
    Page& mine = pages_[page];
    mine.state = State::kFree;
    mine.refs = 0;
    free_.push_back(page);
    Page& theirs = pages_[it->second];
    RemoveFromLruLocked(theirs);
    ++theirs.refs;
    return it->second;
  }
  Page& p = pages_[page];
  p.state = State::kCached;
  p.hash = hash;
  p.hits = 0;
  index_[hash] = page;
  return page;
}

void PagePool::Discard(uint32_t page) {
  std::lock_guard lk(mu_);
  Page& p = pages_[page];
  if (p.state != State::kFilling) return;
  p.state = State::kFree;
  p.refs = 0;
  free_.push_back(page);
}

void PagePool::Ref(uint32_t page) {
  std::lock_guard lk(mu_);
  Page& p = pages_[page];
  RemoveFromLruLocked(p);
  ++p.refs;
}

bool PagePool::RefIfHolds(uint32_t page, const BlockHash& hash) {
  std::lock_guard lk(mu_);
  if (page >= pages_.size()) return false;
  Page& p = pages_[page];
  if (p.state != State::kCached || !(p.hash == hash)) return false;
  RemoveFromLruLocked(p);
  ++p.refs;
  return true;
}

void PagePool::Unref(uint32_t page) {
  std::lock_guard lk(mu_);
  Page& p = pages_[page];
  if (p.refs == 0) return;
  if (--p.refs > 0) return;
  if (p.state == State::kCached) {
    lru_.push_front(page);
    p.lru = lru_.begin();
    p.in_lru = true;
  } else if (p.state == State::kFilling) {
    p.state = State::kFree;
    free_.push_back(page);
  }
}

std::vector<PagePool::CachedBlock> PagePool::CachedByValue() const {
  std::vector<CachedBlock> out;
  std::lock_guard lk(mu_);
  out.reserve(index_.size());
  // Referenced pages first (in use: the most recent), then the LRU from
  // its front.
  for (const auto& [hash, page] : index_) {
    if (pages_[page].refs > 0) out.push_back({hash, page, pages_[page].hits, 0});
  }
  uint64_t rank = 1;
  for (uint32_t page : lru_) out.push_back({pages_[page].hash, page, pages_[page].hits, rank++});
  std::stable_sort(out.begin(), out.end(), [](const CachedBlock& a, const CachedBlock& b) {
    return a.hits != b.hits ? a.hits > b.hits : a.recency < b.recency;
  });
  return out;
}

PagePool::Counters PagePool::counters() const {
  std::lock_guard lk(mu_);
  Counters c;
  c.free = free_.size();
  c.cached = index_.size();
  for (const auto& p : pages_) c.referenced += p.refs > 0;
  c.evictions = evictions_;
  return c;
}

}  // namespace kvtier::worker
