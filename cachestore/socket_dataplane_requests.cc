// The socket data plane: what a connection's finished frame asks for (a
// call, a transfer), served on its loop (socket_dataplane_loop.h).
#include "cachestore/socket_dataplane_loop.h"

namespace kvtier::store {

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
      const auto began = net::Clock::now();
      {
        std::shared_lock lk(p_->handlers_mu_);
        r = p_->call_ ? p_->call_(c->f.method, c->session, c->request)
                      : CallReply{kUnavailable, "the store is not taking data-plane calls"};
      }
      if (const auto held = net::Clock::now() - began; held >= kSlowCall) {
        // Every connection on this loop waited as long.
        p_->LogLimited(
            absl::StrCat("a call (method ", c->f.method, ") held its event loop ",
                         std::chrono::duration_cast<std::chrono::milliseconds>(held).count(),
                         " ms; ", size_.load(), " connections on it waited"));
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

}  // namespace kvtier::store
