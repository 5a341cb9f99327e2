#include "common/socket_io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier::net {

namespace {

absl::Status Errno(const char* what) {
  const int e = errno;
  if (e == EPIPE || e == ECONNRESET || e == ENOTCONN) {
    return absl::UnavailableError(absl::StrCat(what, ": the peer closed the connection"));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(e)));
}

// Waits for `events` on fd. OK when ready; DEADLINE_EXCEEDED / CANCELLED.
absl::Status PollFor(int fd, short events, Clock::time_point deadline, int cancel_fd) {
  for (;;) {
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      return absl::DeadlineExceededError("the socket data plane's deadline passed");
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    pollfd fds[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int n =
        poll(fds, cancel_fd >= 0 ? 2 : 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("poll");
    }
    if (n == 0) continue;  // the deadline check above decides
    if (cancel_fd >= 0 && (fds[1].revents & POLLIN)) {
      return absl::CancelledError("the socket data plane is stopping");
    }
    if (fds[0].revents != 0) return absl::OkStatus();
  }
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace

absl::StatusOr<int> Listen(const std::string& host_port, std::string* bound) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("\"", host_port, "\" is not HOST:PORT"));
  }
  std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve listen address ", host_port));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return Errno("socket");
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
    const int e = errno;
    freeaddrinfo(res);
    close(fd);
    if (e == EADDRINUSE) {
      return absl::UnavailableError(absl::StrCat(host_port, " is already in use"));
    }
    return absl::UnavailableError(absl::StrCat("bind ", host_port, ": ", std::strerror(e)));
  }
  freeaddrinfo(res);
  if (listen(fd, 1024) != 0) {
    close(fd);
    return Errno("listen");
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  int p = 0;
  if (ss.ss_family == AF_INET) p = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) p = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  *bound = absl::StrCat(host_port.substr(0, colon), ":", p);
  SetNonBlocking(fd);
  return fd;
}

absl::StatusOr<int> Connect(const std::string& host_in, int port, Clock::time_point deadline) {
  std::string host = host_in;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port_text = std::to_string(port);
  const auto resolving = std::chrono::steady_clock::now();
  const int resolved = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  const auto resolve_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::steady_clock::now() - resolving)
                              .count();
  if (resolve_ms >= 1000) {
    // getaddrinfo keeps no deadline: a lost DNS answer costs the resolver's
    // timeout (5 s by default), which a caller's budget does not show.
    Log("net", "resolving ", host, " took ", resolve_ms, " ms");
  }
  if (resolved != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return Errno("socket");
  }
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    absl::Status s = Errno("connect");
    close(fd);
    return absl::UnavailableError(absl::StrCat(host, ":", port, ": ", s.message()));
  }
  if (rc != 0) {
    if (absl::Status s = PollFor(fd, POLLOUT, deadline, -1); !s.ok()) {
      close(fd);
      return s;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      close(fd);
      return absl::UnavailableError(
          absl::StrCat("connect ", host, ":", port, ": ", std::strerror(err)));
    }
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

absl::Status WriteAll(int fd, struct iovec* iov, int n, Clock::time_point deadline, int cancel_fd) {
  while (n > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(std::min(n, 1024));
    const ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return Errno("send");
      if (absl::Status s = PollFor(fd, POLLOUT, deadline, cancel_fd); !s.ok()) return s;
      continue;
    }
    size_t left = static_cast<size_t>(w);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const void* data, size_t length, Clock::time_point deadline,
                      int cancel_fd) {
  iovec v{const_cast<void*>(data), length};
  return WriteAll(fd, &v, 1, deadline, cancel_fd);
}

absl::Status ReadAll(int fd, void* data, size_t length, Clock::time_point deadline, int cancel_fd) {
  auto* p = static_cast<uint8_t*>(data);
  while (length > 0) {
    const ssize_t r = recv(fd, p, length, 0);
    if (r == 0) return absl::UnavailableError("the peer closed the connection");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return Errno("recv");
      if (absl::Status s = PollFor(fd, POLLIN, deadline, cancel_fd); !s.ok()) return s;
      continue;
    }
    p += r;
    length -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status Discard(int fd, uint64_t length, Clock::time_point deadline, int cancel_fd) {
  // On the stack, untouched until bytes arrive: a refused transfer that
  // never sends its bytes costs no memory (a heap buffer zeroed at its
  // length did, on every connection that declared one).
  uint8_t sink[64 << 10];
  while (length > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(length, sizeof(sink)));
    if (absl::Status s = ReadAll(fd, sink, n, deadline, cancel_fd); !s.ok()) return s;
    length -= n;
  }
  return absl::OkStatus();
}

bool WaitReadable(int fd, Clock::time_point deadline, int cancel_fd) {
  return PollFor(fd, POLLIN, deadline, cancel_fd).ok();
}

}  // namespace kvtier::net
