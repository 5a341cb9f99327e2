// StoreDataClient's put on one lane: BeginPut (on the data plane where it
// can travel), the blocks' bytes by RMA, CommitPut right behind them.
#include <algorithm>
#include <atomic>
#include <random>

#include "client/data_plane_connection.h"
#include "client/store_data_detail.h"
#include "common/checksum.h"
#include "common/elapsed.h"
#include "common/rpc/proto_convert.h"
#include "common/ucx/calls.h"

namespace kvtier {

using store_data_detail::Call;

namespace {

const BlockHash& HashOf(const BlockHash& h) { return h; }
const BlockHash& HashOf(const PutBlock& b) { return b.hash; }

// BeginPut of the blocks' (or the hashes') hashes.
// A writer that stops waiting for the answer gives the call up by `token`.
template <typename Block>
v1::BeginPutRequest BeginPutOf(uint64_t ns, const std::string& client, uint64_t token,
                               const std::vector<Block>& blocks) {
  v1::BeginPutRequest req;
  req.set_namespace_id(ns);
  req.set_client_id(client);
  req.set_abandon_token(token);
  for (const auto& b : blocks) ToProto(HashOf(b), req.add_hashes());
  return req;
}

// Counts a target the store did not reserve into `out` (the store has the
// block, another writer has it in flight, or no room); false for a
// reserved one, which the caller handles.
template <typename Counts>
bool CountedUnreserved(const v1::PutTarget& t, Counts& out) {
  switch (t.disposition()) {
    case v1::PUT_RESERVED:
      return false;
    case v1::PUT_ALREADY_PRESENT:
      out.already_present++;
      break;
    case v1::PUT_BUSY:
      out.busy++;
      break;
    default:
      out.no_space++;
      break;
  }
  return true;
}

}  // namespace

absl::StatusOr<Reservation> StoreDataClient::Reserve(
    uint64_t ns, uint64_t block_bytes, const std::vector<BlockHash>& hashes,
    std::optional<std::chrono::milliseconds> budget) {
  const std::string prefix = absl::StrCat("reserve in store ", address_, ": ");
  Reservation out;
  if (hashes.empty()) return out;
  // No probe: a save does not wait for a connect (Warm makes one early).
  auto known = KnownMapping(/*probe=*/false);
  if (!known.ok()) return Prefixed(known.status(), prefix);
  std::shared_ptr<ArenaMapping> mapped = std::move(*known);
  if (!mapped) {
    return absl::FailedPreconditionError(
        absl::StrCat(prefix, "its arena is not mapped in this process; put the blocks instead"));
  }
  auto wait = std::chrono::milliseconds(options_.deadline_ms);
  if (budget && *budget < wait) wait = *budget;
  const auto start = std::chrono::steady_clock::now();
  auto req = BeginPutOf(ns, options_.client_id, NewPutToken(), hashes);
  v1::BeginPutResponse resp;
  // Over gRPC, whose deadline travels with the call: a store that gets it
  // after the caller gave up refuses it rather than reserve slots nobody
  // will fill. gRPC's deadline is relative, counted from when the store
  // reads the call: a call that waited out a stall in the store's socket
  // looks fresh then, so the caller also gives it up by its token.
  if (auto s = Call(control_, &v1::Store::Stub::BeginPut, req, &resp,
                    std::chrono::system_clock::now() + wait);
      !s.ok()) {
    GiveUpPut(req.abandon_token(), s);
    return Prefixed(s, prefix);
  }
  out.control_ms = MsSince(start);
  absl::Status bad = absl::OkStatus();
  if (resp.targets_size() != static_cast<int>(hashes.size())) {
    bad = absl::InternalError(absl::StrCat(prefix, "the store answered BeginPut of ", hashes.size(),
                                           " blocks with ", resp.targets_size(), " targets"));
  } else if (resp.instance_id() != mapped->instance()) {
    bad = absl::FailedPreconditionError(
        absl::StrCat(prefix, "the store restarted since its arena was mapped here"));
  }
  out.slots.assign(hashes.size(), nullptr);
  Reservation::Lease lease{0, resp.lease_id(), {}};
  for (int i = 0; i < resp.targets_size() && bad.ok(); ++i) {
    const auto& t = resp.targets(i);
    if (CountedUnreserved(t, out)) continue;
    out.slots[i] = t.length() == block_bytes ? mapped->At(t.remote_addr(), block_bytes) : nullptr;
    if (out.slots[i] == nullptr) {
      bad = absl::InternalError(absl::StrCat(prefix, "the store reserved block ", i,
                                             " a slot outside its arena or of ", t.length(),
                                             " bytes, not ", block_bytes));
    }
    lease.blocks.push_back(static_cast<size_t>(i));
  }
  if (!bad.ok()) {
    if (resp.lease_id() != 0) AbortReserved(resp.lease_id());
    return bad;
  }
  if (!lease.blocks.empty()) out.leases.push_back(std::move(lease));
  out.regions.push_back(BlockViews::Region{mapped->local(), mapped->length(), mapped});
  return out;
}

absl::StatusOr<uint32_t> StoreDataClient::CommitReserved(uint64_t lease,
                                                         const std::vector<uint64_t>& checksums) {
  // The slots were written through this process's mapping (by a copy
  // kernel or memcpy, complete before this call): a sequentially consistent
  // read-modify-write orders them before the commit is sent.
  static std::atomic<uint32_t> fences{0};
  fences.fetch_add(1, std::memory_order_seq_cst);
  v1::CommitPutRequest commit;
  commit.set_lease_id(lease);
  for (uint64_t c : checksums) commit.add_checksums(c);
  commit.set_store_checksums(checksums.empty());
  v1::CommitPutResponse cr;
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(options_.deadline_ms);
  if (auto s = Call(control_, &v1::Store::Stub::CommitPut, commit, &cr, deadline); !s.ok()) {
    return Prefixed(s, absl::StrCat("commit to store ", address_, ": "));
  }
  return cr.committed();
}

void StoreDataClient::AbortReserved(uint64_t lease) {
  AbortLease(lease,
             std::chrono::system_clock::now() + std::chrono::milliseconds(options_.deadline_ms));
}

uint64_t StoreDataClient::NewPutToken() {
  // Random per call (the kernel's generator): a token names a put to give
  // up, so another client of the same tenant must not be able to guess one
  // from tokens it has seen of its own.
  thread_local std::random_device rd;
  const uint64_t high = rd(), low = rd();
  const uint64_t token = (high << 32) ^ low;
  return token == 0 ? 1 : token;
}

void StoreDataClient::GiveUpPut(uint64_t token, const absl::Status& failed) {
  // Only a call that may still be served later: a refusal opened nothing.
  const auto code = failed.code();
  if (code != absl::StatusCode::kDeadlineExceeded && code != absl::StatusCode::kUnavailable &&
      code != absl::StatusCode::kCancelled) {
    return;
  }
  {
    std::lock_guard lk(release_mu_);
    pending_abandons_.push_back(token);
  }
  release_cv_.notify_all();
}

void StoreDataClient::AbortLease(uint64_t lease, std::chrono::system_clock::time_point deadline) {
  v1::AbortPutRequest abort;
  abort.set_lease_id(lease);
  v1::AbortPutResponse ar;
  // Best effort: the lease expires anyway.
  Call(control_, &v1::Store::Stub::AbortPut, abort, &ar, deadline).IgnoreError();
}

absl::StatusOr<PutOutcome> StoreDataClient::PutOnLane(DataPlaneConnection& lane,
                                                      const Deadline& deadline, uint64_t ns,
                                                      uint64_t block_bytes,
                                                      const std::vector<PutBlock>& blocks) {
  PutOutcome out;
  auto start = std::chrono::steady_clock::now();
  auto req = BeginPutOf(ns, options_.client_id, NewPutToken(), blocks);
  v1::BeginPutResponse resp;
  if (auto s =
          ControlCall(ucx::kCallBeginPut, &v1::Store::Stub::BeginPut, req, &resp, deadline.rpcs);
      !s.ok()) {
    GiveUpPut(req.abandon_token(), s);
    return s;
  }
  out.times.control_ms = MsSince(start);
  out.round_trips = 1;
  auto abort_lease = [&] { AbortLease(resp.lease_id(), deadline.rpcs); };
  // Check the whole answer before a byte is posted: nothing may be left in
  // flight from blocks the caller is told are done with.
  bool malformed = resp.targets_size() != static_cast<int>(blocks.size());
  for (const auto& t : resp.targets()) {
    malformed |= t.disposition() == v1::PUT_RESERVED && t.length() != block_bytes;
  }
  if (malformed) {
    abort_lease();
    return absl::InternalError(absl::StrCat(
        "store answered BeginPut of ", blocks.size(), " blocks with ", resp.targets_size(),
        " targets or a slot that is not ", block_bytes, " bytes"));
  }
  // Addresses mean something only in the store instance that reserved them.
  if (auto s = lane.EnsureInstance(resp.instance_id(), deadline.rpcs); !s.ok()) {
    abort_lease();
    return s;
  }
  std::vector<void*> reqs;
  v1::CommitPutRequest commit;
  commit.set_lease_id(resp.lease_id());
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < resp.targets_size(); ++i) {
    const auto& t = resp.targets(i);
    if (CountedUnreserved(t, out)) continue;
    // Each block is summed just before it is posted: the transport then
    // reads it from cache (a post copies what the socket takes at once;
    // summing the whole batch afterwards read it from memory twice and
    // held up the sends, which need this thread).
    commit.add_checksums(Checksum(blocks[i].data, block_bytes));
    reqs.push_back(lane.PostPut(blocks[i].data, block_bytes, t.remote_addr(), resp.lease_id()));
  }
  if (reqs.empty()) return out;
  out.round_trips = 2;  // BeginPut's, then the bytes' with the commit behind them
  out.bytes_sent = uint64_t{reqs.size()} * block_bytes;
  v1::CommitPutResponse cr;
  if (lane.CallsFollowTransfers()) {
    // The commit follows the bytes on the same connection and is served
    // after them: no flush, no round trip of its own.
    auto answer = lane.Call(ucx::kCallCommitPut, commit.SerializeAsString(), deadline.transfers);
    // The puts' own errors first (a refused put fails the commit too).
    absl::Status moved = lane.Wait(reqs, deadline.transfers);
    if (moved.ok() && !answer.ok()) moved = answer.status();
    if (!moved.ok()) {
      abort_lease();
      return moved;
    }
    if (!cr.ParseFromString(*answer)) {
      return absl::InternalError("store answered a data-plane CommitPut with no CommitPutResponse");
    }
    out.times.rma_ms = MsSince(start);
    out.written = cr.committed();
    return out;
  }
  ++out.round_trips;  // the flush's, then CommitPut's own
  reqs.push_back(lane.PostFlush());
  if (absl::Status moved = lane.Wait(reqs, deadline.transfers); !moved.ok()) {
    abort_lease();
    return moved;
  }
  out.times.rma_ms = MsSince(start);
  start = std::chrono::steady_clock::now();
  if (auto s = Call(control_, &v1::Store::Stub::CommitPut, commit, &cr, deadline.rpcs); !s.ok()) {
    return s;
  }
  out.written = cr.committed();
  out.times.control_ms += MsSince(start);
  return out;
}

}  // namespace kvtier
