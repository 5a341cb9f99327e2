// The socket data plane's inside (cachestore/socket_dataplane.h): its
// limits, a connection's state and an event loop's, shared by its files:
// socket_dataplane.cc (a loop's I/O: handshakes, frames, replies, closing),
// socket_dataplane_requests.cc (a finished frame's call or transfer) and
// socket_dataplane_listener.cc (start, accepting, eviction, stats).
#pragma once

#include "cachestore/socket_dataplane.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data_hello.h"
#include "common/data_wire.h"
#include "common/log.h"
#include "common/socket_io.h"
#include "common/ucx/calls.h"

namespace kvtier::store {

inline constexpr int kInvalidArgument = 3;
inline constexpr int kResourceExhausted = 8;
inline constexpr int kUnavailable = 14;
// A call body is read this much at a time (and a buffer past it is freed
// after the call).
inline constexpr size_t kReadChunk = 64 << 10;
// How long a client may take to send the rest of a frame it began, or to
// take a reply that is not a transfer's (a transfer has its lease's deadline).
inline constexpr auto kFrameTime = std::chrono::seconds(30);
// How long a connection that ends on an error reply is drained (so the
// reply is not lost to a reset) before it is closed.
inline constexpr auto kLingerTime = std::chrono::seconds(1);
// How long a loop that just served something polls for more before it
// sleeps (a busy client's next request comes within microseconds, and a
// wake-up costs as much again). One spin per loop, not per connection.
inline constexpr auto kSpin = std::chrono::microseconds(50);
// Bytes one connection moves in one turn before the loop's others get
// theirs.
inline constexpr uint64_t kTurnBytes = 2 << 20;
// A call that holds its loop this long is logged.
inline constexpr auto kSlowCall = std::chrono::milliseconds(500);
// Deadlines are checked at most this often (and at least once a second).
inline constexpr auto kSweepMin = std::chrono::milliseconds(10);
inline constexpr auto kSweepMax = std::chrono::seconds(1);
inline constexpr size_t kMaxLoops = 8;
inline constexpr int kEvents = 128;

// One data-plane connection. `fd` and `state` may be touched by the accept
// thread (eviction); the rest belongs to the connection's loop.
struct SocketDataPlane::Connection {
  std::mutex fd_mu;  // guards fd: the loop closes it, the accept thread shuts it down
  int fd = -1;       // -1 once closed
  std::atomic<int> state{kUnhelloed};
  // In connections_ until evicted or closed, whichever comes first (an
  // evicted connection stops counting at once, before its loop closes it).
  std::atomic<bool> counted{true};

  // What a finished read was for.
  enum class Read { kHelloFrame, kHelloBody, kFrame, kCallBody, kPutBody, kDiscard, kDrain };
  // What comes after a finished reply.
  enum class Then { kHello, kNextFrame, kDiscard, kLinger };
  bool closed = false;
  bool writing = false;
  bool idle = false;                    // waiting for a request, none of it read yet
  bool lingering = false;               // draining after an error reply
  bool registered = false;              // in its loop's epoll set
  bool queued = false;                  // in its loop's ready list
  bool handshaking = false;             // TLS: before the challenge
  std::unique_ptr<net::TlsStream> tls;  // null: plaintext
  net::Clock::time_point deadline;
  // Reading: `left` more bytes into `to` (nullptr: dropped; kCallBody:
  // appended to `request`).
  Read reading = Read::kHelloFrame;
  uint8_t* to = nullptr;
  uint64_t left = 0;
  // Writing: `out` from `out_at`, then `data_left` bytes at `data`.
  std::string out;
  size_t out_at = 0;
  const uint8_t* data = nullptr;
  uint64_t data_left = 0;
  Then then = Then::kNextFrame;
  uint64_t discard = 0;  // Then::kDiscard: bytes to drop after the reply

  wire::Frame f;
  std::string nonce;
  std::string hello = std::string(wire::kHelloBytes, '\0');
  std::string session;  // the connection acts as this session once helloed
  std::string request;
  Admission admission;           // the tenant's count of it, its budget
  ByteBudget* budget = nullptr;  // the call body being read counts here
  uint64_t budgeted = 0;         // this much
  std::shared_ptr<void> hold;    // a granted transfer's slot
};

// An epoll loop on one thread serving the connections given to it.
class SocketDataPlane::Loop {
 public:
  explicit Loop(SocketDataPlane* plane) : p_(plane) {}
  ~Loop() {
    if (thread_.joinable()) thread_.join();
    if (epfd_ >= 0) close(epfd_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }
  absl::Status Start() {
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epfd_ < 0 || wake_fd_ < 0) {
      return absl::InternalError(absl::StrCat("data plane loop: ", std::strerror(errno)));
    }
    epoll_event stop{EPOLLIN, {.ptr = nullptr}}, wake{EPOLLIN, {.ptr = this}};
    if (epoll_ctl(epfd_, EPOLL_CTL_ADD, p_->stop_fd_, &stop) != 0 ||
        epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &wake) != 0) {
      return absl::InternalError(
          absl::StrCat("data plane loop: epoll_ctl: ", std::strerror(errno)));
    }
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }
  // Takes a new connection (accept thread).
  void Adopt(std::shared_ptr<Connection> c) {
    {
      std::lock_guard lk(inbox_mu_);
      inbox_.push_back(std::move(c));
    }
    size_++;
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  size_t size() const { return size_.load(std::memory_order_relaxed); }

 private:
  using Read = Connection::Read;
  using Then = Connection::Then;

  void Run();
  void TakeInbox();
  void Sweep();
  void Begin(Connection* c);
  // A TLS handshake's next step; true once it is over (the challenge sent
  // or the connection closed).
  bool Handshake(Connection* c);
  void Challenge(Connection* c);
  // Moves bytes and takes the steps that follow until the connection must
  // wait (or its turn is over).
  void Progress(Connection* c);
  // Moves bytes of the current read or write: true once it is whole.
  bool Move(Connection* c, uint64_t* moved);
  // The step after a whole read or write.
  void Finished(Connection* c);
  void Request(Connection* c);  // a whole frame header
  void ReadInto(Connection* c, Read what, void* to, uint64_t n, net::Clock::time_point by);
  void NextFrame(Connection* c);
  void Reply(Connection* c, int code, std::string_view message, const uint8_t* data, uint64_t n,
             net::Clock::time_point by, Then then);
  void Linger(Connection* c);
  void Close(Connection* c);
  // Its turn is over with bytes still to move: it goes on the ready list
  // (an edge-triggered socket reports nothing new for bytes already there).
  void Requeue(Connection* c);
  void SetDeadline(Connection* c, net::Clock::time_point by) {
    c->deadline = by;
    next_sweep_ = std::min(next_sweep_, by);
  }

  SocketDataPlane* const p_;
  int epfd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<size_t> size_{0};
  std::mutex inbox_mu_;
  std::vector<std::shared_ptr<Connection>> inbox_;  // guarded by inbox_mu_
  // The loop thread's alone from here.
  std::unordered_map<Connection*, std::shared_ptr<Connection>> conns_;
  // Closed during this batch of events (their events may follow).
  std::vector<std::shared_ptr<Connection>> closed_;
  // Connections whose turn ended with bytes still to move.
  std::vector<std::shared_ptr<Connection>> ready_;
  net::Clock::time_point next_sweep_ = net::Clock::time_point::max();
  std::vector<char> scratch_ = std::vector<char>(kReadChunk);  // dropped bytes land here
};

}  // namespace kvtier::store
