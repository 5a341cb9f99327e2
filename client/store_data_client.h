// The data-plane client of one kvtier-store shard: a gRPC control channel
// (StoreClient) plus UCX endpoints to the store's RAM arena, one per lane;
// each lane is a background thread that owns its UCX worker, so one
// operation's RPCs overlap another's transfers.
//
// Load: Pin (one BeginGet: look the chain up and pin its present prefix, in
// one round trip, on the caller's thread) -> Read (ucp_get_nbx of every
// pinned block, or of each block's segments -- layers -- with a callback as
// each segment lands, then every block checked against its checksum; from a
// same-host store whose arena is mapped, memcpys on the caller's thread) ->
// release, which never blocks: the lease id waits up to release_delay_ms to
// travel with the next Pin (BeginGet.end_leases), else goes out batched in
// one ReleaseGets; the lease's expiry is the backstop. Get is Pin + Read in
// one call. Put (offload): BeginPut -> ucp_put_nbx of every reserved block
// (all in flight at once, checksums computed meanwhile) -> one flush ->
// CommitPut. BeginGet, ReleaseGets and BeginPut travel as control calls on
// the data plane (common/ucx/calls.h; up to call_lanes at once, each on a
// connection of its own) where the store takes them, else over gRPC.
//
// Loads and offloads run on separate lane classes (transfer_lanes.h): a
// load never queues behind an offload, and each class has its own
// max_inflight_bytes back-pressure bound (a caller past it blocks). One
// deadline (deadline_ms) covers an operation's connect, RPCs and transfers
// together. A dead store, a reset connection or a missed deadline fails the
// operation with a status; the next operation reconnects, with exponential
// back-off between attempts.
//
// Memory: blocks may live anywhere in host memory; ranges registered with
// RegisterMemory move zero-copy. Thread-safe.
//
// Statuses: a failed Put, Get or Read names the store ("put to store ADDR:
// ...", "get from store ADDR: ...") and carries the control RPCs' own codes
// (FAILED_PRECONDITION, e.g., from a store without a UCX listener),
// UNAVAILABLE (the data plane is down or backing off, or the endpoint
// failed), DEADLINE_EXCEEDED (the operation's deadline), INTERNAL (an answer
// from the store that the client cannot use) or, for Get and Read, DATA_LOSS
// (a block failed its checksum). Read also answers INVALID_ARGUMENT for a
// plan whose segments do not tile the block or a count past the pinned
// blocks, and FAILED_PRECONDITION for a pin whose lease expired before the
// read (nothing moved in either case). RegisterMemory returns UCX's error
// for the context or the registration.
//
// Files: transfer_lanes.h (lanes and back-pressure), data_plane_connection.h
// (UCX connect and RMA), here (the put/get protocol). This header also
// brings in ShardedStoreClient, which its users reach through it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/data_client_types.h"
#include "client/sharded_store_client.h"  // IWYU pragma: export
#include "client/store_client.h"
#include "client/transfer_lanes.h"
#include "google/protobuf/message.h"

namespace kvtier {

namespace ucx {
class Context;
class MemoryRegion;
}  // namespace ucx

class ArenaMapping;
class DataPlaneConnection;

class StoreDataClient {
 public:
  explicit StoreDataClient(const std::string& address, DataClientOptions options = {});
  ~StoreDataClient();
  StoreDataClient(const StoreDataClient&) = delete;
  StoreDataClient& operator=(const StoreDataClient&) = delete;

  // Registers [addr, addr + length) for zero-copy transfers.
  absl::Status RegisterMemory(void* addr, size_t length);

  // An offload.
  std::future<absl::StatusOr<PutOutcome>> Put(uint64_t ns, uint64_t block_bytes,
                                              std::vector<PutBlock> blocks);
  // A load of the chain's leading present blocks: Pin and Read on a lane.
  std::future<absl::StatusOr<GetOutcome>> Get(uint64_t ns, uint64_t block_bytes,
                                              std::vector<GetBlock> blocks);

  // One control round trip, on the caller's thread: looks `chain` up and
  // pins its leading present blocks, carrying the releases queued so far.
  // It ends by the deadline, or by `budget` when that is sooner (a lookup
  // on a request's path is worth no more than the compute it can save).
  // BeginGet's statuses; INTERNAL for an answer of the wrong shape (then
  // nothing stays pinned).
  absl::StatusOr<PinnedBlocks> Pin(uint64_t ns, uint64_t block_bytes,
                                   const std::vector<BlockHash>& chain,
                                   std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // Moves pinned blocks [first, first + count) as `plan` lays them out
  // (plan.dest(i, s) names pinned block i), on a load lane, and verifies each
  // one's checksum. GetOutcome::blocks is `count` on success. The pin stays:
  // its owner releases it once done with every read.
  std::future<absl::StatusOr<GetOutcome>> Read(const PinnedBlocks& pinned, uint64_t block_bytes,
                                               size_t first, size_t count, ReadPlan plan);
  // A put's first half where this process maps the store's arena (a
  // same-host store): BeginPut of `hashes` on the caller's thread, by the
  // deadline or `budget` when sooner, answering each block's slot in the
  // mapping (Reservation). The caller fills the reserved slots, then
  // CommitReserved or AbortReserved. FAILED_PRECONDITION when the arena is
  // not mapped here (Put instead) or the store restarted since it was;
  // BeginPut's statuses; INTERNAL for an answer of the wrong shape or a
  // slot outside the arena (then nothing stays reserved).
  absl::StatusOr<Reservation> Reserve(
      uint64_t ns, uint64_t block_bytes, const std::vector<BlockHash>& hashes,
      std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // CommitPut of a lease Reserve opened, its slots filled: `checksums` are
  // the reserved blocks' XXH3-64s in commit order, or empty: the store
  // hashes the slots itself (CommitPutRequest.store_checksums; this
  // process wrote them through its mapping, so a hash of its own would read
  // the same bytes twice). The blocks committed; CommitPut's statuses
  // (DATA_LOSS: a slot's bytes do not match; INVALID_ARGUMENT, the lease
  // kept, from a store too old to hash them: send the checksums).
  absl::StatusOr<uint32_t> CommitReserved(uint64_t lease, const std::vector<uint64_t>& checksums);
  // Gives a reservation's slots back (best effort: the lease expires anyway).
  void AbortReserved(uint64_t lease);
  // This process maps the store's arena now (as far as a connected lane
  // has told; no call is made).
  bool ArenaMapped() {
    auto m = KnownMapping(/*probe=*/false);
    return m.ok() && *m != nullptr;
  }

  // Connects a lane now, in the background, as a first transfer would (for
  // a same-host store, that maps its arena): a lane job that does nothing
  // else. Never blocks; ready when the connect ended (a failure is the next
  // operation's to report, too).
  std::future<absl::StatusOr<GetOutcome>> Warm();
  // Pinned blocks [first, first + count) in place, where this process maps
  // the pin's store's arena (a same-host store): no bytes move, and none are
  // verified (VerifyViews). FAILED_PRECONDITION when the arena is not mapped
  // here (Read instead: it moves them), or the lease expired;
  // INVALID_ARGUMENT for a range past the pin; INTERNAL for a block the
  // store placed outside its arena.
  absl::StatusOr<BlockViews> View(const PinnedBlocks& pinned, uint64_t block_bytes, size_t first,
                                  size_t count);
  // Ends a pin (0: none). Never blocks (see the header comment).
  void Release(uint64_t lease);

  StoreClient& control() { return control_; }
  const std::string& address() const { return address_; }

 private:
  struct Deadline;  // one operation's, on the clock of each kind of wait
  // The protocol part of an operation, run on a connected lane.
  template <typename Outcome>
  using Operation =
      std::function<absl::StatusOr<Outcome>(DataPlaneConnection& lane, const Deadline& deadline)>;

  // Queues an operation on `count` blocks of class `c` behind its in-flight
  // bound. On its lane, `op` runs with the operation's deadline once the
  // lane is connected (not at all for no blocks); a failure gets
  // `error_prefix`.
  template <typename Outcome>
  std::future<absl::StatusOr<Outcome>> Start(TransferLanes::Class c, size_t count,
                                             uint64_t block_bytes, std::string error_prefix,
                                             Operation<Outcome> op);
  absl::StatusOr<PutOutcome> PutOnLane(DataPlaneConnection& lane, const Deadline& deadline,
                                       uint64_t ns, uint64_t block_bytes,
                                       const std::vector<PutBlock>& blocks);
  absl::StatusOr<PinnedBlocks> PinBy(std::chrono::system_clock::time_point deadline, uint64_t ns,
                                     uint64_t block_bytes, const std::vector<BlockHash>& chain);
  // AbortPut of a put's lease, by `deadline` (best effort).
  void AbortLease(uint64_t lease, std::chrono::system_clock::time_point deadline);
  // A BeginPut's abandon_token: random, so no other client guesses it.
  uint64_t NewPutToken();
  // After a BeginPut that failed with `failed`: if the store may still serve
  // it (a deadline, a lost connection), the releaser gives it up by token
  // (AbortPut), so its slots do not stay reserved for a lease period.
  void GiveUpPut(uint64_t token, const absl::Status& failed);
  // The store's arena as mapped here (null: not mapped, or not known yet
  // and `probe` false). With `probe`, connects a lane first if none has
  // (what a transfer would do first); the connect's error.
  absl::StatusOr<std::shared_ptr<ArenaMapping>> KnownMapping(bool probe);
  // The read protocol over a lane's connection, or over the mapped arena on
  // the caller's thread (store_data_client.cc's MappedReads).
  template <typename Transport>
  absl::StatusOr<GetOutcome> ReadVia(Transport& transport, const Deadline& deadline,
                                     const PinnedBlocks& pinned, uint64_t block_bytes, size_t first,
                                     size_t count, const ReadPlan& plan);
  // The releaser thread: sends the releases no Pin took within release_delay_ms,
  // and the abandons GiveUpPut queued (at once).
  void ReleaseLoop();
  // A control call on the data plane (a free call lane): the store's answer, or
  // nullopt when it cannot travel there now (no data plane, a store that
  // takes no such calls, a session the store dropped, a transport failure),
  // when the caller makes the gRPC call instead.
  std::optional<absl::StatusOr<std::string>> CallOnDataPlane(
      uint16_t method, const google::protobuf::Message& request,
      std::chrono::system_clock::time_point deadline);
  // One control call: on the data plane as `method` where it can travel
  // there, else the gRPC `rpc`; INTERNAL for a data-plane answer that does
  // not parse as a Response.
  template <typename Request, typename Response>
  absl::Status ControlCall(uint16_t method,
                           grpc::Status (v1::Store::Stub::*rpc)(grpc::ClientContext*,
                                                                const Request&, Response*),
                           const Request& request, Response* response,
                           std::chrono::system_clock::time_point deadline);

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

  // The store's arena as a lane last mapped it: reads of pins from that
  // instance are memcpys on the caller's thread, with no lane hand-off.
  std::mutex mapping_mu_;
  std::shared_ptr<ArenaMapping> mapping_;  // guarded by mapping_mu_
  bool lane_connected_ = false;            // a lane has connected (so mapping_ is known)

  // The connections control calls travel on, on the callers' threads: each
  // has its own UCX worker (connected on first use; it maps no arena) and
  // carries one call at a time, so up to call_lanes calls are in flight.
  struct CallLane {
    std::timed_mutex mu;
    std::unique_ptr<DataPlaneConnection> conn;  // guarded by mu
  };
  std::vector<std::unique_ptr<CallLane>> call_lanes_;
  std::atomic<size_t> next_call_lane_{0};

  std::mutex release_mu_;
  std::condition_variable release_cv_;
  std::vector<uint64_t> pending_releases_;  // guarded by release_mu_
  std::vector<uint64_t> pending_abandons_;  // BeginPut tokens; guarded by release_mu_
  bool release_stop_ = false;               // guarded by release_mu_
  std::thread releaser_;
  // Declared last, so destroyed first: even when the constructor throws,
  // the lane threads end before what they read goes.
  TransferLanes transfers_;
};

}  // namespace kvtier
