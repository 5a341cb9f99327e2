#include "cachestore/socket_dataplane.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
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
// How long a connection's thread polls for the next request before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(50);

}  // namespace

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
  d->acceptor_ = std::thread([p = d.get()] { p->AcceptLoop(); });
  return d;
}

SocketDataPlane::~SocketDataPlane() {
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(stop_fd_, &one, sizeof(one));
  }
  if (acceptor_.joinable()) acceptor_.join();
  for (auto& c : conns_) {
    if (c->thread.joinable()) c->thread.join();
    close(c->fd);
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

SocketDataPlane::Stats SocketDataPlane::stats() const {
  return Stats{refused_full_.load(),   evicted_.load(),     hello_timeouts_.load(),
               hellos_refused_.load(), idle_closed_.load(), calls_refused_buffer_.load()};
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
  // conns_ is in accept order: the first one still without a hello is the
  // one closest to its hello deadline.
  for (auto& c : conns_) {
    if (c->done.load() || !Leave(c.get(), kEvicted)) continue;
    evicted_++;
    // Its thread, blocked reading the hello, sees the socket end; the fd
    // stays open (this thread closes it at Reap), so its number is not
    // reused meanwhile.
    shutdown(c->fd, SHUT_RDWR);
    return;
  }
}

void SocketDataPlane::SetHandlers(CallHandler call, GrantFn grant, HelloFn hello) {
  std::unique_lock lk(handlers_mu_);
  call_ = std::move(call);
  grant_ = std::move(grant);
  hello_ = std::move(hello);
}

void SocketDataPlane::Reap() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      close((*it)->fd);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void SocketDataPlane::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const int n = poll(fds, 2, 1000);
    if (n < 0 && errno != EINTR) {
      Log("store", "data plane listener: poll failed: ", std::strerror(errno));
      return;
    }
    if (fds[1].revents & POLLIN) return;
    Reap();
    if (n <= 0 || !(fds[0].revents & POLLIN)) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) continue;  // the peer went already, or out of fds: the next try
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
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    connections_++;
    unhelloed_++;
    Connection* raw = c.get();
    try {
      c->thread = std::thread([this, raw] { Serve(raw); });
    } catch (const std::system_error&) {  // no thread to be had
      LogLimited("no thread for a new connection; closed");
      close(fd);
      connections_--;
      unhelloed_--;
      continue;
    }
    conns_.push_back(std::move(c));
  }
}

void SocketDataPlane::Serve(Connection* c) {
  const int fd = c->fd;
  auto soon = [] { return net::Clock::now() + kFrameTime; };
  auto reply = [&](int code, std::string_view message, const void* data, uint64_t data_bytes,
                   net::Clock::time_point deadline) {
    wire::Reply r;
    r.code = code;
    r.message_bytes = static_cast<uint32_t>(message.size());
    r.data_bytes = data_bytes;
    iovec v[3] = {{&r, sizeof(r)},
                  {const_cast<char*>(message.data()), message.size()},
                  {const_cast<void*>(data), data_bytes}};
    return net::WriteAll(fd, v, 3, deadline, stop_fd_);
  };
  // The challenge first: a nonce the hello's proof must cover, so a hello
  // read off the wire opens no other connection (common/data_hello.h).
  const auto hello_by = net::Clock::now() + options_.hello_timeout;
  const std::string nonce = wire::FreshNonce();
  wire::Reply challenge;
  challenge.magic = wire::kChallengeMagic;
  challenge.data_bytes = nonce.size();
  iovec cv[2] = {{&challenge, sizeof(challenge)}, {const_cast<char*>(nonce.data()), nonce.size()}};
  bool open = !nonce.empty() && net::WriteAll(fd, cv, 2, hello_by, stop_fd_).ok();
  // The hello (its frame, the session id and the proof) within
  // hello_timeout of accept.
  wire::Frame f;
  open = open && net::ReadAll(fd, &f, sizeof(f), hello_by, stop_fd_).ok();
  if (open &&
      (f.magic != wire::kFrameMagic || f.op != wire::kHello || f.length != wire::kHelloBytes)) {
    reply(kInvalidArgument,
          absl::StrCat("the first frame on the data plane must be a hello of ", wire::kHelloBytes,
                       " bytes: the session id and its proof for the store's challenge"),
          nullptr, 0, soon())
        .IgnoreError();
    open = false;
  }
  std::string hello(wire::kHelloBytes, '\0');
  open = open && net::ReadAll(fd, hello.data(), hello.size(), hello_by, stop_fd_).ok();
  if (!open && c->state.load() == kUnhelloed && net::Clock::now() >= hello_by) hello_timeouts_++;
  // The connection acts as this session from here on.
  const std::string session = hello.substr(0, wire::kSessionIdBytes);
  Admission admission;  // the tenant's count of this connection, its budget
  if (open) {
    // Only a session ConnectDataPlane handed out, proven with its key,
    // keeps a connection.
    absl::StatusOr<Admission> known;
    {
      std::shared_lock lk(handlers_mu_);
      known = hello_ ? hello_(session, nonce, std::string_view(hello).substr(wire::kSessionIdBytes))
                     : absl::UnavailableError("the store is not taking data-plane connections");
    }
    if (known.ok()) {
      admission = std::move(*known);
    } else {
      hellos_refused_++;
    }
    // Evicted meanwhile (it was the oldest without a hello): closed.
    open = Leave(c, kAuthenticated) &&
           reply(static_cast<int>(known.status().code()), std::string(known.status().message()),
                 nullptr, 0, soon())
               .ok() &&
           known.ok();
  }
  Leave(c, kEvicted);  // a connection that ends before its hello
  std::string request;
  while (open) {
    // The next request of a busy client comes within microseconds: poll
    // without sleeping for a moment first (a wake-up costs as much again).
    bool ready = false;
    for (const auto spin_end = net::Clock::now() + kSpin; !ready && net::Clock::now() < spin_end;) {
      pollfd p{fd, POLLIN, 0};
      ready = poll(&p, 1, 0) > 0;
    }
    if (!ready) {
      const auto idle_by = net::Clock::now() + options_.idle_timeout;
      if (!net::WaitReadable(fd, idle_by, stop_fd_)) {
        if (net::Clock::now() >= idle_by) idle_closed_++;
        break;
      }
    }
    if (!net::ReadAll(fd, &f, sizeof(f), soon(), stop_fd_).ok()) break;
    if (f.magic != wire::kFrameMagic) {
      reply(kInvalidArgument, "not a kvtier data-plane frame (bad magic)", nullptr, 0, soon())
          .IgnoreError();
      break;
    }
    if (f.op == wire::kCall) {
      if (f.length > wire::kMaxMessageBytes) {
        reply(kInvalidArgument,
              absl::StrCat("a call of ", f.length, " bytes (at most ", wire::kMaxMessageBytes, ")"),
              nullptr, 0, soon())
            .IgnoreError();
        break;
      }
      // The body counts against the budget while it is read and served.
      ByteBudget& budget = admission.buffer ? *admission.buffer : *buffered_;
      if (!budget.Take(f.length)) {
        calls_refused_buffer_++;
        open = reply(kResourceExhausted,
                     absl::StrCat("a call of ", f.length,
                                  " bytes would take call bodies being "
                                  "read past ",
                                  budget.cap(), " bytes (", budget.limit(), "; ", budget.used(),
                                  " now): retry once calls end"),
                     nullptr, 0, soon())
                   .ok() &&
               net::Discard(fd, f.length, soon(), stop_fd_).ok();
        continue;
      }
      // Read as it arrives: the buffer grows with the bytes received, not
      // with the length a frame declares.
      request.clear();
      bool read = true;
      for (uint64_t left = f.length; read && left > 0;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(left, kReadChunk));
        const size_t at = request.size();
        request.resize(at + n);
        read = net::ReadAll(fd, request.data() + at, n, soon(), stop_fd_).ok();
        left -= n;
      }
      CallReply r;
      if (read) {
        std::shared_lock lk(handlers_mu_);
        r = call_ ? call_(f.method, session, request)
                  : CallReply{kUnavailable, "the store is not taking data-plane calls"};
      }
      budget.Give(f.length);
      // An idle connection keeps no large buffer.
      if (request.capacity() > kReadChunk) std::string().swap(request);
      if (!read) break;
      open = reply(r.code, r.body, nullptr, 0, soon()).ok();
      continue;
    }
    if (f.op != wire::kGet && f.op != wire::kPut) {
      reply(kInvalidArgument, absl::StrCat("unknown data-plane op ", f.op), nullptr, 0, soon())
          .IgnoreError();
      break;
    }
    const bool is_put = f.op == wire::kPut;
    if (f.length == 0 || f.length > wire::kMaxTransferBytes) {
      reply(kInvalidArgument,
            absl::StrCat("a transfer of ", f.length, " bytes (1..", wire::kMaxTransferBytes, ")"),
            nullptr, 0, soon())
          .IgnoreError();
      if (is_put) break;  // its bytes cannot be told from the next frame
      continue;
    }
    absl::StatusOr<Grant> g;
    {
      std::shared_lock lk(handlers_mu_);
      g = grant_ ? grant_(session, is_put, f.lease, f.addr, f.length)
                 : absl::UnavailableError("the store is not taking data-plane transfers");
    }
    if (!g.ok()) {
      open = reply(static_cast<int>(g.status().code()), std::string(g.status().message()), nullptr,
                   0, soon())
                 .ok() &&
             (!is_put || net::Discard(fd, f.length, soon(), stop_fd_).ok());
      continue;
    }
    if (is_put) {
      // Straight into the reserved slot; a client that stops sending before
      // the lease's deadline loses the connection (the slot stays its own).
      open = net::ReadAll(fd, g->at, f.length, g->deadline, stop_fd_).ok() &&
             reply(0, {}, nullptr, 0, soon()).ok();
    } else {
      // Straight from the pinned slot; the hold keeps it pinned until the
      // socket has taken the last byte, or the lease's deadline.
      open = reply(0, {}, g->at, f.length, g->deadline).ok();
    }
  }
  // The peer sees the end now; the accept thread closes the fd.
  shutdown(fd, SHUT_RDWR);
  admission = {};
  connections_--;
  c->done.store(true);
}

}  // namespace kvtier::store
