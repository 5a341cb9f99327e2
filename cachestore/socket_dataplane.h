// The store side of the socket data plane (common/data_wire.h), the default
// data plane: a TCP listener and one thread per client connection that
// serves, in order, the connection's control calls and transfers. The store
// moves every byte itself: a get is written from the leased slot straight
// into the socket, a put read from the socket straight into the reserved
// slot, each only after the grant function (the service: the session's
// tenant, a live lease of the right kind whose slot holds the whole range)
// allowed it. Nothing a client sends names memory the store did not check,
// so no client reaches other tenants' blocks, the arena past its leases, or
// the rest of the process (docs/security.md). A malformed or refused
// request gets its status; the connection stays (a put's refused bytes are
// read and dropped) unless the frame itself is unusable.
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/statusor.h"

namespace kvtier::store {

class SocketDataPlane {
 public:
  // A call's answer: a google.rpc.Code and the response (or the error's text).
  struct CallReply {
    int code = 0;
    std::string body;
  };
  using CallHandler =
      std::function<CallReply(uint16_t method, std::string_view session, std::string_view request)>;
  // What a granted transfer may touch: `length` bytes at `at`, until
  // `deadline`; `hold` keeps the lease's slot from reuse while it lives.
  struct Grant {
    uint8_t* at = nullptr;
    std::chrono::steady_clock::time_point deadline;
    std::shared_ptr<void> hold;
  };
  using GrantFn = std::function<absl::StatusOr<Grant>(
      std::string_view session, bool is_put, uint64_t lease, uint64_t addr, uint64_t length)>;
  // Whether a connection may present `session` (OK) or is closed with the
  // status (UNAUTHENTICATED for a session the store does not know).
  using HelloFn = std::function<absl::Status(std::string_view session)>;

  // listen: HOST:PORT (port 0 picks one). At most max_connections at once
  // (more are closed at accept).
  static absl::StatusOr<std::unique_ptr<SocketDataPlane>> Start(const std::string& listen,
                                                                size_t max_connections = 4096);
  // Closes the listener and every connection, and joins their threads.
  ~SocketDataPlane();

  // Sets (nullptr: clears) the handlers; requests that arrive without them
  // are answered UNAVAILABLE. Returns once no request runs the old ones.
  void SetHandlers(CallHandler call, GrantFn grant, HelloFn hello);

  // HOST:PORT actually bound.
  const std::string& address() const { return address_; }
  size_t connections() const { return connections_.load(); }

 private:
  struct Connection {
    int fd = -1;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  SocketDataPlane() = default;
  void AcceptLoop();
  void Serve(Connection* c);
  // Joins the connections that ended (accept thread only).
  void Reap();

  int listen_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: readable once stopping
  size_t max_connections_ = 0;
  std::string address_;
  std::thread acceptor_;
  std::list<std::unique_ptr<Connection>> conns_;  // accept thread (and destructor)
  std::atomic<size_t> connections_{0};
  // Held shared while a request runs a handler; SetHandlers takes it
  // exclusively.
  std::shared_mutex handlers_mu_;
  CallHandler call_;  // guarded by handlers_mu_
  GrantFn grant_;     // guarded by handlers_mu_
  HelloFn hello_;     // guarded by handlers_mu_
};

}  // namespace kvtier::store
