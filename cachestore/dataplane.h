// The store side of the UCX data plane: the RAM arena registered once with
// UCX, its packed remote key, a sockaddr listener that accepts client
// endpoints (TCP here, RDMA via rdmacm in a cluster, shared memory when the
// client shares the host), and a progress thread that sleeps on the
// worker's event fd when idle. Clients move bytes with one-sided put/get
// straight into and out of arena slots: the store copies nothing. Control
// calls that arrive as active messages (common/ucx/calls.h) are answered on
// the progress thread by the call handler the service sets.
// Thread-safe (the UCX worker is only touched by the progress thread after
// Start returns).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/ucx/ucx.h"

namespace kvtier::store {

class DataPlaneServer {
 public:
  // listen: HOST:PORT (port 0 picks one). regions: the (offset, length)
  // ranges of the arena registered each on its own, with its own remote key
  // (tenants: one per tenant, none covering another's); empty: the whole
  // arena as one.
  static absl::StatusOr<std::unique_ptr<DataPlaneServer>> Start(
      const std::string& listen, void* arena, size_t length,
      const std::vector<std::pair<uint64_t, uint64_t>>& regions = {});
  ~DataPlaneServer();

  // HOST:PORT actually bound.
  const std::string& address() const { return address_; }
  const std::string& worker_address() const { return worker_address_; }
  // Registered region i: its address, length and packed remote key.
  size_t regions() const { return regions_.size(); }
  // REQUIRES: i < regions() (checked: std::out_of_range).
  uint64_t base(size_t i = 0) const { return reinterpret_cast<uint64_t>(regions_.at(i)->addr()); }
  uint64_t length(size_t i = 0) const { return regions_.at(i)->length(); }
  const std::string& packed_rkey(size_t i = 0) const { return packed_rkeys_.at(i); }
  size_t connections() const { return connections_; }

  // A control call's answer: a google.rpc.Code and the response message (or,
  // for a code other than 0, the error's text).
  struct CallReply {
    int code = 0;
    std::string body;
  };
  // Answers one call (common/ucx/calls.h) on the progress thread: the method,
  // the caller's session and the request message.
  using CallHandler =
      std::function<CallReply(uint16_t method, std::string_view session, std::string_view request)>;
  // Sets (or, with nullptr, clears) the handler; calls that arrive without
  // one are answered UNAVAILABLE. Returns once no call runs the old one.
  void SetCallHandler(CallHandler handler);

 private:
  struct PendingCall {
    ucp_ep_h reply_ep;
    uint16_t method;
    uint64_t call_id;
    std::string session, request;
  };
  static ucs_status_t OnCall(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  // Answers the calls that arrived during the last progress.
  void ServeCalls();
  void Reply(ucp_ep_h ep, uint64_t call_id, CallReply reply);
  DataPlaneServer() = default;
  static void OnConnect(ucp_conn_request_h request, void* arg);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void Run();
  void CloseFailed();

  std::shared_ptr<ucx::Context> ctx_;
  std::unique_ptr<ucx::Worker> worker_;
  std::vector<std::unique_ptr<ucx::MemoryRegion>> regions_;
  std::vector<std::string> packed_rkeys_;
  ucp_listener_h listener_ = nullptr;
  std::string address_;
  std::string worker_address_;
  int stop_fd_ = -1;
  std::thread thread_;
  // Touched only by the progress thread.
  std::vector<ucp_ep_h> endpoints_;
  std::vector<ucp_ep_h> failed_;
  std::vector<PendingCall> calls_;
  std::atomic<size_t> connections_{0};
  std::mutex handler_mu_;
  CallHandler handler_;  // guarded by handler_mu_
};

}  // namespace kvtier::store
