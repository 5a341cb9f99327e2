// SocketChannel (socket_channel.h, which states its guarantees).
#include "client/socket_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data_hello.h"
#include "common/socket_io.h"

namespace kvtier {

namespace {

constexpr size_t kMaxIov = 64;
// How long a wait polls before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(50);

absl::Status StoreStatus(int code, const std::string& message) {
  const bool known = code > 0 && code <= 16;
  return absl::Status(known ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                      message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SocketChannel>> SocketChannel::Connect(
    const std::string& host, int port, const std::string& session, Clock::time_point deadline,
    const net::TlsContext* tls, const std::string& tls_name) {
  auto fd = net::Connect(host, port, deadline);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<SocketChannel> c(new SocketChannel(*fd));
  if (tls != nullptr) {
    // The store proves its certificate before anything is sent.
    c->tls_ = net::TlsStream::Connect(*tls, *fd, tls_name.empty() ? host : tls_name);
    if (!c->tls_) return absl::ResourceExhaustedError("no memory for a TLS connection");
    if (auto s = c->tls_->HandshakeBy(deadline); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the store's data plane (TLS, ", host, ":", port,
                                                 "): ", s.message()));
    }
  }
  // The store's challenge, then the hello that proves the session's key
  // for it (common/data_hello.h).
  wire::Reply challenge;
  if (auto s = c->ReadFully(&challenge, sizeof(challenge), deadline); !s.ok()) return s;
  if (challenge.magic != wire::kChallengeMagic || challenge.message_bytes != 0 ||
      challenge.data_bytes != wire::kNonceBytes) {
    return absl::UnavailableError(
        "the store's data plane sent no challenge: another protocol or an older store");
  }
  std::string nonce(wire::kNonceBytes, '\0');
  if (auto s = c->ReadFully(nonce.data(), nonce.size(), deadline); !s.ok()) return s;
  const std::string payload = wire::HelloPayload(session, nonce);
  if (payload.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a socket data-plane session is ", wire::kSocketSessionBytes, " bytes (id and key), not ",
        session.size(), ": ConnectDataPlane's session from a store of this version"));
  }
  wire::Frame hello;
  hello.op = wire::kHello;
  hello.length = payload.size();
  iovec v[2] = {{&hello, sizeof(hello)}, {const_cast<char*>(payload.data()), payload.size()}};
  if (auto s = c->WriteFully(v, 2, deadline); !s.ok()) return s;
  wire::Reply r;
  if (auto s = c->ReadFully(&r, sizeof(r), deadline); !s.ok()) return s;
  if (r.magic != wire::kReplyMagic || r.message_bytes > 4096 || r.data_bytes != 0) {
    return absl::UnavailableError("the store's data plane answered in another protocol");
  }
  std::string message(r.message_bytes, '\0');
  if (auto s = c->ReadFully(message.data(), message.size(), deadline); !s.ok()) return s;
  if (r.code != 0) return StoreStatus(r.code, message);
  return c;
}

SocketChannel::~SocketChannel() {
  tls_.reset();
  if (fd_ >= 0) close(fd_);
}

ssize_t SocketChannel::Recv(void* to, size_t n) {
  return tls_ ? tls_->Recv(to, n) : recv(fd_, to, n, 0);
}

ssize_t SocketChannel::Send(const iovec* iov, size_t k) {
  if (tls_) return tls_->Send(iov, k);
  msghdr m{};
  m.msg_iov = const_cast<iovec*>(iov);
  m.msg_iovlen = k;
  return sendmsg(fd_, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

ssize_t SocketChannel::Peek() {
  if (tls_) return tls_->Peek();
  char byte;
  return recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
}

std::string SocketChannel::IoError() const {
  return tls_ && !tls_->error().empty() ? tls_->error() : std::strerror(errno);
}

absl::Status SocketChannel::ReadFully(void* to, size_t n, Clock::time_point deadline) {
  if (!tls_) return net::ReadAll(fd_, to, n, deadline);
  auto* at = static_cast<char*>(to);
  while (n > 0) {
    const ssize_t r = tls_->Recv(at, n);
    if (r > 0) {
      at += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError("the store closed the data-plane connection");
    if (errno != EAGAIN) {
      return absl::UnavailableError(
          absl::StrCat("the store's data-plane connection failed: ", IoError()));
    }
    if (!net::WaitReadable(fd_, deadline)) {
      return absl::DeadlineExceededError("the store's data plane did not answer in time");
    }
  }
  return absl::OkStatus();
}

absl::Status SocketChannel::WriteFully(iovec* iov, size_t k, Clock::time_point deadline) {
  if (!tls_) return net::WriteAll(fd_, iov, static_cast<int>(k), deadline);
  size_t i = 0;
  while (i < k) {
    if (iov[i].iov_len == 0) {
      ++i;
      continue;
    }
    const ssize_t w = tls_->Send(iov + i, k - i);
    if (w < 0) {
      if (errno != EAGAIN) {
        return absl::UnavailableError(
            absl::StrCat("the store's data-plane connection failed: ", IoError()));
      }
      pollfd p{fd_, POLLOUT, 0};
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) == 0) {
        return absl::DeadlineExceededError("the store's data plane took no bytes in time");
      }
      continue;
    }
    for (auto done = static_cast<size_t>(w); done > 0;) {
      const size_t take = std::min(done, iov[i].iov_len);
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + take;
      iov[i].iov_len -= take;
      done -= take;
      if (iov[i].iov_len == 0) ++i;
    }
  }
  return absl::OkStatus();
}

uint64_t SocketChannel::Post(Op op) {
  op.seq = next_seq_++;
  ops_.push_back(std::move(op));
  return ops_.back().seq;
}

uint64_t SocketChannel::PostGet(void* dest, uint64_t length, uint64_t addr, uint64_t lease) {
  Op op;
  op.frame.op = wire::kGet;
  op.frame.lease = lease;
  op.frame.addr = addr;
  op.frame.length = length;
  op.dest = static_cast<uint8_t*>(dest);
  return Post(std::move(op));
}

uint64_t SocketChannel::PostPut(const void* src, uint64_t length, uint64_t addr, uint64_t lease) {
  Op op;
  op.frame.op = wire::kPut;
  op.frame.lease = lease;
  op.frame.addr = addr;
  op.frame.length = length;
  op.src = static_cast<const uint8_t*>(src);
  return Post(std::move(op));
}

uint64_t SocketChannel::PostMark() {
  Op op;
  op.mark = true;
  return Post(std::move(op));
}

bool SocketChannel::PeerClosed() {
  if (failed()) return true;
  if (!ops_.empty()) return false;  // an answer may be what is readable
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  const ssize_t r = Peek();
  if (r > 0) return false;  // bytes nobody asked for: the next read fails on them
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  Fail(absl::UnavailableError("the store closed the idle data-plane connection")).IgnoreError();
  return true;
}

absl::Status SocketChannel::Fail(absl::Status s) {
  if (failure_.ok()) failure_ = std::move(s);
  // Nothing more moves: every op still queued has failed with it.
  if (!ops_.empty()) done_seq_ = ops_.back().seq;
  ops_.clear();
  unsent_ = 0;
  tls_.reset();
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
  return failure_;
}

absl::Status SocketChannel::HandleReadable() {
  for (;;) {
    // Marks complete once they reach the front.
    while (!ops_.empty() && ops_.front().mark) {
      done_seq_ = ops_.front().seq;
      ops_.pop_front();
      if (unsent_ > 0) unsent_--;
    }
    if (ops_.empty()) {
      // Nothing is owed: bytes now are an answer to no request.
      const ssize_t r = Peek();
      if (r > 0) {
        return Fail(absl::InternalError("the store's data plane answered a request never made"));
      }
      if (r == 0) return Fail(absl::UnavailableError("the store closed the data-plane connection"));
      return absl::OkStatus();
    }
    Op& op = ops_.front();
    const uint64_t head = sizeof(reply_);
    void* to;
    uint64_t want;
    if (reply_got_ < head) {
      to = reinterpret_cast<uint8_t*>(&reply_) + reply_got_;
      want = head - reply_got_;
    } else if (reply_got_ < head + reply_.message_bytes) {
      to = message_.data() + (reply_got_ - head);
      want = head + reply_.message_bytes - reply_got_;
    } else {
      const uint64_t at = reply_got_ - head - reply_.message_bytes;
      to = op.dest + at;
      want = reply_.data_bytes - at;
    }
    if (want > 0) {
      const ssize_t r = Recv(to, want);
      if (r == 0) return Fail(absl::UnavailableError("the store closed the data-plane connection"));
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
        return Fail(absl::UnavailableError(
            absl::StrCat("the store's data-plane connection failed: ", IoError())));
      }
      const uint64_t before = reply_got_;
      reply_got_ += static_cast<uint64_t>(r);
      if (before < head && reply_got_ >= head) {
        // The header is in: check it before reading what it announces.
        const bool bad_data = op.frame.op == wire::kGet
                                  ? reply_.data_bytes != (reply_.code == 0 ? op.frame.length : 0)
                                  : reply_.data_bytes != 0;
        if (reply_.magic != wire::kReplyMagic || reply_.message_bytes > wire::kMaxMessageBytes ||
            bad_data) {
          return Fail(absl::InternalError(
              "the store's data plane answered with a reply this client cannot use"));
        }
        message_.assign(reply_.message_bytes, '\0');
        // Bytes past the header in this read belong to the message: none,
        // since the read asked for the header only.
      }
      if (reply_got_ < head + reply_.message_bytes + reply_.data_bytes || reply_got_ < head) {
        continue;
      }
    }
    // The whole answer is in.
    if (op.frame.op == wire::kCall) {
      call_seq_ = op.seq;
      call_status_ = reply_.code == 0 ? absl::OkStatus() : StoreStatus(reply_.code, message_);
      call_reply_ = std::move(message_);
    } else if (reply_.code != 0 && first_error_.ok()) {
      first_error_ = StoreStatus(reply_.code, message_);
    }
    done_seq_ = op.seq;
    ops_.pop_front();
    if (unsent_ > 0) unsent_--;
    reply_got_ = 0;
    reply_ = wire::Reply{};
    message_.clear();
    if (ops_.empty()) return absl::OkStatus();
  }
}

absl::Status SocketChannel::Step(Clock::time_point deadline) {
  if (!failure_.ok()) return failure_;
  // Skip marks among the unsent: they do not travel.
  while (unsent_ < ops_.size() && ops_[unsent_].mark) unsent_++;
  const bool to_send = unsent_ < ops_.size();
  pollfd p{fd_, static_cast<short>(POLLIN | (to_send ? POLLOUT : 0)), 0};
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) {
    return absl::DeadlineExceededError("the store's data plane did not answer in time");
  }
  // A short answer (a call's, a small get's) usually comes within tens of
  // microseconds: poll without sleeping that long first, since a sleeping
  // thread's wake-up costs as much again.
  int n = 0;
  const auto spin_end = Clock::now() + kSpin;
  // Bytes TLS decrypted already are readable though the socket says not.
  const bool buffered = tls_ && tls_->Pending();
  do {
    n = poll(&p, 1, 0);
  } while (n == 0 && !buffered && Clock::now() < spin_end);
  if (buffered && n >= 0) {
    p.revents |= POLLIN;
    n = 1;
  }
  if (n == 0) {
    n = poll(&p, 1,
             static_cast<int>(std::min<int64_t>(
                 std::chrono::ceil<std::chrono::milliseconds>(left).count(), 1 << 30)));
  }
  if (n < 0) {
    if (errno == EINTR) return absl::OkStatus();
    return Fail(absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno))));
  }
  if (n == 0) return absl::OkStatus();
  if (p.revents & POLLOUT) {
    // As many queued frames and payloads as one sendmsg takes.
    iovec iov[kMaxIov];
    size_t k = 0;
    for (size_t i = unsent_; i < ops_.size() && k + 2 <= kMaxIov; ++i) {
      Op& op = ops_[i];
      if (op.mark) continue;
      const uint64_t payload =
          op.frame.op == wire::kPut || op.frame.op == wire::kCall ? op.frame.length : 0;
      const uint64_t frame = sizeof(op.frame);
      if (op.sent < frame) {
        iov[k++] = {reinterpret_cast<uint8_t*>(&op.frame) + op.sent, frame - op.sent};
      }
      if (payload > 0) {
        const uint64_t off = op.sent > frame ? op.sent - frame : 0;
        iov[k++] = {const_cast<uint8_t*>(op.src) + off, payload - off};
      }
    }
    const ssize_t w = k > 0 ? Send(iov, k) : 0;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return Fail(absl::UnavailableError(
          absl::StrCat("the store's data-plane connection failed: ", IoError())));
    }
    uint64_t wrote = w > 0 ? static_cast<uint64_t>(w) : 0;
    for (size_t i = unsent_; i < ops_.size() && wrote > 0; ++i) {
      Op& op = ops_[i];
      if (op.mark) continue;
      const uint64_t payload =
          op.frame.op == wire::kPut || op.frame.op == wire::kCall ? op.frame.length : 0;
      const uint64_t take = std::min(wrote, sizeof(op.frame) + payload - op.sent);
      op.sent += take;
      wrote -= take;
    }
    while (unsent_ < ops_.size() &&
           (ops_[unsent_].mark ||
            ops_[unsent_].sent ==
                sizeof(wire::Frame) +
                    (ops_[unsent_].frame.op == wire::kPut || ops_[unsent_].frame.op == wire::kCall
                         ? ops_[unsent_].frame.length
                         : 0))) {
      unsent_++;
    }
  }
  if (p.revents & (POLLIN | POLLHUP | POLLERR)) return HandleReadable();
  return absl::OkStatus();
}

absl::Status SocketChannel::Wait(uint64_t seq, Clock::time_point deadline) {
  while (done_seq_ < seq && failure_.ok()) {
    while (!ops_.empty() && ops_.front().mark) {
      done_seq_ = ops_.front().seq;
      ops_.pop_front();
      if (unsent_ > 0) unsent_--;
    }
    if (done_seq_ >= seq) break;
    if (absl::Status s = Step(deadline); !s.ok()) {
      if (s.code() == absl::StatusCode::kDeadlineExceeded) return Fail(s);
      return s;
    }
  }
  if (!failure_.ok()) return failure_;
  absl::Status s = std::move(first_error_);
  first_error_ = absl::OkStatus();
  return s;
}

absl::StatusOr<std::string> SocketChannel::Call(uint16_t method, const std::string& request,
                                                Clock::time_point deadline) {
  if (request.size() > wire::kMaxMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a data-plane call of ", request.size(), " bytes (at most ", wire::kMaxMessageBytes, ")"));
  }
  Op op;
  op.frame.op = wire::kCall;
  op.frame.method = method;
  op.frame.length = request.size();
  op.src = reinterpret_cast<const uint8_t*>(request.data());
  const uint64_t seq = Post(std::move(op));
  // Transfers' errors stay for their own Wait.
  absl::Status transfers = std::move(first_error_);
  first_error_ = absl::OkStatus();
  absl::Status s = Wait(seq, deadline);
  if (failed()) return failure_;  // a missed deadline fails the connection too
  // What Wait returned is a transfer's error, met meanwhile: it stays theirs.
  first_error_ = transfers.ok() ? s : transfers;
  if (call_seq_ != seq) return absl::InternalError("a data-plane call's answer went missing");
  if (!call_status_.ok()) return call_status_;
  return std::move(call_reply_);
}

}  // namespace kvtier
