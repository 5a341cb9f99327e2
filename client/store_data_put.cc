// StoreDataClient's put on one lane: BeginPut (on the data plane where it
// can travel), the blocks' bytes by RMA, CommitPut right behind them.
#include <algorithm>

#include "client/data_plane_connection.h"
#include "client/store_data_detail.h"
#include "common/checksum.h"
#include "common/elapsed.h"
#include "common/rpc/proto_convert.h"
#include "common/ucx/calls.h"

namespace kvtier {

using store_data_detail::Call;

namespace {

// BeginPut of the blocks' hashes.
v1::BeginPutRequest BeginPutOf(uint64_t ns, const std::string& client,
                               const std::vector<PutBlock>& blocks) {
  v1::BeginPutRequest req;
  req.set_namespace_id(ns);
  req.set_client_id(client);
  for (const auto& b : blocks) ToProto(b.hash, req.add_hashes());
  return req;
}

}  // namespace

absl::StatusOr<PutOutcome> StoreDataClient::PutOnLane(DataPlaneConnection& lane,
                                                      const Deadline& deadline, uint64_t ns,
                                                      uint64_t block_bytes,
                                                      const std::vector<PutBlock>& blocks) {
  PutOutcome out;
  auto start = std::chrono::steady_clock::now();
  auto req = BeginPutOf(ns, options_.client_id, blocks);
  v1::BeginPutResponse resp;
  if (auto s =
          ControlCall(ucx::kCallBeginPut, &v1::Store::Stub::BeginPut, req, &resp, deadline.rpcs);
      !s.ok()) {
    return s;
  }
  out.times.control_ms = MsSince(start);
  out.round_trips = 1;
  auto abort_lease = [&] {
    v1::AbortPutRequest abort;
    abort.set_lease_id(resp.lease_id());
    v1::AbortPutResponse ar;
    // Best effort: the lease expires anyway.
    Call(control_, &v1::Store::Stub::AbortPut, abort, &ar, deadline.rpcs).IgnoreError();
  };
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
    switch (t.disposition()) {
      case v1::PUT_RESERVED:
        // Each block is summed just before it is posted: the transport then
        // reads it from cache (a post copies what the socket takes at once;
        // summing the whole batch afterwards read it from memory twice and
        // held up the sends, which need this thread).
        commit.add_checksums(Checksum(blocks[i].data, block_bytes));
        reqs.push_back(lane.PostPut(blocks[i].data, block_bytes, t.remote_addr(), resp.lease_id()));
        break;
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
