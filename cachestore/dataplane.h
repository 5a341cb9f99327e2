// The store side of the UCX data plane: the RAM arena registered once with
// UCX, its packed remote key, a sockaddr listener that accepts client
// endpoints (TCP here, RDMA via rdmacm in a cluster, shared memory when the
// client shares the host), and a progress thread that sleeps on the
// worker's event fd when idle. Clients move bytes with one-sided put/get
// straight into and out of arena slots: the store copies nothing.
// Thread-safe (the UCX worker is only touched by the progress thread after
// Start returns).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/ucx/ucx.h"

namespace kvtier::store {

class DataPlaneServer {
 public:
  // listen: HOST:PORT (port 0 picks one).
  static absl::StatusOr<std::unique_ptr<DataPlaneServer>> Start(const std::string& listen,
                                                               void* arena, size_t length);
  ~DataPlaneServer();

  // HOST:PORT actually bound.
  const std::string& address() const { return address_; }
  const std::string& packed_rkey() const { return packed_rkey_; }
  const std::string& worker_address() const { return worker_address_; }
  uint64_t base() const { return reinterpret_cast<uint64_t>(region_->addr()); }
  uint64_t length() const { return region_->length(); }
  size_t connections() const { return connections_; }

 private:
  DataPlaneServer() = default;
  static void OnConnect(ucp_conn_request_h request, void* arg);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void Run();
  void CloseFailed();

  std::shared_ptr<ucx::Context> ctx_;
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<ucx::MemoryRegion> region_;
  ucp_listener_h listener_ = nullptr;
  std::string address_;
  std::string packed_rkey_;
  std::string worker_address_;
  int stop_fd_ = -1;
  std::thread thread_;
  // Touched only by the progress thread.
  std::vector<ucp_ep_h> endpoints_;
  std::vector<ucp_ep_h> failed_;
  std::atomic<size_t> connections_{0};
};

}  // namespace kvtier::store
