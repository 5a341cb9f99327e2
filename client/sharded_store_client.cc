// ShardedStoreClient and RendezvousShard (sharded_store_client.h, which
// states their guarantees): placement of blocks on shards, and merging the
// shards' answers.
#include "client/sharded_store_client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"

#include "client/store_data_client.h"
#include "common/limits.h"
#include "common/rendezvous.h"

namespace kvtier {

namespace {

const BlockHash& HashOf(const BlockHash& h) { return h; }
const BlockHash& HashOf(const PutBlock& b) { return b.hash; }
const BlockHash& HashOf(const GetBlock& b) { return b.hash; }

// Which of `blocks` each shard holds: indices into blocks, in order, so a
// shard's part of a chain is itself a chain.
template <typename Block>
std::vector<std::vector<size_t>> ByShard(uint64_t ns, const std::vector<Block>& blocks,
                                         const std::vector<std::string>& shards) {
  std::vector<std::vector<size_t>> indices(shards.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    indices[RendezvousShard({ns, HashOf(blocks[i])}, shards)].push_back(i);
  }
  return indices;
}

// The blocks at `indices`, in that order.
template <typename Block>
std::vector<Block> Select(const std::vector<Block>& blocks, const std::vector<size_t>& indices) {
  std::vector<Block> out;
  out.reserve(indices.size());
  for (size_t i : indices) out.push_back(blocks[i]);
  return out;
}

// Shard s's part of chain blocks [first, first + count) of `pin`: its
// pinned blocks [from, to) (positions in pin.parts[s] and its pin).
std::pair<size_t, size_t> ShardRun(const ShardedPin& pin, size_t s, uint32_t first,
                                   uint32_t count) {
  const std::vector<size_t>& idx = pin.parts[s];
  const size_t pinned = std::min(idx.size(), pin.pins[s].sources.size());
  size_t from = 0;
  while (from < pinned && idx[from] < first) ++from;
  size_t to = from;
  while (to < pinned && idx[to] < first + count) ++to;
  return {from, to};
}

// INVALID_ARGUMENT unless chain blocks [first, first + count) are pinned
// by `pin` (of `shards` shards); `what`: "read", "view".
absl::Status CheckPinned(const ShardedPin& pin, size_t shards, uint32_t first, uint32_t count,
                         const char* what) {
  if (first > pin.blocks || count > pin.blocks - first || pin.pins.size() != shards) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of blocks [", first, ", ", first + count,
                                                   "); ", pin.blocks, " are pinned"));
  }
  return absl::OkStatus();
}

}  // namespace

size_t RendezvousShard(const BlockKey& key, const std::vector<std::string>& shards) {
  return RendezvousPick(RendezvousKey(key), shards);
}

namespace {
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

ShardedStoreClient::ShardedStoreClient(std::vector<std::string> addresses,
                                       DataClientOptions options)
    : addresses_(std::move(addresses)), options_(options) {
  for (const auto& a : addresses_) {
    shards_.push_back(std::make_unique<StoreDataClient>(a, options));
    // A probe holds the others off for its own deadline and a second more.
    health_.push_back(std::make_unique<ShardSkip>(
        options_.shard_skip_min_ms, options_.shard_skip_max_ms,
        static_cast<uint64_t>(std::max(0, options_.deadline_ms)) + 1000));
    // A budget is shorter than the deadline: its probe holds the others off
    // for one skip.
    slow_.push_back(std::make_unique<ShardSkip>(
        options_.shard_skip_min_ms, options_.shard_skip_max_ms, options_.shard_skip_min_ms));
  }
}

absl::Status ShardedStoreClient::Admit(size_t s, bool budgeted) {
  int64_t left = 0;
  // The budget skip first: a refusal there leaves the other skip's probe alone.
  if (budgeted && !slow_[s]->Admit(NowMs(), &left)) {
    return absl::UnavailableError(absl::StrCat("store shard ", addresses_[s],
                                               " missed a lookup's budget; lookups skip it for "
                                               "another ",
                                               left, " ms"));
  }
  if (health_[s]->Admit(NowMs(), &left)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("store shard ", addresses_[s],
                                             " failed its last call (unreachable); skipped for "
                                             "another ",
                                             left, " ms"));
}

void ShardedStoreClient::Note(size_t s, const absl::Status& status, bool budgeted) {
  const bool out_of_budget = budgeted && status.code() == absl::StatusCode::kDeadlineExceeded;
  // Out of budget: slow, not unreachable. A budgeted answer ends that skip.
  if (out_of_budget || (budgeted && status.ok())) slow_[s]->Note(status, NowMs());
  if (!out_of_budget) health_[s]->Note(status, NowMs());
}

ShardedStoreClient::~ShardedStoreClient() = default;
ShardedStoreClient::ShardedStoreClient(ShardedStoreClient&&) noexcept = default;
ShardedStoreClient& ShardedStoreClient::operator=(ShardedStoreClient&&) noexcept = default;

absl::Status ShardedStoreClient::RegisterMemory(void* addr, size_t length) {
  for (auto& s : shards_) {
    if (auto st = s->RegisterMemory(addr, length); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisteredNamespace> ShardedStoreClient::RegisterNamespace(
    const NamespaceSpec& spec) {
  absl::StatusOr<RegisteredNamespace> r = absl::InvalidArgumentError("no shards");
  for (auto& s : shards_) {
    r = s->control().RegisterNamespace(spec);
    if (!r.ok()) return r;
  }
  return r;
}

absl::StatusOr<uint32_t> ShardedStoreClient::Lookup(uint64_t ns,
                                                    const std::vector<BlockHash>& chain) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, chain, addresses_);
  size_t prefix = chain.size();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    if (absl::Status a = Admit(s); !a.ok()) return a;
    auto tiers = shards_[s]->control().Lookup(ns, Select(chain, parts[s]));
    Note(s, tiers.status());
    if (!tiers.ok()) return tiers.status();
    if (tiers->size() < parts[s].size()) prefix = std::min(prefix, parts[s][tiers->size()]);
  }
  return static_cast<uint32_t>(prefix);
}

absl::StatusOr<std::vector<uint32_t>> ShardedStoreClient::LookupMany(
    uint64_t ns, const std::vector<std::vector<BlockHash>>& chains,
    std::optional<std::chrono::milliseconds> budget) {
  const size_t n = chains.size();
  std::vector<uint32_t> prefix(n);
  // parts[c][s]: chain c's indices on shard s.
  std::vector<std::vector<std::vector<size_t>>> parts(n);
  for (size_t c = 0; c < n; ++c) {
    prefix[c] = static_cast<uint32_t>(chains[c].size());
    parts[c] = ByShard(ns, chains[c], addresses_);
  }
  const auto deadline =
      std::chrono::system_clock::now() +
      budget.value_or(std::chrono::milliseconds(std::max(0, options_.deadline_ms)));
  const bool budgeted = budget.has_value();
  // One batch per shard: the chains with a part there, each part cut to
  // what one request may name (a longer part's prefix then ends at the cut).
  struct Batch {
    std::vector<size_t> chain;                  // chain index of each entry
    std::vector<std::vector<BlockHash>> parts;  // its part on this shard
  };
  std::vector<std::pair<size_t, std::future<absl::StatusOr<std::vector<uint32_t>>>>> calls;
  std::vector<Batch> batches;
  batches.reserve(shards_.size() * 2);
  absl::Status first = absl::OkStatus();
  size_t failed = 0;
  auto fail = [&](size_t s, const Batch& b, const absl::Status& st) {
    if (first.ok()) first = st;
    ++failed;
    for (size_t i = 0; i < b.chain.size(); ++i) {
      const size_t c = b.chain[i];
      prefix[c] = std::min<uint32_t>(prefix[c], static_cast<uint32_t>(parts[c][s][0]));
    }
  };
  std::vector<size_t> batch_shard;
  for (size_t s = 0; s < shards_.size(); ++s) {
    Batch b;
    size_t hashes = 0;
    auto flush = [&] {
      if (b.chain.empty()) return;
      batches.push_back(std::move(b));
      batch_shard.push_back(s);
      b = Batch{};
      hashes = 0;
    };
    for (size_t c = 0; c < n; ++c) {
      const auto& idx = parts[c][s];
      if (idx.empty()) continue;
      const size_t take = std::min(idx.size(), limits::kMaxBlocksPerRequest);
      if (hashes + take > limits::kMaxBlocksPerRequest) flush();
      std::vector<BlockHash> part;
      part.reserve(take);
      for (size_t i = 0; i < take; ++i) part.push_back(chains[c][idx[i]]);
      b.chain.push_back(c);
      b.parts.push_back(std::move(part));
      hashes += take;
    }
    flush();
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    const size_t s = batch_shard[i];
    if (absl::Status a = Admit(s, budgeted); !a.ok()) {
      fail(s, batches[i], a);
      continue;
    }
    calls.emplace_back(i, std::async(std::launch::async, [this, s, ns, deadline, &batches, i] {
                         return shards_[s]->control().LookupChains(ns, batches[i].parts, deadline);
                       }));
  }
  for (auto& [i, f] : calls) {
    const size_t s = batch_shard[i];
    auto r = f.get();
    Note(s, r.status(), budgeted);
    if (!r.ok()) {
      fail(s, batches[i], r.status());
      continue;
    }
    const Batch& b = batches[i];
    for (size_t k = 0; k < b.chain.size(); ++k) {
      const size_t c = b.chain[k];
      const auto& idx = parts[c][s];
      const uint32_t present = (*r)[k];
      if (present < idx.size()) {
        prefix[c] = std::min<uint32_t>(prefix[c], static_cast<uint32_t>(idx[present]));
      }
    }
  }
  if (!batches.empty() && failed == batches.size()) return first;
  return prefix;
}

absl::StatusOr<uint32_t> ShardedStoreClient::VerifyBlocks(uint64_t ns,
                                                          const std::vector<BlockHash>& blocks) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, blocks, addresses_);
  uint32_t dropped = 0;
  absl::Status first = absl::OkStatus();
  for (size_t s = 0; s < shards_.size(); ++s) {  // every shard, whatever one answers
    if (parts[s].empty()) continue;
    absl::StatusOr<uint32_t> d = 0u;
    if (absl::Status a = Admit(s); !a.ok()) {
      d = a;
    } else {
      d = shards_[s]->control().VerifyBlocks(ns, Select(blocks, parts[s]));
      Note(s, d.status());
    }
    if (d.ok()) {
      dropped += *d;
    } else if (first.ok()) {
      first = d.status();
    }
  }
  if (!first.ok()) return first;
  return dropped;
}

absl::StatusOr<PutOutcome> ShardedStoreClient::Put(uint64_t ns, uint64_t block_bytes,
                                                   const std::vector<PutBlock>& blocks) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, blocks, addresses_);
  std::vector<std::pair<size_t, std::future<absl::StatusOr<PutOutcome>>>> futures;
  absl::Status first = absl::OkStatus();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    if (absl::Status a = Admit(s); !a.ok()) {
      if (first.ok()) first = a;
      continue;
    }
    futures.emplace_back(s, shards_[s]->Put(ns, block_bytes, Select(blocks, parts[s])));
  }
  PutOutcome total;
  for (auto& [s, f] : futures) {
    auto r = f.get();
    Note(s, r.status());
    if (!r.ok()) {
      if (first.ok()) first = r.status();
      continue;
    }
    total.written += r->written;
    total.already_present += r->already_present;
    total.busy += r->busy;
    total.no_space += r->no_space;
    total.round_trips += r->round_trips;
    total.bytes_sent += r->bytes_sent;
    total.times += r->times;
  }
  if (!first.ok()) return first;
  return total;
}

absl::StatusOr<GetOutcome> ShardedStoreClient::Get(uint64_t ns, uint64_t block_bytes,
                                                   const std::vector<GetBlock>& blocks) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, blocks, addresses_);
  std::vector<std::pair<size_t, std::future<absl::StatusOr<GetOutcome>>>> futures;
  size_t prefix = blocks.size();
  uint32_t from_disk = 0;
  absl::Status first = absl::OkStatus();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    if (absl::Status a = Admit(s); !a.ok()) {
      if (first.ok()) first = a;
      prefix = std::min(prefix, parts[s][0]);
      continue;
    }
    futures.emplace_back(s, shards_[s]->Get(ns, block_bytes, Select(blocks, parts[s])));
  }
  for (auto& [s, f] : futures) {
    auto r = f.get();
    Note(s, r.status());
    if (!r.ok()) {
      if (first.ok()) first = r.status();
      prefix = std::min(prefix, parts[s][0]);
      continue;
    }
    if (r->blocks < parts[s].size()) prefix = std::min(prefix, parts[s][r->blocks]);
    from_disk += r->from_disk;
  }
  if (!first.ok() && prefix == 0) return first;
  GetOutcome out;
  out.blocks = static_cast<uint32_t>(prefix);
  out.from_disk = from_disk;
  return out;
}

absl::StatusOr<ShardedPin> ShardedStoreClient::Pin(
    uint64_t ns, uint64_t block_bytes, const std::vector<BlockHash>& chain,
    std::optional<std::chrono::milliseconds> budget) {
  ShardedPin pin;
  pin.parts = ByShard(ns, chain, addresses_);
  pin.pins.resize(shards_.size());
  const bool budgeted = budget && *budget < std::chrono::milliseconds(options_.deadline_ms);
  // Every shard at once: the caller's thread asks the first, threads the rest.
  std::vector<std::pair<size_t, std::future<absl::StatusOr<PinnedBlocks>>>> others;
  std::vector<absl::StatusOr<PinnedBlocks>> got(shards_.size(), PinnedBlocks{});
  size_t first = shards_.size();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (pin.parts[s].empty()) continue;
    if (absl::Status a = Admit(s, budgeted); !a.ok()) {
      got[s] = a;
      continue;
    }
    if (first == shards_.size()) {
      first = s;
      continue;
    }
    others.emplace_back(
        s, std::async(std::launch::async, [this, s, ns, block_bytes, &chain, &pin, budget] {
          return shards_[s]->Pin(ns, block_bytes, Select(chain, pin.parts[s]), budget);
        }));
  }
  if (first < shards_.size()) {
    got[first] = shards_[first]->Pin(ns, block_bytes, Select(chain, pin.parts[first]), budget);
    Note(first, got[first].status(), budgeted);
  }
  for (auto& [s, f] : others) {
    got[s] = f.get();
    Note(s, got[s].status(), budgeted);
  }
  // A shard that failed holds nothing: the prefix ends before its first block.
  absl::Status failed = absl::OkStatus();
  size_t prefix = chain.size();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (!got[s].ok()) {
      if (failed.ok()) failed = got[s].status();
      prefix = std::min(prefix, pin.parts[s][0]);
      continue;
    }
    pin.pins[s] = std::move(*got[s]);
    pin.control_ms = std::max(pin.control_ms, pin.pins[s].control_ms);
    const size_t n = pin.pins[s].sources.size();
    if (n < pin.parts[s].size()) prefix = std::min(prefix, pin.parts[s][n]);
  }
  if (!failed.ok() && prefix == 0) {
    Release(pin);
    return failed;
  }
  pin.blocks = static_cast<uint32_t>(prefix);
  for (size_t s = 0; s < shards_.size(); ++s) {
    for (size_t k = 0; k < pin.pins[s].sources.size() && pin.parts[s][k] < prefix; ++k) {
      pin.from_disk += pin.pins[s].sources[k].from_disk;
    }
  }
  return pin;
}

absl::StatusOr<Reservation> ShardedStoreClient::Reserve(
    uint64_t ns, uint64_t block_bytes, const std::vector<BlockHash>& hashes,
    std::optional<std::chrono::milliseconds> budget) {
  std::vector<std::vector<size_t>> parts = ByShard(ns, hashes, addresses_);
  Reservation out;
  out.slots.assign(hashes.size(), nullptr);
  // Every shard involved must be mapped here before any is asked: a mix
  // would reserve on some and give the slots back on every run.
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (!parts[s].empty() && !shards_[s]->ArenaMapped()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "store ", addresses_[s], "'s arena is not mapped in this process; put instead"));
    }
  }
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    // A refusal here is no call to the shard: it says nothing new of it
    // (noting it would push its skip on, and no probe would ever come).
    if (absl::Status a = Admit(s); !a.ok()) {
      Abort(out);
      return a;
    }
    absl::StatusOr<Reservation> r =
        shards_[s]->Reserve(ns, block_bytes, Select(hashes, parts[s]), budget);
    if (!r.ok()) {
      // A missed budget says the shard is slow right now, not unreachable;
      // FAILED_PRECONDITION (not mapped, restarted) made no call to it.
      const auto code = r.status().code();
      if (!(budget && code == absl::StatusCode::kDeadlineExceeded) &&
          code != absl::StatusCode::kFailedPrecondition) {
        Note(s, r.status());
      }
      Abort(out);
      return r.status();
    }
    Note(s, absl::OkStatus());
    for (size_t k = 0; k < parts[s].size(); ++k) out.slots[parts[s][k]] = r->slots[k];
    for (Reservation::Lease& lease : r->leases) {
      lease.shard = s;
      for (size_t& b : lease.blocks) b = parts[s][b];
      out.leases.push_back(std::move(lease));
    }
    out.already_present += r->already_present;
    out.busy += r->busy;
    out.no_space += r->no_space;
    out.control_ms = std::max(out.control_ms, r->control_ms);
    for (auto& region : r->regions) out.regions.push_back(std::move(region));
  }
  return out;
}

absl::StatusOr<uint32_t> ShardedStoreClient::Commit(const Reservation& r,
                                                    const std::vector<uint64_t>& checksums) {
  uint32_t committed = 0;
  absl::Status first = absl::OkStatus();
  for (const Reservation::Lease& lease : r.leases) {
    std::vector<uint64_t> sums;  // empty: the store hashes them
    if (!checksums.empty()) {
      for (size_t b : lease.blocks) sums.push_back(b < checksums.size() ? checksums[b] : 0);
    }
    auto n = shards_[lease.shard]->CommitReserved(lease.id, sums);
    Note(lease.shard, n.status());
    if (n.ok()) {
      committed += *n;
      continue;
    }
    // The store released a lease whose bytes failed their checksums; any
    // other failure may have left its slots reserved: give them back.
    if (n.status().code() != absl::StatusCode::kDataLoss) {
      shards_[lease.shard]->AbortReserved(lease.id);
    }
    if (first.ok()) first = n.status();
  }
  if (!first.ok()) return first;
  return committed;
}

void ShardedStoreClient::Abort(const Reservation& r) {
  for (const Reservation::Lease& lease : r.leases) shards_[lease.shard]->AbortReserved(lease.id);
}

void ShardedStoreClient::Warm(std::chrono::milliseconds wait) {
  std::vector<std::future<absl::StatusOr<GetOutcome>>> connects;
  for (auto& shard : shards_) connects.push_back(shard->Warm());
  const auto until = std::chrono::steady_clock::now() + wait;
  for (auto& c : connects) c.wait_until(until);
}

absl::StatusOr<BlockViews> ShardedStoreClient::View(const ShardedPin& pin, uint64_t block_bytes,
                                                    uint32_t first, uint32_t count) {
  if (auto bad = CheckPinned(pin, shards_.size(), first, count, "view"); !bad.ok()) return bad;
  BlockViews out;
  out.blocks.assign(count, nullptr);
  out.checksums.assign(count, 0);
  for (size_t s = 0; s < shards_.size(); ++s) {
    const std::vector<size_t>& idx = pin.parts[s];
    const auto [from, to] = ShardRun(pin, s, first, count);
    if (to == from) continue;
    auto part = shards_[s]->View(pin.pins[s], block_bytes, from, to - from);
    if (!part.ok()) return part.status();
    for (size_t k = from; k < to; ++k) {
      out.blocks[idx[k] - first] = part->blocks[k - from];
      out.checksums[idx[k] - first] = part->checksums[k - from];
    }
    out.from_disk += part->from_disk;
    for (auto& r : part->regions) out.regions.push_back(std::move(r));
  }
  for (uint32_t i = 0; i < count; ++i) {
    if (out.blocks[i] == nullptr) {
      return absl::InternalError(absl::StrCat("block ", first + i, " of the pin is on no shard"));
    }
  }
  return out;
}

absl::StatusOr<GetOutcome> ShardedStoreClient::Read(const ShardedPin& pin, uint64_t block_bytes,
                                                    uint32_t first, uint32_t count,
                                                    const ReadPlan& plan) {
  if (auto bad = CheckPinned(pin, shards_.size(), first, count, "read"); !bad.ok()) return bad;
  // on_segment(s) once every shard that reads has landed segment s, in order.
  struct Join {
    std::mutex mu;
    std::vector<size_t> remaining;  // shards yet to land each segment
    size_t next = 0;
  };
  auto join = std::make_shared<Join>();
  const size_t segments = plan.bounds.empty() ? 1 : plan.bounds.size() - 1;
  // Each shard's part of [first, first + count): a run of its pinned blocks.
  std::vector<std::pair<size_t, size_t>> runs(shards_.size(), {0, 0});  // (from, n)
  size_t readers = 0;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const auto [from, to] = ShardRun(pin, s, first, count);
    runs[s] = {from, to - from};
    readers += to > from;
  }
  join->remaining.assign(segments, readers);
  std::vector<std::pair<size_t, std::future<absl::StatusOr<GetOutcome>>>> futures;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (runs[s].second == 0) continue;
    ReadPlan part;
    part.bounds = plan.bounds;
    const std::vector<size_t>& idx = pin.parts[s];
    part.dest = [&plan, &idx](size_t k, size_t seg) { return plan.dest(idx[k], seg); };
    if (plan.on_segment) {
      part.on_segment = [join, &plan](size_t seg) {
        std::lock_guard lk(join->mu);
        --join->remaining[seg];
        while (join->next < join->remaining.size() && join->remaining[join->next] == 0) {
          plan.on_segment(join->next++);
        }
      };
    }
    futures.emplace_back(s, shards_[s]->Read(pin.pins[s], block_bytes, runs[s].first,
                                             runs[s].second, std::move(part)));
  }
  GetOutcome total;
  absl::Status failed = absl::OkStatus();
  for (auto& [s, f] : futures) {  // every one: the plan must outlive the reads
    auto r = f.get();
    Note(s, r.status());
    if (!r.ok()) {
      if (failed.ok()) failed = r.status();
      continue;
    }
    total.blocks += r->blocks;
    total.from_disk += r->from_disk;
    total.times += r->times;
  }
  if (!failed.ok()) return failed;
  return total;
}

void ShardedStoreClient::Release(ShardedPin& pin) {
  for (size_t s = 0; s < pin.pins.size() && s < shards_.size(); ++s) {
    shards_[s]->Release(pin.pins[s].lease);
    pin.pins[s].lease = 0;
  }
}

}  // namespace kvtier
