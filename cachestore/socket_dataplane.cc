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

namespace {

constexpr int kInvalidArgument = 3;
constexpr int kResourceExhausted = 8;
constexpr int kUnavailable = 14;
// A call body is read this much at a time (and a buffer past it is freed
// after the call).
constexpr size_t kReadChunk = 64 << 10;
// How long a client may take to send the rest of a frame it began, or to
// take a reply that is not a transfer's (a transfer has its lease's deadline).
constexpr auto kFrameTime = std::chrono::seconds(30);
// How long a connection that ends on an error reply is drained (so the
// reply is not lost to a reset) before it is closed.
constexpr auto kLingerTime = std::chrono::seconds(1);
// How long a loop that just served something polls for more before it
// sleeps (a busy client's next request comes within microseconds, and a
// wake-up costs as much again). One spin per loop, not per connection.
constexpr auto kSpin = std::chrono::microseconds(50);
// Bytes one connection moves in one turn before the loop's others get
// theirs.
constexpr uint64_t kTurnBytes = 2 << 20;
// Deadlines are checked at most this often (and at least once a second).
constexpr auto kSweepMin = std::chrono::milliseconds(10);
constexpr auto kSweepMax = std::chrono::seconds(1);
constexpr size_t kMaxLoops = 8;
constexpr int kEvents = 128;

}  // namespace

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

void SocketDataPlane::Loop::Run() {
  epoll_event ev[kEvents];
  bool served = false;
  for (;;) {
    int n = epoll_wait(epfd_, ev, kEvents, 0);
    for (const auto spin_end = net::Clock::now() + kSpin;
         served && ready_.empty() && n == 0 && net::Clock::now() < spin_end;) {
      n = epoll_wait(epfd_, ev, kEvents, 0);
    }
    if (n == 0 && ready_.empty()) {
      int timeout = -1;
      if (!conns_.empty()) {
        const auto wait = std::chrono::ceil<std::chrono::milliseconds>(
            std::max(next_sweep_, net::Clock::now() + kSweepMin) - net::Clock::now());
        timeout = static_cast<int>(std::min<int64_t>(wait.count(), 1000));
      }
      n = epoll_wait(epfd_, ev, kEvents, timeout);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      Log("store", "data plane loop: epoll_wait failed: ", std::strerror(errno));
      break;
    }
    served = false;
    bool stop = false;
    for (int i = 0; i < n; ++i) {
      void* tag = ev[i].data.ptr;
      if (tag == nullptr) {
        stop = true;
      } else if (tag == this) {
        TakeInbox();
      } else if (auto* c = static_cast<Connection*>(tag); !c->closed) {
        Progress(c);
        served = true;
      }
    }
    if (!ready_.empty()) {
      std::vector<std::shared_ptr<Connection>> turn;
      turn.swap(ready_);
      for (auto& c : turn) {
        c->queued = false;
        if (!c->closed) Progress(c.get());
      }
      served = true;
    }
    closed_.clear();
    if (stop) break;
    if (net::Clock::now() >= next_sweep_) Sweep();
  }
  std::vector<Connection*> all;
  for (auto& [raw, c] : conns_) all.push_back(raw);
  for (Connection* c : all) Close(c);
  closed_.clear();
}

void SocketDataPlane::Loop::TakeInbox() {
  uint64_t count;
  (void)!read(wake_fd_, &count, sizeof(count));
  std::vector<std::shared_ptr<Connection>> batch;
  {
    std::lock_guard lk(inbox_mu_);
    batch.swap(inbox_);
  }
  for (auto& c : batch) {
    Connection* raw = c.get();
    // Edge-triggered, both ways, once: a connection's interest never
    // changes, so serving it costs no epoll_ctl.
    epoll_event e{EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, {.ptr = raw}};
    conns_.emplace(raw, std::move(c));
    if (epoll_ctl(epfd_, EPOLL_CTL_ADD, raw->fd, &e) != 0) {
      p_->LogLimited(absl::StrCat(
          "a connection could not join its loop (epoll_ctl: ", std::strerror(errno), "); closed"));
      Close(raw);
      continue;
    }
    raw->registered = true;
    Begin(raw);
  }
  closed_.clear();
}

void SocketDataPlane::Loop::Sweep() {
  const auto now = net::Clock::now();
  auto next = now + kSweepMax;
  std::vector<Connection*> late;
  for (auto& [raw, c] : conns_) {
    if (c->deadline <= now) {
      late.push_back(raw);
    } else {
      next = std::min(next, c->deadline);
    }
  }
  for (Connection* c : late) {
    if (c->lingering) {
      // Drained long enough.
    } else if (c->state.load() == kUnhelloed) {
      p_->hello_timeouts_++;
    } else if (c->idle) {
      p_->idle_closed_++;
    }
    Close(c);
  }
  closed_.clear();
  next_sweep_ = std::max(next, now + kSweepMin);
}

void SocketDataPlane::Loop::Begin(Connection* c) {
  SetDeadline(c, net::Clock::now() + p_->options_.hello_timeout);
  if (p_->options_.tls) {
    // TLS from the first byte: the challenge and everything after it are
    // records only this connection's peer can read.
    c->tls = net::TlsStream::Accept(*p_->options_.tls, c->fd);
    if (!c->tls) {
      p_->tls_failed_++;
      p_->LogLimited("no memory for a TLS connection; closed");
      Close(c);
      return;
    }
    c->handshaking = true;
    Progress(c);
    return;
  }
  Challenge(c);
}

bool SocketDataPlane::Loop::Handshake(Connection* c) {
  switch (c->tls->Handshake()) {
    case net::TlsStream::Step::kWantRead:
    case net::TlsStream::Step::kWantWrite:
      return false;  // on the next edge
    case net::TlsStream::Step::kFailed:
      if (c->state.load() != kEvicted) {  // not the eviction's shutdown
        p_->tls_failed_++;
        p_->LogLimited(absl::StrCat("a data-plane connection failed its TLS handshake (",
                                    c->tls->error(), "); closed"));
      }
      Close(c);
      return true;
    case net::TlsStream::Step::kDone:
      break;
  }
  c->handshaking = false;
  if (c->tls->KernelSend()) p_->tls_kernel_++;
  Challenge(c);
  return true;
}

void SocketDataPlane::Loop::Challenge(Connection* c) {
  // The challenge first: a nonce the hello's proof must cover, so a hello
  // read off the wire opens no other connection (common/data_hello.h).
  // The hello (its frame, the session id and the proof) is due within
  // hello_timeout of accept.
  c->nonce = wire::FreshNonce();
  if (c->nonce.empty()) {
    p_->LogLimited("no randomness for a challenge; connection closed");
    Close(c);
    return;
  }
  wire::Reply challenge;
  challenge.magic = wire::kChallengeMagic;
  challenge.data_bytes = c->nonce.size();
  c->out.assign(reinterpret_cast<const char*>(&challenge), sizeof(challenge));
  c->out += c->nonce;
  c->out_at = 0;
  c->data = nullptr;
  c->data_left = 0;
  c->writing = true;
  c->then = Then::kHello;
  Progress(c);
}

void SocketDataPlane::Loop::Progress(Connection* c) {
  if (c->handshaking) {
    Handshake(c);  // which goes on with the challenge once it is over
    return;
  }
  uint64_t moved = 0;
  while (!c->closed && Move(c, &moved)) Finished(c);
}

bool SocketDataPlane::Loop::Move(Connection* c, uint64_t* moved) {
  if (c->writing) {
    while (c->out_at < c->out.size() || c->data_left > 0) {
      if (*moved >= kTurnBytes) {
        Requeue(c);  // the rest next turn
        return false;
      }
      iovec v[2];
      size_t k = 0;
      if (c->out_at < c->out.size())
        v[k++] = {c->out.data() + c->out_at, c->out.size() - c->out_at};
      if (c->data_left > 0) {
        v[k++] = {const_cast<uint8_t*>(c->data),
                  static_cast<size_t>(std::min<uint64_t>(c->data_left, kTurnBytes))};
      }
      msghdr m{};
      m.msg_iov = v;
      m.msg_iovlen = k;
      const ssize_t w = c->tls ? c->tls->Send(v, k) : sendmsg(c->fd, &m, MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return false;  // on the next edge
        Close(c);                                                   // the peer went
        return false;
      }
      uint64_t done = static_cast<uint64_t>(w);
      *moved += done;
      const size_t from_out = std::min<uint64_t>(done, c->out.size() - c->out_at);
      c->out_at += from_out;
      done -= from_out;
      c->data += done;
      c->data_left -= done;
    }
    return true;
  }
  while (c->left > 0) {
    if (*moved >= kTurnBytes) {
      Requeue(c);  // the rest next turn
      return false;
    }
    char* at;
    size_t want = static_cast<size_t>(std::min<uint64_t>(c->left, kReadChunk));
    size_t grown_from = 0;
    if (c->reading == Read::kCallBody) {
      // The buffer grows with the bytes received, not with the length a
      // frame declares.
      grown_from = c->request.size();
      c->request.resize(grown_from + want);
      at = c->request.data() + grown_from;
    } else if (c->to == nullptr) {
      at = scratch_.data();
    } else {
      at = reinterpret_cast<char*>(c->to);
      want = static_cast<size_t>(std::min<uint64_t>(c->left, kTurnBytes));
    }
    const ssize_t r = c->tls ? c->tls->Recv(at, want) : recv(c->fd, at, want, 0);
    if (c->reading == Read::kCallBody) c->request.resize(grown_from + std::max<ssize_t>(r, 0));
    if (r == 0) {
      Close(c);  // the peer closed
      return false;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;  // on the next edge
      Close(c);
      return false;
    }
    if (c->idle) {  // a request has begun: the rest of its frame is due soon
      c->idle = false;
      SetDeadline(c, net::Clock::now() + kFrameTime);
    }
    c->left -= static_cast<uint64_t>(r);
    if (c->to != nullptr) c->to += r;
    *moved += static_cast<uint64_t>(r);
  }
  return true;
}

void SocketDataPlane::Loop::Requeue(Connection* c) {
  if (c->queued) return;
  auto it = conns_.find(c);
  if (it == conns_.end()) return;
  c->queued = true;
  ready_.push_back(it->second);
}

void SocketDataPlane::Loop::ReadInto(Connection* c, Read what, void* to, uint64_t n,
                                     net::Clock::time_point by) {
  c->writing = false;
  c->reading = what;
  c->to = static_cast<uint8_t*>(to);
  c->left = n;
  SetDeadline(c, by);
}

void SocketDataPlane::Loop::NextFrame(Connection* c) {
  c->hold.reset();
  ReadInto(c, Read::kFrame, &c->f, sizeof(c->f), net::Clock::now() + p_->options_.idle_timeout);
  c->idle = true;
}

void SocketDataPlane::Loop::Reply(Connection* c, int code, std::string_view message,
                                  const uint8_t* data, uint64_t n, net::Clock::time_point by,
                                  Then then) {
  wire::Reply r;
  r.code = code;
  r.message_bytes = static_cast<uint32_t>(message.size());
  r.data_bytes = n;
  c->out.assign(reinterpret_cast<const char*>(&r), sizeof(r));
  c->out.append(message);
  c->out_at = 0;
  c->data = data;
  c->data_left = n;
  c->writing = true;
  c->then = then;
  SetDeadline(c, by);
}

void SocketDataPlane::Loop::Linger(Connection* c) {
  // The peer sees the end now; what it still sends is drained for a moment
  // so that the error reply is not lost to a reset.
  if (c->tls) c->tls->Shutdown();
  shutdown(c->fd, SHUT_WR);
  c->lingering = true;
  ReadInto(c, Read::kDrain, nullptr, ~uint64_t{0}, net::Clock::now() + kLingerTime);
}

void SocketDataPlane::Loop::Close(Connection* c) {
  if (c->closed) return;
  c->closed = true;
  {
    std::lock_guard lk(c->fd_mu);
    if (c->registered) epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
    c->tls.reset();
    close(c->fd);
    c->fd = -1;
  }
  p_->Leave(c, kEvicted);  // a connection that ends before its hello
  if (c->budget != nullptr) c->budget->Give(c->budgeted);
  c->budget = nullptr;
  c->hold.reset();
  c->admission = {};
  if (c->counted.exchange(false)) p_->connections_--;
  size_--;
  auto it = conns_.find(c);
  if (it != conns_.end()) {
    closed_.push_back(std::move(it->second));
    conns_.erase(it);
  }
}

void SocketDataPlane::Loop::Finished(Connection* c) {
  const auto soon = [] { return net::Clock::now() + kFrameTime; };
  if (c->writing) {
    c->out.clear();
    if (c->out.capacity() > kReadChunk) std::string().swap(c->out);
    switch (c->then) {
      case Then::kHello:
        ReadInto(c, Read::kHelloFrame, &c->f, sizeof(c->f), c->deadline);
        return;
      case Then::kNextFrame:
        NextFrame(c);
        return;
      case Then::kDiscard:
        ReadInto(c, Read::kDiscard, nullptr, c->discard, soon());
        return;
      case Then::kLinger:
        Linger(c);
        return;
    }
    return;
  }
  switch (c->reading) {
    case Read::kHelloFrame:
      if (c->f.magic != wire::kFrameMagic || c->f.op != wire::kHello ||
          c->f.length != wire::kHelloBytes) {
        Reply(
            c, kInvalidArgument,
            absl::StrCat("the first frame on the data plane must be a hello of ", wire::kHelloBytes,
                         " bytes: the session id and its proof for the store's challenge"),
            nullptr, 0, soon(), Then::kLinger);
        return;
      }
      ReadInto(c, Read::kHelloBody, c->hello.data(), c->hello.size(), c->deadline);
      return;
    case Read::kHelloBody: {
      c->session = c->hello.substr(0, wire::kSessionIdBytes);
      // Only a session ConnectDataPlane handed out, proven with its key,
      // keeps a connection.
      absl::StatusOr<Admission> known;
      {
        std::shared_lock lk(p_->handlers_mu_);
        known = p_->hello_
                    ? p_->hello_(c->session, c->nonce,
                                 std::string_view(c->hello).substr(wire::kSessionIdBytes))
                    : absl::UnavailableError("the store is not taking data-plane connections");
      }
      if (known.ok()) {
        c->admission = std::move(*known);
      } else {
        p_->hellos_refused_++;
      }
      // Evicted meanwhile (it was the oldest without a hello): closed.
      if (!p_->Leave(c, kAuthenticated)) {
        Close(c);
        return;
      }
      Reply(c, static_cast<int>(known.status().code()), std::string(known.status().message()),
            nullptr, 0, soon(), known.ok() ? Then::kNextFrame : Then::kLinger);
      return;
    }
    case Read::kFrame:
      Request(c);
      return;
    case Read::kCallBody: {
      CallReply r;
      {
        std::shared_lock lk(p_->handlers_mu_);
        r = p_->call_ ? p_->call_(c->f.method, c->session, c->request)
                      : CallReply{kUnavailable, "the store is not taking data-plane calls"};
      }
      c->budget->Give(c->budgeted);
      c->budget = nullptr;
      // An idle connection keeps no large buffer.
      c->request.clear();
      if (c->request.capacity() > kReadChunk) std::string().swap(c->request);
      // The reply is owned by the connection until it is written.
      Reply(c, r.code, r.body, nullptr, 0, soon(), Then::kNextFrame);
      return;
    }
    case Read::kPutBody:
      Reply(c, 0, {}, nullptr, 0, soon(), Then::kNextFrame);
      return;
    case Read::kDiscard:
      NextFrame(c);
      return;
    case Read::kDrain:
      Close(c);
      return;
  }
}

void SocketDataPlane::Loop::Request(Connection* c) {
  const auto soon = [] { return net::Clock::now() + kFrameTime; };
  const wire::Frame& f = c->f;
  if (f.magic != wire::kFrameMagic) {
    Reply(c, kInvalidArgument, "not a kvtier data-plane frame (bad magic)", nullptr, 0, soon(),
          Then::kLinger);
    return;
  }
  if (f.op == wire::kCall) {
    if (f.length > wire::kMaxMessageBytes) {
      Reply(c, kInvalidArgument,
            absl::StrCat("a call of ", f.length, " bytes (at most ", wire::kMaxMessageBytes, ")"),
            nullptr, 0, soon(), Then::kLinger);
      return;
    }
    // The body counts against the budget while it is read and served.
    ByteBudget& budget = c->admission.buffer ? *c->admission.buffer : *p_->buffered_;
    if (!budget.Take(f.length)) {
      p_->calls_refused_buffer_++;
      c->discard = f.length;
      Reply(c, kResourceExhausted,
            absl::StrCat("a call of ", f.length, " bytes would take call bodies being read past ",
                         budget.cap(), " bytes (", budget.limit(), "; ", budget.used(),
                         " now): retry once calls end"),
            nullptr, 0, soon(), Then::kDiscard);
      return;
    }
    c->budget = &budget;
    c->budgeted = f.length;
    c->request.clear();
    ReadInto(c, Read::kCallBody, nullptr, f.length, soon());
    return;
  }
  if (f.op != wire::kGet && f.op != wire::kPut) {
    Reply(c, kInvalidArgument, absl::StrCat("unknown data-plane op ", f.op), nullptr, 0, soon(),
          Then::kLinger);
    return;
  }
  const bool is_put = f.op == wire::kPut;
  if (f.length == 0 || f.length > wire::kMaxTransferBytes) {
    // A put's bytes cannot be told from the next frame: it ends there.
    Reply(c, kInvalidArgument,
          absl::StrCat("a transfer of ", f.length, " bytes (1..", wire::kMaxTransferBytes, ")"),
          nullptr, 0, soon(), is_put ? Then::kLinger : Then::kNextFrame);
    return;
  }
  absl::StatusOr<Grant> g;
  {
    std::shared_lock lk(p_->handlers_mu_);
    g = p_->grant_ ? p_->grant_(c->session, is_put, f.lease, f.addr, f.length)
                   : absl::UnavailableError("the store is not taking data-plane transfers");
  }
  if (!g.ok()) {
    c->discard = is_put ? f.length : 0;
    Reply(c, static_cast<int>(g.status().code()), std::string(g.status().message()), nullptr, 0,
          soon(), is_put ? Then::kDiscard : Then::kNextFrame);
    return;
  }
  c->hold = std::move(g->hold);
  if (is_put) {
    // Straight into the reserved slot; a client that stops sending before
    // the lease's deadline loses the connection (the slot stays its own).
    ReadInto(c, Read::kPutBody, g->at, f.length, g->deadline);
  } else {
    // Straight from the pinned slot; the hold keeps it pinned until the
    // socket has taken the last byte, or the lease's deadline.
    Reply(c, 0, {}, g->at, f.length, g->deadline, Then::kNextFrame);
  }
}

absl::StatusOr<std::unique_ptr<SocketDataPlane>> SocketDataPlane::Start(const std::string& listen,
                                                                        Options options) {
  if (options.max_connections == 0 || options.max_unhelloed == 0 ||
      options.hello_timeout.count() <= 0 || options.idle_timeout.count() <= 0 ||
      options.max_buffered_bytes == 0) {
    return absl::InvalidArgumentError(
        "data plane: connection limits and timeouts must be positive");
  }
  std::unique_ptr<SocketDataPlane> d(new SocketDataPlane());
  auto fd = net::Listen(listen, &d->address_);
  if (!fd.ok()) {
    return absl::Status(fd.status().code(),
                        absl::StrCat("data plane listener: ", fd.status().message()));
  }
  d->listen_fd_ = *fd;
  d->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (d->stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  d->options_ = options;
  d->buffered_ = std::make_unique<ByteBudget>(options.max_buffered_bytes, "--data-max-buffered");
  size_t loops = options.threads;
  if (loops == 0) {
    loops = std::clamp<size_t>(2 * std::thread::hardware_concurrency(), 1, kMaxLoops);
  }
  for (size_t i = 0; i < loops; ++i) {
    d->loops_.push_back(std::make_unique<Loop>(d.get()));
    if (auto s = d->loops_.back()->Start(); !s.ok()) return s;
  }
  d->acceptor_ = std::thread([p = d.get()] { p->AcceptLoop(); });
  return d;
}

SocketDataPlane::~SocketDataPlane() {
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(stop_fd_, &one, sizeof(one));
  }
  if (acceptor_.joinable()) acceptor_.join();
  loops_.clear();  // each closes its connections and joins its thread
  if (listen_fd_ >= 0) close(listen_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

SocketDataPlane::Stats SocketDataPlane::stats() const {
  return Stats{refused_full_.load(),   evicted_.load(),     hello_timeouts_.load(),
               hellos_refused_.load(), idle_closed_.load(), calls_refused_buffer_.load(),
               tls_failed_.load(),     tls_kernel_.load()};
}

void SocketDataPlane::LogLimited(const std::string& what) {
  std::lock_guard lk(log_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - last_log_ < std::chrono::seconds(1)) {
    unlogged_++;
    return;
  }
  last_log_ = now;
  const uint64_t more = std::exchange(unlogged_, 0);
  Log("store", "data plane: ", what,
      more > 0 ? absl::StrCat(" (and ", more, " more refusals in the last second)") : "");
}

bool SocketDataPlane::Leave(Connection* c, State to) {
  int expected = kUnhelloed;
  if (!c->state.compare_exchange_strong(expected, to)) return false;
  unhelloed_--;
  return true;
}

void SocketDataPlane::EvictOldestUnhelloed() {
  // unhelloed_order_ is in accept order: the first one still without a
  // hello is the one closest to its hello deadline.
  while (!unhelloed_order_.empty()) {
    std::shared_ptr<Connection> c = unhelloed_order_.front().lock();
    unhelloed_order_.pop_front();
    if (!c || !Leave(c.get(), kEvicted)) continue;
    evicted_++;
    if (c->counted.exchange(false)) connections_--;
    // Its loop sees the socket end and closes it.
    std::lock_guard lk(c->fd_mu);
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
    return;
  }
}

void SocketDataPlane::SetHandlers(CallHandler call, GrantFn grant, HelloFn hello) {
  std::unique_lock lk(handlers_mu_);
  call_ = std::move(call);
  grant_ = std::move(grant);
  hello_ = std::move(hello);
}

void SocketDataPlane::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const int n = poll(fds, 2, -1);
    if (n < 0 && errno != EINTR) {
      Log("store", "data plane listener: poll failed: ", std::strerror(errno));
      return;
    }
    if (fds[1].revents & POLLIN) return;
    if (n <= 0 || !(fds[0].revents & POLLIN)) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
      // Out of descriptors: the listener stays readable, so polling again
      // at once would spin. The connection waits in the backlog while
      // those open end; the stop descriptor still ends the wait.
      LogLimited(absl::StrCat("cannot accept a connection: ", std::strerror(errno),
                              "; accepts pause 50 ms"));
      pollfd stop = {stop_fd_, POLLIN, 0};
      if (poll(&stop, 1, 50) > 0) return;
      continue;
    }
    if (fd < 0) continue;  // the peer went already: the next try
    if (connections_.load() >= options_.max_connections) {
      refused_full_++;
      LogLimited(absl::StrCat("a connection was refused (", options_.max_connections,
                              " already open: --data-max-connections)"));
      close(fd);
      continue;
    }
    if (unhelloed_.load() >= options_.max_unhelloed) EvictOldestUnhelloed();
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_shared<Connection>();
    c->fd = fd;
    connections_++;
    unhelloed_++;
    // Entries that said their hello (or ended) leave from the front as
    // eviction passes them; past a bound, all at once.
    if (unhelloed_order_.size() > 2 * options_.max_unhelloed + 64) {
      std::erase_if(unhelloed_order_, [](const std::weak_ptr<Connection>& w) {
        auto l = w.lock();
        return !l || l->state.load() != kUnhelloed;
      });
    }
    unhelloed_order_.push_back(c);
    // The loop with the fewest connections takes it.
    Loop* to = loops_.front().get();
    for (auto& l : loops_) {
      if (l->size() < to->size()) to = l.get();
    }
    to->Adopt(std::move(c));
  }
}

}  // namespace kvtier::store
