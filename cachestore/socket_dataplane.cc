// The socket data plane's event loops: a connection's handshake, frames
// read, replies written, lingering and closing (socket_dataplane_loop.h).
#include "cachestore/socket_dataplane_loop.h"

namespace kvtier::store {

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
    if (!c->lingering && !c->closed) {
      // Its bytes may be waiting unread: a loop that was held up (a slow
      // call) reaches its sweep before the events that arrived meanwhile.
      // A connection is late for what it did not send, not for what this
      // loop did not read.
      Progress(c);
      if (c->closed) continue;
      if (c->deadline > now) {
        next = std::min(next, c->deadline);
        continue;
      }
    }
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

}  // namespace kvtier::store
