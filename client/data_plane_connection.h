// One lane's connection to a store's data plane, made through the store's
// ConnectDataPlane RPC and made again after a failure, with exponential
// back-off (backoff_min_ms..backoff_max_ms) between failed attempts: a
// socket channel (socket_channel.h) to a store that offers its socket data
// plane (the default), where the store checks and moves every byte; else
// the lane's UCX worker, its endpoint to the store and the remote key of the
// store's arena (--data-plane ucx). Every transfer of StoreDataClient goes
// through here, so the put/get protocol never sees a connection that a
// failure left half-usable.
//
// Same-host stores that offer their arena (RemoteRegion.shm_path), when the
// client uses shared memory (DataClientOptions::shared_memory), are mapped:
// PostGet and PostPut are then bounds-checked memcpys that complete at once,
// PostFlush a fence; the socket or UCX connection stays for calls and
// liveness, and as the fallback when the mapping cannot be made.
//
// Not thread-safe: a connection belongs to its lane's thread (UCX workers
// are single-threaded); its owner touches it only while that thread is
// stopped. Internal to kvtier_dataclient.
//
// EnsureConnected returns: the lane's worker-creation error; UNAVAILABLE
// while backing off after a failed attempt; ConnectDataPlane's own status
// (FAILED_PRECONDITION from a store without a data plane, or from one that
// serves it over TLS to a client with no CA to verify it); INTERNAL for an
// answer it cannot use; or the connect's status. Wait returns the
// transfers' first error (the store's status for a transfer it refused,
// DEADLINE_EXCEEDED past the deadline), or UNAVAILABLE if the connection
// failed meanwhile; after any error the connection is dropped.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/arena_mapping.h"
#include "client/data_client_types.h"
#include "client/store_client.h"
#include "common/ucx/ucx.h"

namespace kvtier {

class SocketChannel;

class DataPlaneConnection {
 public:
  // `worker`: the lane's UCX worker, or why there is none (then every
  // EnsureConnected returns that). `address`, `options` and `control` belong
  // to the client, which outlives its lanes.
  // map_arena: whether a same-host store's offered arena is mapped (a
  // connection that only makes control calls needs no mapping).
  DataPlaneConnection(absl::StatusOr<std::unique_ptr<ucx::Worker>> worker,
                      const std::string& address, const DataClientOptions& options,
                      StoreClient& control, bool map_arena = true);
  // Releases the UCX objects in the order UCX needs: key and endpoint,
  // registrations, worker.
  ~DataPlaneConnection();
  DataPlaneConnection(const DataPlaneConnection&) = delete;
  DataPlaneConnection& operator=(const DataPlaneConnection&) = delete;

  // Connects unless connected and not failed; the ConnectDataPlane RPC ends
  // by `rpc_deadline`.
  absl::Status EnsureConnected(std::chrono::system_clock::time_point rpc_deadline);

  // Takes a snapshot of the client's registered memory if it grew since the
  // last one (registrations are only ever added). Called under the client's
  // lock, so the lane reads its snapshot without one.
  void UseRegions(const std::vector<std::shared_ptr<ucx::MemoryRegion>>& regions);

  // Post one block's transfer (`remote_addr` as BeginPut / BeginGet gave it,
  // under `lease`): on the socket data plane, queued for the store to check
  // and move; over UCX, RMA, zero-copy where the local bytes lie in
  // registered memory. The request goes to Wait. REQUIRES: EnsureConnected
  // succeeded.
  void* PostPut(const void* src, size_t length, uint64_t remote_addr, uint64_t lease);
  void* PostGet(void* dest, size_t length, uint64_t remote_addr, uint64_t lease);
  // Remote completion of everything posted before it.
  void* PostFlush();
  // The store's arena mapped here, when transfers are memcpys through it.
  const std::shared_ptr<ArenaMapping>& mapping() const { return mapping_; }
  // Whether a PostGet/PostPut has moved the bytes when it returns (mapped).
  bool CopiesAtPost() const { return mapping_ != nullptr; }
  // Connects (as EnsureConnected) to the store instance that issued an
  // answer: if the connection is to another instance (the store restarted
  // since), it is made again; UNAVAILABLE if the store's instance is still
  // not `instance` (the answer's addresses are stale). 0: no check (a store
  // that does not say).
  absl::Status EnsureInstance(uint64_t instance,
                              std::chrono::system_clock::time_point rpc_deadline);
  // Forgets the endpoint and the mapping (the store failed, restarted, or
  // returned bytes that failed their checksum): the next EnsureConnected
  // asks the store again.
  void Reset();

  // Whether the connected store takes control calls on its data plane
  // (it handed out a session).
  bool TakesCalls() const { return (ep_ != nullptr || sock_ != nullptr) && !session_.empty(); }
  // Whether a Call is served after the transfers posted before it (the
  // socket data plane serves a connection in order; mapped transfers are
  // done when posted), so a put's commit can follow its bytes without a
  // flush.
  bool CallsFollowTransfers() const {
    return TakesCalls() && (sock_ != nullptr || mapping_ != nullptr);
  }
  // One control call on the data plane (common/ucx/calls.h): the store's
  // answer, its status as the store gave it (then the endpoint stays), or
  // UNAVAILABLE / DEADLINE_EXCEEDED when the call or its answer did not
  // travel (then the endpoint is dropped, as after a failed transfer).
  // REQUIRES: TakesCalls().
  absl::StatusOr<std::string> Call(uint16_t method, const std::string& request,
                                   ucx::Clock::time_point deadline);

  // Waits for (and frees) the requests until `deadline`. On any failure the
  // endpoint is force-closed, so nothing posted on it writes afterwards, and
  // the next EnsureConnected reconnects; requests posted before the failure
  // may still be waited for (and freed) afterwards, and fail UNAVAILABLE.
  absl::Status Wait(std::vector<void*>& requests, ucx::Clock::time_point deadline);

 private:
  ucp_request_param_t ParamsFor(const void* p, size_t n) const;
  // A socket operation's number as a request handle (data_plane_connection.cc).
  void* AsRequest(uint64_t seq) const;
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  void Drop();

  const std::string& address_;
  const DataClientOptions& options_;
  StoreClient& control_;

  absl::Status init_error_;
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<ucx::Endpoint> ep_;
  std::unique_ptr<SocketChannel> sock_;  // the socket data plane, when the store offers it
  uint64_t sock_generation_ = 0;         // socket connections made so far
  std::unique_ptr<ucx::RemoteKey> rkey_;
  std::vector<std::shared_ptr<ucx::MemoryRegion>> regions_;  // snapshot of the client's
  ucx::Clock::time_point next_attempt_{};
  uint64_t backoff_ms_;
  std::string last_error_;
  uint64_t instance_ = 0;                  // the connected store's instance id (0: unknown)
  std::shared_ptr<ArenaMapping> mapping_;  // the store's arena, when mapped
  const bool map_arena_;
  std::string session_;  // ConnectDataPlaneResponse.session
  // The call in flight (one at a time): its id, and its reply once here.
  uint64_t call_id_ = 0;
  bool replied_ = false;
  int reply_code_ = 0;
  std::string reply_;
};

}  // namespace kvtier
