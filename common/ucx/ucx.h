// A thin RAII layer over UCX's UCP API for kvtier's data plane: contexts,
// workers, memory registration, remote keys, client endpoints, and waiting
// for batches of requests with a deadline.
//
// Threading: a Worker (and the endpoints and requests made on it) belongs to
// one thread at a time (UCS_THREAD_MODE_SINGLE). Contexts (created with
// mt_workers_shared) and memory regions may be shared between threads.
//
// Transports follow UCX's own configuration (UCX_TLS, UCX_NET_DEVICES, ...).
// Unless the environment says otherwise, Context sets the TCP transport's
// segment sizes to 512 KiB, which more than doubles its bandwidth for
// large blocks (docs/dataplane.md).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::ucx {

using Clock = std::chrono::steady_clock;

absl::Status FromUcs(ucs_status_t status, const std::string& what);

// Whether UCX_TLS (unset: all) lets UCX use a network transport, which
// endpoints with peer-failure handling need (UCX 1.13's shared-memory
// transports have none).
bool NetworkTransportsAllowed();

class Context {
 public:
  static absl::StatusOr<std::shared_ptr<Context>> Create();
  ~Context();
  ucp_context_h get() const { return ctx_; }

 private:
  explicit Context(ucp_context_h c) : ctx_(c) {}
  ucp_context_h ctx_;
};

class Worker {
 public:
  // wakeup: the worker can be waited on through efd() (the store's progress thread).
  static absl::StatusOr<std::unique_ptr<Worker>> Create(std::shared_ptr<Context> ctx, bool wakeup);
  ~Worker();
  ucp_worker_h get() const { return worker_; }
  const std::shared_ptr<Context>& context() const { return ctx_; }
  unsigned Progress() { return ucp_worker_progress(worker_); }
  // This worker's address, for peers to connect to it directly.
  absl::StatusOr<std::string> Address();
  // Event fd for epoll (REQUIRES: created with wakeup).
  absl::StatusOr<int> EventFd();

  // Waits until every request in reqs completes (nullptr and error pointers
  // count as complete) or the deadline passes, polling while transfers make
  // progress and sleeping on the worker's event fd (up to 1 ms at a time)
  // once they have made none for 50 us, so a waiting lane leaves the CPU to
  // the threads that move its bytes (the store's progress thread on TCP); on the deadline the rest
  // are cancelled, and half a second later abandoned (UCX frees them when they end). Frees the
  // requests. Returns the first error. The caller should drop the endpoint after a deadline error.
  // close_endpoint: how to force-close the endpoint the requests were
  // posted on. Given, requests that survive the cancel are not abandoned
  // (they could still write into buffers the caller is about to free): the
  // endpoint is closed and progress goes on until every request has
  // completed (10 s at most, then they are left to UCX and logged).
  absl::Status WaitAll(std::vector<void*>& reqs, Clock::time_point deadline,
                       const std::function<void()>& close_endpoint = nullptr);
  // Progresses (sleeping as WaitAll does when idle) until done() or the
  // deadline; returns done().
  bool WaitUntil(const std::function<bool()>& done, Clock::time_point deadline);
  // Calls cb(arg, ...) on this worker's thread, from Progress, for each
  // active message `id` that arrives (ucp_worker_set_am_recv_handler).
  absl::Status SetAmHandler(uint16_t id, ucp_am_recv_callback_t cb, void* arg);

 private:
  // Sleeps on the event fd (up to 1 ms) once nothing has progressed for
  // 50 us since last_progress, which it then moves to now.
  void RestIfIdle(Clock::time_point& last_progress);
  Worker(std::shared_ptr<Context> ctx, ucp_worker_h w) : ctx_(std::move(ctx)), worker_(w) {}
  std::shared_ptr<Context> ctx_;
  ucp_worker_h worker_;
  int efd_ = -2;  // the event fd once asked for (-1: none to be had)
};

// A registration of [addr, addr + length) with a context, for zero-copy RMA.
class MemoryRegion {
 public:
  static absl::StatusOr<std::unique_ptr<MemoryRegion>> Map(std::shared_ptr<Context> ctx, void* addr,
                                                           size_t length);
  ~MemoryRegion();
  ucp_mem_h memh() const { return memh_; }
  void* addr() const { return addr_; }
  size_t length() const { return length_; }
  bool contains(const void* p, size_t n) const {
    auto a = static_cast<const uint8_t*>(p), b = static_cast<const uint8_t*>(addr_);
    return a >= b && a + n <= b + length_;
  }
  // The packed remote key a peer unpacks to reach this region.
  absl::StatusOr<std::string> PackRkey() const;

 private:
  MemoryRegion(std::shared_ptr<Context> ctx, ucp_mem_h m, void* a, size_t l)
      : ctx_(std::move(ctx)), memh_(m), addr_(a), length_(l) {}
  std::shared_ptr<Context> ctx_;
  ucp_mem_h memh_;
  void* addr_;
  size_t length_;
};

class RemoteKey {
 public:
  explicit RemoteKey(ucp_rkey_h k) : rkey_(k) {}
  ~RemoteKey() { ucp_rkey_destroy(rkey_); }
  ucp_rkey_h get() const { return rkey_; }

 private:
  ucp_rkey_h rkey_;
};

// A client endpoint to a UCX sockaddr listener, with peer-failure handling:
// a dead peer fails its requests instead of hanging them.
class Endpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Endpoint>> Connect(Worker* worker, const std::string& host,
                                                           int port);
  // Connects to a worker address: any transport both sides share. UCX 1.13
  // offers its shared-memory transports only without peer-failure handling;
  // then a dead peer surfaces through operation deadlines, not at once.
  static absl::StatusOr<std::unique_ptr<Endpoint>> ConnectToWorker(Worker* worker,
                                                                   const std::string& address,
                                                                   bool peer_failure_handling);
  // Closes (forcibly if the peer failed); waits at most a second.
  ~Endpoint();
  ucp_ep_h get() const { return ep_; }
  bool failed() const { return failed_; }
  // Treat the peer as failed: the destructor then closes forcibly, which
  // ends every operation still outstanding on this endpoint.
  void MarkFailed() { failed_ = true; }
  absl::StatusOr<std::unique_ptr<RemoteKey>> Unpack(const std::string& packed);
  // Remote completion of everything posted so far.
  absl::Status Flush(Clock::time_point deadline);

 private:
  Endpoint(Worker* w) : worker_(w) {}
  static void OnError(void* arg, ucp_ep_h ep, ucs_status_t status);
  Worker* worker_;
  ucp_ep_h ep_ = nullptr;
  std::atomic<bool> failed_{false};
};

}  // namespace kvtier::ucx
