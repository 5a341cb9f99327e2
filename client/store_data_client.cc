// StoreDataClient (store_data_client.h, which states its guarantees): its
// lanes and registered memory, and the put/get protocol over one store.
// Connecting and every UCX call are DataPlaneConnection's; queueing and
// back-pressure are TransferLanes'.
#include "client/store_data_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/data_plane_connection.h"
#include "common/checksum.h"
#include "common/rpc/grpc_status.h"
#include "common/ucx/ucx.h"

namespace kvtier {

struct StoreDataClient::Deadline {
  std::chrono::steady_clock::time_point transfers;  // UCX waits
  std::chrono::system_clock::time_point rpcs;       // gRPC contexts
};

namespace {

// BeginPut or BeginGet of the blocks' hashes.
template <typename Request, typename Blocks>
Request BeginRequest(uint64_t ns, const std::string& client, const Blocks& blocks) {
  Request req;
  req.set_namespace_id(ns);
  req.set_client_id(client);
  for (const auto& b : blocks) ToProto(b.hash, req.add_hashes());
  return req;
}

// One control RPC that ends by the operation's deadline.
template <typename Request, typename Response>
absl::Status Call(StoreClient& control,
                  grpc::Status (v1::Store::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                      Response*),
                  const Request& request, Response* response,
                  std::chrono::system_clock::time_point deadline) {
  auto ctx = control.Context(deadline);
  return FromGrpc((control.stub().*rpc)(ctx.get(), request, response));
}

// The status with `prefix` in front of its message, once (a status that
// already names the operation keeps its message).
absl::Status Prefixed(const absl::Status& s, const std::string& prefix) {
  if (absl::StartsWith(s.message(), prefix)) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

StoreDataClient::StoreDataClient(const std::string& address, DataClientOptions options)
    : address_(address),
      options_(std::move(options)),
      control_(address,
               [&] {
                 StoreClientOptions o;
                 o.deadline_ms = options_.deadline_ms;
                 o.security = options_.security;
                 return o;
               }()),
      transfers_(static_cast<size_t>(std::max(1, options_.lanes)), options_.max_inflight_bytes) {
  auto ctx = ucx::Context::Create();
  if (ctx.ok()) {
    ucx_context_ = *ctx;
  } else {
    init_error_ = ctx.status();
  }
  for (size_t i = 0; i < transfers_.lanes(); ++i) {
    auto worker = init_error_.ok()
                      ? ucx::Worker::Create(ucx_context_, /*wakeup=*/false)
                      : absl::StatusOr<std::unique_ptr<ucx::Worker>>(init_error_);
    lanes_.push_back(
        std::make_unique<DataPlaneConnection>(std::move(worker), address_, options_, control_));
  }
}

StoreDataClient::~StoreDataClient() {
  transfers_.Stop();  // runs what is queued; after it no thread touches lanes_
  // UCX objects go in order: endpoints, keys, workers, registrations, context.
  lanes_.clear();
  regions_.clear();
}

absl::Status StoreDataClient::RegisterMemory(void* addr, size_t length) {
  if (!init_error_.ok()) return init_error_;
  auto r = ucx::MemoryRegion::Map(ucx_context_, addr, length);
  if (!r.ok()) return r.status();
  std::lock_guard lk(regions_mu_);
  regions_.push_back(std::shared_ptr<ucx::MemoryRegion>(std::move(*r)));
  return absl::OkStatus();
}

template <typename Outcome>
std::future<absl::StatusOr<Outcome>> StoreDataClient::Start(size_t count, uint64_t block_bytes,
                                                            std::string error_prefix,
                                                            Operation<Outcome> op) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<Outcome>>>();
  auto future = promise->get_future();
  transfers_.Submit(count * block_bytes, [this, count, error_prefix = std::move(error_prefix),
                                           op = std::move(op), promise](size_t i) {
    DataPlaneConnection& lane = *lanes_[i];
    {
      // Pick up memory registered since the last job.
      std::lock_guard lk(regions_mu_);
      lane.UseRegions(regions_);
    }
    // One deadline for the whole operation (connect, RPCs, transfers).
    const auto budget = std::chrono::milliseconds(options_.deadline_ms);
    const Deadline deadline{std::chrono::steady_clock::now() + budget,
                            std::chrono::system_clock::now() + budget};
    absl::StatusOr<Outcome> r = Outcome{};
    if (count > 0) {
      if (absl::Status s = lane.EnsureConnected(deadline.rpcs); s.ok()) {
        r = op(lane, deadline);
      } else {
        r = s;
      }
    }
    if (!r.ok()) r = Prefixed(r.status(), error_prefix);
    promise->set_value(std::move(r));
  });
  return future;
}

std::future<absl::StatusOr<PutOutcome>> StoreDataClient::Put(uint64_t ns, uint64_t block_bytes,
                                                             std::vector<PutBlock> blocks) {
  const size_t n = blocks.size();  // before the move below: argument order is unspecified
  return Start<PutOutcome>(
      n, block_bytes, absl::StrCat("put to store ", address_, ": "),
      [this, ns, block_bytes, blocks = std::move(blocks)](DataPlaneConnection& lane,
                                                          const Deadline& deadline) {
        return PutOnLane(lane, deadline, ns, block_bytes, blocks);
      });
}

std::future<absl::StatusOr<GetOutcome>> StoreDataClient::Get(uint64_t ns, uint64_t block_bytes,
                                                             std::vector<GetBlock> blocks) {
  const size_t n = blocks.size();  // before the move below: argument order is unspecified
  return Start<GetOutcome>(
      n, block_bytes, absl::StrCat("get from store ", address_, ": "),
      [this, ns, block_bytes, blocks = std::move(blocks)](DataPlaneConnection& lane,
                                                          const Deadline& deadline) {
        return GetOnLane(lane, deadline, ns, block_bytes, blocks);
      });
}

absl::StatusOr<PutOutcome> StoreDataClient::PutOnLane(DataPlaneConnection& lane,
                                                      const Deadline& deadline, uint64_t ns,
                                                      uint64_t block_bytes,
                                                      const std::vector<PutBlock>& blocks) {
  auto req = BeginRequest<v1::BeginPutRequest>(ns, options_.client_id, blocks);
  v1::BeginPutResponse resp;
  if (auto s = Call(control_, &v1::Store::Stub::BeginPut, req, &resp, deadline.rpcs); !s.ok()) {
    return s;
  }
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
  PutOutcome out;
  std::vector<void*> reqs;
  std::vector<size_t> reserved;
  for (int i = 0; i < resp.targets_size(); ++i) {
    const auto& t = resp.targets(i);
    switch (t.disposition()) {
      case v1::PUT_RESERVED:
        reqs.push_back(lane.PostPut(blocks[i].data, block_bytes, t.remote_addr()));
        reserved.push_back(i);
        break;
      case v1::PUT_ALREADY_PRESENT: out.already_present++; break;
      case v1::PUT_BUSY: out.busy++; break;
      default: out.no_space++; break;
    }
  }
  if (reserved.empty()) return out;
  // Checksums while the bytes are on the wire.
  v1::CommitPutRequest commit;
  commit.set_lease_id(resp.lease_id());
  for (size_t i : reserved) commit.add_checksums(Checksum(blocks[i].data, block_bytes));
  reqs.push_back(lane.PostFlush());
  if (absl::Status moved = lane.Wait(reqs, deadline.transfers); !moved.ok()) {
    abort_lease();
    return moved;
  }
  v1::CommitPutResponse cr;
  if (auto s = Call(control_, &v1::Store::Stub::CommitPut, commit, &cr, deadline.rpcs); !s.ok()) {
    return s;
  }
  out.written = cr.committed();
  return out;
}

absl::StatusOr<GetOutcome> StoreDataClient::GetOnLane(DataPlaneConnection& lane,
                                                      const Deadline& deadline, uint64_t ns,
                                                      uint64_t block_bytes,
                                                      const std::vector<GetBlock>& blocks) {
  auto req = BeginRequest<v1::BeginGetRequest>(ns, options_.client_id, blocks);
  v1::BeginGetResponse resp;
  if (auto s = Call(control_, &v1::Store::Stub::BeginGet, req, &resp, deadline.rpcs); !s.ok()) {
    return s;
  }
  GetOutcome out;
  if (resp.sources_size() == 0) return out;
  std::vector<void*> reqs;
  absl::Status bad = absl::OkStatus();
  for (int i = 0; i < resp.sources_size(); ++i) {
    const auto& src = resp.sources(i);
    if (i >= static_cast<int>(blocks.size()) || src.length() != block_bytes) {
      bad = absl::InternalError("store returned more blocks than asked or one of the wrong size");
      break;
    }
    reqs.push_back(lane.PostGet(blocks[i].dest, block_bytes, src.remote_addr()));
  }
  // The blocks already posted are waited for (and the lease ended) even when
  // the answer was bad: nothing may still write into the caller's buffers.
  absl::Status moved = lane.Wait(reqs, deadline.transfers);
  {
    v1::EndGetRequest end;
    end.set_lease_id(resp.lease_id());
    v1::EndGetResponse er;
    // Best effort: the lease expires anyway.
    Call(control_, &v1::Store::Stub::EndGet, end, &er, deadline.rpcs).IgnoreError();
  }
  if (!bad.ok()) return bad;
  if (!moved.ok()) return moved;
  for (int i = 0; i < resp.sources_size(); ++i) {
    if (Checksum(blocks[i].dest, block_bytes) != resp.sources(i).checksum()) {
      return absl::DataLossError(absl::StrCat("block ", i, " from store ", address_,
                                              " failed its checksum; not used"));
    }
    out.blocks++;
    if (resp.sources(i).tier() == v1::TIER_DISK) out.from_disk++;
  }
  return out;
}

}  // namespace kvtier
