// The store side of the socket data plane (common/data_wire.h), the default
// data plane: a TCP listener (one accept thread) and a few event loops
// (epoll, one thread each; a connection belongs to one) that serve each
// connection's control calls and transfers in order, with non-blocking
// sockets, so an idle connection costs a few hundred bytes and no thread,
// and a slow client holds no thread. Handlers run on the loop's thread. The store
// moves every byte itself: a get is written from the leased slot straight
// into the socket, a put read from the socket straight into the reserved
// slot, each only after the grant function (the service: the session's
// tenant, a live lease of the right kind whose slot holds the whole range)
// allowed it. Nothing a client sends names memory the store did not check,
// so no client reaches other tenants' blocks, the arena past its leases, or
// the rest of the process (docs/security.md). A malformed or refused
// request gets its status; the connection stays (a put's refused bytes are
// read and dropped) unless the frame itself is unusable.
// With Options::tls, every connection is TLS 1.3 (common/tls_stream.h) from
// its first byte: the handshake comes before the challenge, within the
// hello deadline, and runs on the loop like any other step.
// Connections are bounded (Options): in all, without a hello yet (the
// oldest such is evicted for a new one), in time to the hello, and idle;
// the service's HelloFn bounds each tenant's. Refusals are counted (Stats)
// and logged at most once a second.
// Thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/limits.h"
#include "common/tls_stream.h"

namespace kvtier::store {

// Bytes of call bodies being read at once, within a cap (one per tenant,
// or the data plane's own for a store without tenants). Thread-safe.
class ByteBudget {
 public:
  // `limit`: how a refusal names the setting (e.g. "buffered= of tenant a").
  ByteBudget(uint64_t cap, std::string limit) : cap_(cap), limit_(std::move(limit)) {}
  // Counts n more bytes; false (nothing counted) past the cap.
  bool Take(uint64_t n) {
    uint64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (n > cap_ - std::min(used, cap_)) return false;
    } while (!used_.compare_exchange_weak(used, used + n, std::memory_order_relaxed));
    return true;
  }
  void Give(uint64_t n) { used_.fetch_sub(n, std::memory_order_relaxed); }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t cap() const { return cap_; }
  const std::string& limit() const { return limit_; }

 private:
  const uint64_t cap_;
  const std::string limit_;
  std::atomic<uint64_t> used_{0};
};

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
  // What an admitted connection holds while it lives: a ticket (its
  // tenant's connection count; may be null) and the budget its call bodies
  // count against (its tenant's; null: the data plane's own).
  struct Admission {
    std::shared_ptr<void> ticket;
    std::shared_ptr<ByteBudget> buffer;
  };
  // Whether a connection may act as session `id`, whose hello carried
  // `proof` for the store's `nonce` (common/data_hello.h): its Admission,
  // or the status it is closed with (UNAUTHENTICATED for a session the
  // store does not know or a proof that does not hold, RESOURCE_EXHAUSTED
  // for a tenant at its limit).
  using HelloFn = std::function<absl::StatusOr<Admission>(
      std::string_view id, std::string_view nonce, std::string_view proof)>;

  struct Options {
    // Connections open at once: more are closed at accept.
    size_t max_connections = limits::kDataConnections;
    // Connections that have not presented a session yet: past it, a new
    // one evicts the oldest of them (a client sends its hello at once; a
    // flood of silent connections only ever evicts itself).
    size_t max_unhelloed = limits::kDataUnhelloed;
    // How long a new connection has to present its session.
    std::chrono::milliseconds hello_timeout{limits::kDataHelloMs};
    // How long an authenticated connection may wait between requests.
    std::chrono::milliseconds idle_timeout{limits::kDataIdleMs};
    // Bytes of call bodies being read at once on connections whose
    // admission names no budget of its own (a store without tenants).
    uint64_t max_buffered_bytes = limits::kDataBufferedBytes;
    // Event-loop threads (0: two per core, at most 8).
    size_t threads = 0;
    // A server context: every connection speaks TLS (null: plaintext).
    std::shared_ptr<net::TlsContext> tls;
  };
  // Connections turned away or closed, by why (counters).
  struct Stats {
    uint64_t refused_full = 0;           // max_connections open already
    uint64_t evicted_unhelloed = 0;      // evicted by a newer connection
    uint64_t hello_timeouts = 0;         // no hello within hello_timeout
    uint64_t hellos_refused = 0;         // HelloFn said no
    uint64_t idle_closed = 0;            // idle past idle_timeout
    uint64_t calls_refused_buffer = 0;   // a call body past its budget (answered, not closed)
    uint64_t tls_handshakes_failed = 0;  // not TLS, or a handshake that failed
    uint64_t tls_kernel = 0;             // TLS connections the kernel encrypts (kTLS)
  };

  // listen: HOST:PORT (port 0 picks one).
  static absl::StatusOr<std::unique_ptr<SocketDataPlane>> Start(const std::string& listen,
                                                                Options options);
  static absl::StatusOr<std::unique_ptr<SocketDataPlane>> Start(const std::string& listen) {
    return Start(listen, Options());
  }
  // Closes the listener and every connection, and joins the threads.
  ~SocketDataPlane();

  // Sets (nullptr: clears) the handlers; requests that arrive without them
  // are answered UNAVAILABLE. Returns once no request runs the old ones.
  void SetHandlers(CallHandler call, GrantFn grant, HelloFn hello);

  // HOST:PORT actually bound.
  const std::string& address() const { return address_; }
  // Whether connections speak TLS (Options::tls).
  bool tls() const { return options_.tls != nullptr; }
  size_t connections() const { return connections_.load(); }
  // Of those, the ones that have not presented a session yet.
  size_t unhelloed() const { return unhelloed_.load(); }
  Stats stats() const;

 private:
  enum State : int { kUnhelloed, kAuthenticated, kEvicted };
  struct Connection;  // socket_dataplane.cc
  class Loop;         // socket_dataplane.cc
  SocketDataPlane() = default;
  void AcceptLoop();
  // The connection leaves kUnhelloed for `to`; false if another thread
  // moved it first.
  bool Leave(Connection* c, State to);
  // Evicts the oldest connection still without a hello (accept thread).
  void EvictOldestUnhelloed();
  // Logs at most once a second (and how many were not logged).
  void LogLimited(const std::string& what);

  int listen_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: readable once stopping
  Options options_;
  std::string address_;
  std::thread acceptor_;
  std::vector<std::unique_ptr<Loop>> loops_;
  // Connections in accept order that may still be without a hello (accept
  // thread; pruned as it goes).
  std::deque<std::weak_ptr<Connection>> unhelloed_order_;
  std::atomic<size_t> connections_{0};
  std::atomic<size_t> unhelloed_{0};
  std::atomic<uint64_t> refused_full_{0}, evicted_{0}, hello_timeouts_{0}, hellos_refused_{0},
      idle_closed_{0}, calls_refused_buffer_{0}, tls_failed_{0}, tls_kernel_{0};
  std::unique_ptr<ByteBudget> buffered_;  // Options::max_buffered_bytes
  std::mutex log_mu_;
  std::chrono::steady_clock::time_point last_log_;  // guarded by log_mu_
  uint64_t unlogged_ = 0;                           // guarded by log_mu_
  // Held shared while a request runs a handler; SetHandlers takes it
  // exclusively.
  std::shared_mutex handlers_mu_;
  CallHandler call_;  // guarded by handlers_mu_
  GrantFn grant_;     // guarded by handlers_mu_
  HelloFn hello_;     // guarded by handlers_mu_
};

}  // namespace kvtier::store
