#include "cachestore/dataplane.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/ucx/calls.h"

namespace kvtier::store {

namespace {
// The status codes its own answers carry (the gRPC / absl numbering).
constexpr int kInvalidArgument = static_cast<int>(absl::StatusCode::kInvalidArgument);
constexpr int kUnavailable = static_cast<int>(absl::StatusCode::kUnavailable);
}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneServer>> DataPlaneServer::Start(
    const std::string& listen, void* arena, size_t length,
    const std::vector<std::pair<uint64_t, uint64_t>>& regions) {
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX listen address \"", listen, "\" is not HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  std::string port = listen.substr(colon + 1);
  std::unique_ptr<DataPlaneServer> d(new DataPlaneServer());
  // A restarted store must rebind its port while old connections sit in
  // TIME_WAIT (SO_REUSEADDR), as any server does; an operator's setting wins.
  setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  setenv("UCX_RDMA_CM_REUSEADDR", "y", 0);
  auto ctx = ucx::Context::Create();
  if (!ctx.ok()) return ctx.status();
  d->ctx_ = *ctx;
  auto worker = ucx::Worker::Create(d->ctx_, true);
  if (!worker.ok()) return worker.status();
  d->worker_ = std::move(*worker);
  std::vector<std::pair<uint64_t, uint64_t>> ranges = regions;
  if (ranges.empty()) ranges.emplace_back(0, length);
  for (const auto& [offset, len] : ranges) {
    if (offset + len > length || len == 0) {
      return absl::InvalidArgumentError(absl::StrCat("data plane region [", offset, ", +", len,
                                                     ") is not inside the arena of ", length,
                                                     " bytes"));
    }
    auto region = ucx::MemoryRegion::Map(d->ctx_, static_cast<uint8_t*>(arena) + offset, len);
    if (!region.ok()) return region.status();
    auto rkey = (*region)->PackRkey();
    if (!rkey.ok()) return rkey.status();
    d->regions_.push_back(std::move(*region));
    d->packed_rkeys_.push_back(*rkey);
  }
  if (auto st = d->worker_->SetAmHandler(ucx::kCallAmId, &DataPlaneServer::OnCall, d.get());
      !st.ok()) {
    return st;
  }
  auto waddr = d->worker_->Address();
  if (!waddr.ok()) return waddr.status();
  d->worker_address_ = *waddr;

  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve UCX listen address ", listen));
  }
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = res->ai_addr;
  lp.sockaddr.addrlen = res->ai_addrlen;
  lp.conn_handler.cb = &DataPlaneServer::OnConnect;
  lp.conn_handler.arg = d.get();
  ucs_status_t s = ucp_listener_create(d->worker_->get(), &lp, &d->listener_);
  freeaddrinfo(res);
  if (s != UCS_OK) return ucx::FromUcs(s, absl::StrCat("UCX listener on ", listen));
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (auto q = ucp_listener_query(d->listener_, &attr); q != UCS_OK) {
    return ucx::FromUcs(q, "querying the UCX listener");
  }
  int bound = 0;
  if (attr.sockaddr.ss_family == AF_INET) {
    bound = ntohs(reinterpret_cast<sockaddr_in*>(&attr.sockaddr)->sin_port);
  } else if (attr.sockaddr.ss_family == AF_INET6) {
    bound = ntohs(reinterpret_cast<sockaddr_in6*>(&attr.sockaddr)->sin6_port);
  }
  d->address_ = absl::StrCat(host, ":", bound);
  d->stop_fd_ = eventfd(0, EFD_NONBLOCK);
  d->thread_ = std::thread([p = d.get()] { p->Run(); });
  Log("store", "UCX data plane listening on ", d->address_, ", ", length,
      " bytes of RAM arena registered as ", ranges.size(),
      ranges.size() == 1 ? " region" : " regions");
  return d;
}

void DataPlaneServer::OnConnect(ucp_conn_request_h request, void* arg) {
  auto* d = static_cast<DataPlaneServer*>(arg);
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = request;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &DataPlaneServer::OnEndpointError;
  p.err_handler.arg = d;
  ucp_ep_h ep;
  if (ucp_ep_create(d->worker_->get(), &p, &ep) != UCS_OK) {
    Log("store", "UCX: could not accept a connection");
    return;
  }
  d->endpoints_.push_back(ep);
  d->connections_ = d->endpoints_.size();
}

void DataPlaneServer::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* d = static_cast<DataPlaneServer*>(arg);
  // A client went away; its leases (if any) expire on their own.
  d->failed_.push_back(ep);
}

void DataPlaneServer::CloseFailed() {
  for (ucp_ep_h ep : failed_) {
    auto it = std::find(endpoints_.begin(), endpoints_.end(), ep);
    if (it == endpoints_.end()) continue;
    endpoints_.erase(it);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep, &p);
    if (r && !UCS_PTR_IS_ERR(r)) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) worker_->Progress();
      ucp_request_free(r);
    }
  }
  failed_.clear();
  connections_ = endpoints_.size();
}

void DataPlaneServer::SetCallHandler(CallHandler handler) {
  std::lock_guard lk(handler_mu_);
  handler_ = std::move(handler);
}

ucs_status_t DataPlaneServer::OnCall(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* d = static_cast<DataPlaneServer*>(arg);
  ucx::CallHeader h;
  if (header_length != sizeof(h) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return UCS_OK;  // not a kvtier client, or nowhere to answer: dropped
  }
  std::memcpy(&h, header, sizeof(h));
  PendingCall c{param->reply_ep,
                h.method,
                h.call_id,
                std::string(reinterpret_cast<const char*>(h.session), sizeof(h.session)),
                {}};
  if (h.magic != ucx::kCallMagic) {
    d->Reply(c.reply_ep, c.call_id, {kInvalidArgument, "not a kvtier.v1 data-plane call (magic)"});
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Rendezvous: kvtier clients send calls eager, so this is another one.
    d->Reply(c.reply_ep, c.call_id, {kInvalidArgument, "data-plane calls must be sent eager"});
    return UCS_OK;
  }
  c.request.assign(static_cast<const char*>(data), length);
  d->calls_.push_back(std::move(c));
  return UCS_OK;
}

void DataPlaneServer::ServeCalls() {
  std::vector<PendingCall> calls = std::move(calls_);
  calls_.clear();
  std::lock_guard lk(handler_mu_);
  for (auto& c : calls) {
    if (std::find(failed_.begin(), failed_.end(), c.reply_ep) != failed_.end()) continue;
    CallReply r = handler_
                      ? handler_(c.method, c.session, c.request)
                      : CallReply{kUnavailable, "the store is not serving data-plane calls yet"};
    Reply(c.reply_ep, c.call_id, std::move(r));
  }
}

void DataPlaneServer::Reply(ucp_ep_h ep, uint64_t call_id, CallReply reply) {
  struct Outgoing {
    ucx::ReplyHeader header;
    std::string body;
  };
  auto* out = new Outgoing{{ucx::kCallMagic, reply.code, call_id}, std::move(reply.body)};
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  p.cb.send = [](void* request, ucs_status_t, void* user) {
    delete static_cast<Outgoing*>(user);
    ucp_request_free(request);
  };
  p.user_data = out;
  void* r = ucp_am_send_nbx(ep, ucx::kReplyAmId, &out->header, sizeof(out->header),
                            out->body.data(), out->body.size(), &p);
  // Done at once, or failed (the client went away): the callback never runs.
  if (r == nullptr || UCS_PTR_IS_ERR(r)) delete out;
}

void DataPlaneServer::Run() {
  int ep = epoll_create1(0);
  auto efd = worker_->EventFd();
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (efd.ok()) epoll_ctl(ep, EPOLL_CTL_ADD, *efd, &ev);
  epoll_ctl(ep, EPOLL_CTL_ADD, stop_fd_, &ev);
  // Busy-poll while transfers are flowing (emulated RMA over TCP or shared
  // memory needs this side to progress promptly), sleep on the event fd once
  // idle for a while. Control calls alone do not keep it spinning: a call
  // wakes it, and spinning after one only takes a core from the clients
  // (and, measured, delayed the next call by up to the spin).
  const auto spin = std::chrono::microseconds(2000);
  auto last_work = std::chrono::steady_clock::now() - spin;
  for (;;) {
    bool worked = false;
    for (;;) {
      const size_t calls = calls_.size();
      if (worker_->Progress() == 0) break;
      if (calls_.size() == calls) worked = true;  // not (only) a call's arrival
    }
    // Every call is answered in the pass it arrived in (so before CloseFailed
    // can close its endpoint), and the replies are pushed out before any
    // sleep; calls that arrive meanwhile are answered in the same loop.
    while (!calls_.empty()) {
      ServeCalls();
      while (worker_->Progress() != 0) {
      }
    }
    auto now = std::chrono::steady_clock::now();
    if (worked) last_work = now;
    if (!failed_.empty()) CloseFailed();
    uint64_t v;
    if (read(stop_fd_, &v, sizeof(v)) == sizeof(v)) break;
    if (!efd.ok() || now - last_work < spin) continue;
    if (ucp_worker_arm(worker_->get()) == UCS_ERR_BUSY) continue;
    epoll_event out[2];
    // Woken by traffic, the loop spins again while Progress finds work; a
    // wake-up with none (the timeout) goes back to sleep at once. Clients
    // that map the arena (shared memory) need no progress here at all.
    epoll_wait(ep, out, 2, 10);
  }
  close(ep);
}

DataPlaneServer::~DataPlaneServer() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    ssize_t unused = write(stop_fd_, &one, sizeof(one));
    (void)unused;
    thread_.join();
  }
  failed_ = endpoints_;
  CloseFailed();
  if (listener_) ucp_listener_destroy(listener_);
  if (stop_fd_ >= 0) close(stop_fd_);
  regions_.clear();
  worker_.reset();
}

}  // namespace kvtier::store
