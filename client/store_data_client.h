// The data-plane client of one kvtier-store shard: a gRPC control channel
// (StoreClient) plus UCX endpoints to the store's RAM arena, one per lane;
// each lane is a background thread that owns its UCX worker, so one
// operation's RPCs overlap another's transfers.
//
// Put: BeginPut -> ucp_put_nbx of every reserved block (all in flight at
// once, checksums computed meanwhile) -> one flush -> CommitPut. Get:
// BeginGet -> ucp_get_nbx of every pinned block -> EndGet -> every block
// checked against its checksum. One deadline (deadline_ms) covers an
// operation's connect, RPCs and transfers together. Operations are
// asynchronous (futures) and bounded by max_inflight_bytes: a caller past the
// bound blocks until earlier operations finish (back-pressure). A dead store,
// a reset connection or a missed deadline fails the operation with a status;
// the next operation reconnects, with exponential back-off between attempts.
//
// Memory: blocks may live anywhere in host memory; ranges registered with
// RegisterMemory move zero-copy. Thread-safe.
//
// Statuses: a failed Put or Get names the store ("put to store ADDR: ...",
// "get from store ADDR: ...") and carries the control RPCs' own codes
// (FAILED_PRECONDITION, e.g., from a store without a UCX listener),
// UNAVAILABLE (the data plane is down or backing off, or the endpoint
// failed), DEADLINE_EXCEEDED (the operation's deadline), INTERNAL (an answer
// from the store that the client cannot use) or, for Get, DATA_LOSS (a block
// failed its checksum). RegisterMemory returns UCX's error for the context or
// the registration.
//
// Files: transfer_lanes.h (lanes and back-pressure), data_plane_connection.h
// (UCX connect and RMA), here (the put/get protocol). This header also
// brings in ShardedStoreClient, which its users reach through it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/data_client_types.h"
#include "client/sharded_store_client.h"  // IWYU pragma: export
#include "client/store_client.h"
#include "client/transfer_lanes.h"

namespace kvtier {

namespace ucx {
class Context;
class MemoryRegion;
}  // namespace ucx

class DataPlaneConnection;

class StoreDataClient {
 public:
  explicit StoreDataClient(const std::string& address, DataClientOptions options = {});
  ~StoreDataClient();
  StoreDataClient(const StoreDataClient&) = delete;
  StoreDataClient& operator=(const StoreDataClient&) = delete;

  // Registers [addr, addr + length) for zero-copy transfers.
  absl::Status RegisterMemory(void* addr, size_t length);

  std::future<absl::StatusOr<PutOutcome>> Put(uint64_t ns, uint64_t block_bytes,
                                              std::vector<PutBlock> blocks);
  std::future<absl::StatusOr<GetOutcome>> Get(uint64_t ns, uint64_t block_bytes,
                                              std::vector<GetBlock> blocks);

  StoreClient& control() { return control_; }
  const std::string& address() const { return address_; }

 private:
  struct Deadline;  // one operation's, on the clock of each kind of wait
  // The protocol part of an operation, run on a connected lane.
  template <typename Outcome>
  using Operation =
      std::function<absl::StatusOr<Outcome>(DataPlaneConnection& lane, const Deadline& deadline)>;

  // Queues an operation on `count` blocks behind the in-flight bound. On its
  // lane, `op` runs with the operation's deadline once the lane is connected
  // (not at all for no blocks); a failure gets `error_prefix`.
  template <typename Outcome>
  std::future<absl::StatusOr<Outcome>> Start(size_t count, uint64_t block_bytes,
                                             std::string error_prefix, Operation<Outcome> op);
  absl::StatusOr<PutOutcome> PutOnLane(DataPlaneConnection& lane, const Deadline& deadline,
                                       uint64_t ns, uint64_t block_bytes,
                                       const std::vector<PutBlock>& blocks);
  absl::StatusOr<GetOutcome> GetOnLane(DataPlaneConnection& lane, const Deadline& deadline,
                                       uint64_t ns, uint64_t block_bytes,
                                       const std::vector<GetBlock>& blocks);

  std::string address_;
  DataClientOptions options_;
  StoreClient control_;
  std::shared_ptr<ucx::Context> ucx_context_;  // shared by the lanes' workers
  absl::Status init_error_;                    // of the UCX context
  std::mutex regions_mu_;
  std::vector<std::shared_ptr<ucx::MemoryRegion>> regions_;  // guarded by regions_mu_
  // lanes_[i] is touched only by lane i's thread (and by the destructor once
  // the lanes have stopped).
  std::vector<std::unique_ptr<DataPlaneConnection>> lanes_;
  // Declared last, so destroyed first: even when the constructor throws,
  // the lane threads end before what they read goes.
  TransferLanes transfers_;
};

}  // namespace kvtier
