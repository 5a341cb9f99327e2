// DataPlaneConnection (data_plane_connection.h, which states its
// guarantees): ConnectDataPlane, the choice of UCX endpoint, back-off, and
// posting and waiting for RMA.
#include "client/data_plane_connection.h"

#include "client/socket_channel.h"

#include <atomic>
#include <cstring>

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/rpc/grpc_status.h"
#include "common/ucx/calls.h"

namespace kvtier {

namespace {

std::string HostOf(const std::string& address) { return address.substr(0, address.rfind(':')); }

bool UseSharedMemory(const DataClientOptions& options, const std::string& address) {
  switch (options.shared_memory) {
    case DataClientOptions::SharedMemory::kOn:
      return true;
    case DataClientOptions::SharedMemory::kOff:
      return false;
    case DataClientOptions::SharedMemory::kAuto:
      break;
  }
  std::string host = HostOf(address);
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "[::1]" || host == "::1";
}

}  // namespace

DataPlaneConnection::DataPlaneConnection(absl::StatusOr<std::unique_ptr<ucx::Worker>> worker,
                                         const std::string& address,
                                         const DataClientOptions& options, StoreClient& control,
                                         bool map_arena)
    : address_(address),
      options_(options),
      control_(control),
      init_error_(worker.status()),
      backoff_ms_(options.backoff_min_ms),
      map_arena_(map_arena) {
  if (!worker.ok()) return;
  worker_ = std::move(*worker);
  init_error_ = worker_->SetAmHandler(ucx::kReplyAmId, &DataPlaneConnection::OnReply, this);
}

ucs_status_t DataPlaneConnection::OnReply(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* c = static_cast<DataPlaneConnection*>(arg);
  ucx::ReplyHeader h;
  if (header_length != sizeof(h)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  // A late answer to a call given up on, or not ours: dropped.
  if (h.magic != ucx::kCallMagic || h.call_id != c->call_id_ || c->replied_) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;  // stores send eager
  c->reply_code_ = h.code;
  c->reply_.assign(static_cast<const char*>(data), length);
  c->replied_ = true;
  return UCS_OK;
}

absl::StatusOr<std::string> DataPlaneConnection::Call(uint16_t method, const std::string& request,
                                                      ucx::Clock::time_point deadline) {
  if (sock_) {
    auto r = sock_->Call(method, request, deadline);
    if (sock_->failed()) Drop();
    return r;
  }
  ucx::CallHeader h;
  h.method = method;
  h.call_id = ++call_id_;
  std::memcpy(h.session, session_.data(), std::min(session_.size(), sizeof(h.session)));
  replied_ = false;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;  // h lives until sent
  std::vector<void*> sent = {ucp_am_send_nbx(ep_->get(), ucx::kCallAmId, &h, sizeof(h),
                                             request.data(), request.size(), &p)};
  absl::Status s = Wait(sent, deadline);  // drops the endpoint on failure
  if (s.ok() && !worker_->WaitUntil([&] { return replied_ || ep_->failed(); }, deadline)) {
    s = absl::DeadlineExceededError("the store did not answer a data-plane call in time");
  } else if (s.ok() && !replied_) {
    s = absl::UnavailableError("the store's UCX endpoint failed");
  }
  if (!s.ok()) {
    if (ep_) ep_->MarkFailed();
    Drop();
    return s;
  }
  if (reply_code_ != 0) {
    const bool known = reply_code_ > 0 && reply_code_ <= 16;
    return absl::Status(
        known ? static_cast<absl::StatusCode>(reply_code_) : absl::StatusCode::kUnknown, reply_);
  }
  return std::move(reply_);
}

DataPlaneConnection::~DataPlaneConnection() {
  Drop();
  mapping_.reset();
  regions_.clear();
  worker_.reset();
}

void DataPlaneConnection::Drop() {
  rkey_.reset();
  ep_.reset();
  sock_.reset();
}

void DataPlaneConnection::Reset() {
  if (ep_) ep_->MarkFailed();
  Drop();
  mapping_.reset();
}

absl::Status DataPlaneConnection::EnsureConnected(
    std::chrono::system_clock::time_point rpc_deadline) {
  if (sock_ && !sock_->PeerClosed()) return absl::OkStatus();
  if (ep_ && !ep_->failed()) return absl::OkStatus();
  // A socket the store closed while idle reconnects at once, no backoff:
  // nothing failed.
  const bool idle_closed = sock_ != nullptr;
  Drop();
  if (idle_closed) next_attempt_ = {};
  auto now = ucx::Clock::now();
  if (now < next_attempt_) {
    return absl::UnavailableError(absl::StrCat(
        "store ", address_, " data plane is down; next reconnect in ",
        std::chrono::duration_cast<std::chrono::milliseconds>(next_attempt_ - now).count(),
        " ms (last error: ", last_error_, ")"));
  }
  auto fail = [&](const absl::Status& s) {
    last_error_ = std::string(s.message());
    next_attempt_ = ucx::Clock::now() + std::chrono::milliseconds(backoff_ms_);
    backoff_ms_ = std::min(backoff_ms_ * 2, options_.backoff_max_ms);
    return s;
  };
  // Connects with the client's shared session (StoreClient::
  // DataPlaneSession); the answer's errors are the attempt's.
  auto attempt = [&](const v1::ConnectDataPlaneResponse& resp,
                     std::chrono::system_clock::time_point by) -> absl::Status {
    if (resp.regions_size() != 1 || resp.regions(0).rkey_id() != 0) {
      return (absl::InternalError("store data plane offers no region 0"));
    }
    const bool sockets = !resp.data_address().empty();
    std::string addr = sockets ? resp.data_address() : resp.ucx_address();
    std::string host = HostOf(addr);
    if (host.empty() || host == "0.0.0.0" || host == "::") host = HostOf(address_);
    // Map the store's arena when it offers it and this client uses shared
    // memory; any failure (another user, another container) keeps the
    // connection's own transfers.
    const bool shm = UseSharedMemory(options_, address_);
    std::shared_ptr<ArenaMapping> mapping;
    if (map_arena_ && shm) {
      auto m = ArenaMapping::Map(resp.regions(0), resp.instance_id());
      if (m.ok()) mapping = std::move(*m);
    }
    if (sockets) {
      int port = 0;
      if (!absl::SimpleAtoi(addr.substr(addr.rfind(':') + 1), &port)) {
        return (absl::InternalError(
            absl::StrCat("store's data-plane address \"", addr, "\" has no port")));
      }
      const net::TlsContext* tls = nullptr;
      if (resp.data_tls()) {
        tls = options_.security.data_plane.get();
        if (tls == nullptr) {
          return absl::FailedPreconditionError(
              absl::StrCat("store ", address_,
                           " serves its data plane over TLS (--data-tls): this client "
                           "needs the CA to verify it by (--tls-ca)"));
        }
      }
      const auto left = by - std::chrono::system_clock::now();
      // The data plane serves the certificate gRPC does: it is verified
      // for the name the control plane was (the address it is dialled at
      // came from that authenticated answer).
      const std::string& name = options_.security.server_name;
      auto ch = SocketChannel::Connect(host, port, resp.session(), ucx::Clock::now() + left, tls,
                                       name.empty() ? HostOf(address_) : name);
      if (!ch.ok()) return (ch.status());
      sock_ = std::move(*ch);
      sock_generation_++;
      instance_ = resp.instance_id();
      session_ = resp.session();
      backoff_ms_ = options_.backoff_min_ms;
      mapping_ = std::move(mapping);
      return absl::OkStatus();
    }
    if (!init_error_.ok()) return (init_error_);
    absl::StatusOr<std::unique_ptr<ucx::Endpoint>> ep;
    if (!options_.use_sockaddr && !resp.worker_address().empty()) {
      // UCX's shared-memory transports only where they move the bytes: a
      // mapped connection, or one that makes control calls only, keeps peer-
      // failure handling (TCP on the host), so a dead store fails it at once
      // and it can always be force-closed (UCX 1.13 cannot force-close an
      // endpoint without it, which then fails later inside UCX).
      // (Not to be had when UCX_TLS allows shared memory only.)
      const bool pfh = !shm || ((mapping || !map_arena_) && ucx::NetworkTransportsAllowed());
      ep = ucx::Endpoint::ConnectToWorker(worker_.get(), resp.worker_address(), pfh);
    } else {
      int port = 0;
      if (!absl::SimpleAtoi(addr.substr(addr.rfind(':') + 1), &port)) {
        return (
            absl::InternalError(absl::StrCat("store's UCX address \"", addr, "\" has no port")));
      }
      ep = ucx::Endpoint::Connect(worker_.get(), host, port);
    }
    if (!ep.ok()) return (ep.status());
    auto rkey = (*ep)->Unpack(resp.regions(0).packed_rkey());
    if (!rkey.ok()) return (rkey.status());
    ep_ = std::move(*ep);
    rkey_ = std::move(*rkey);
    instance_ = resp.instance_id();
    session_ = resp.session();
    backoff_ms_ = options_.backoff_min_ms;
    mapping_ = std::move(mapping);
    return absl::OkStatus();
  };
  bool fresh = false;
  auto got = control_.DataPlaneSession(options_.client_id, rpc_deadline, &fresh);
  if (!got.ok()) return fail(got.status());
  // A kept session may name an address the store no longer has (a pod
  // restarted under a new IP, where a dial hangs rather than fails): its
  // attempt gets half the time left, so a new session's has the rest.
  const auto now_wall = std::chrono::system_clock::now();
  absl::Status s =
      attempt(*got, fresh || rpc_deadline <= now_wall ? rpc_deadline
                                                      : now_wall + (rpc_deadline - now_wall) / 2);
  if (!s.ok()) {
    // A kept session may be one the store no longer has (it restarted, or
    // dropped it): once more with a new one.
    control_.ForgetDataPlaneSession(got->session());
    if (!fresh) {
      got = control_.DataPlaneSession(options_.client_id, rpc_deadline, &fresh);
      if (!got.ok()) return fail(got.status());
      s = attempt(*got, rpc_deadline);
      if (!s.ok()) control_.ForgetDataPlaneSession(got->session());
    }
  }
  return s.ok() ? s : fail(s);
}

absl::Status DataPlaneConnection::EnsureInstance(
    uint64_t instance, std::chrono::system_clock::time_point rpc_deadline) {
  if (instance == 0 || instance == instance_) return absl::OkStatus();
  Reset();
  next_attempt_ = {};  // not a failure: no back-off
  if (auto s = EnsureConnected(rpc_deadline); !s.ok()) return s;
  if (instance_ != instance) {
    return absl::UnavailableError(
        absl::StrCat("store ", address_, " restarted since it answered; ask it again"));
  }
  return absl::OkStatus();
}

void DataPlaneConnection::UseRegions(
    const std::vector<std::shared_ptr<ucx::MemoryRegion>>& regions) {
  if (regions_.size() != regions.size()) regions_ = regions;
}

ucp_request_param_t DataPlaneConnection::ParamsFor(const void* p, size_t n) const {
  ucp_mem_h memh = nullptr;
  for (const auto& r : regions_) {
    if (r->contains(p, n)) {
      memh = r->memh();
      break;
    }
  }
  ucp_request_param_t params{};
  if (memh != nullptr) {
    params.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    params.memh = memh;
  }
  return params;
}

// A socket channel's operation number as a request handle: odd (UCX's
// requests are aligned pointers), below UCX's error pointers, and naming the
// channel it was posted on (a handle of a channel since dropped reads as
// failed, never as an operation of a newer one).
namespace {
constexpr int kSeqBits = 40;
bool IsSocketRequest(void* r) {
  const auto v = reinterpret_cast<uintptr_t>(r);
  return r != nullptr && !UCS_PTR_IS_ERR(r) && (v & 1) != 0;
}
}  // namespace

void* DataPlaneConnection::AsRequest(uint64_t seq) const {
  const uint64_t v = ((sock_generation_ & 0x3fffff) << kSeqBits | seq) << 1 | 1;
  return reinterpret_cast<void*>(static_cast<uintptr_t>(v));
}

void* DataPlaneConnection::PostPut(const void* src, size_t length, uint64_t remote_addr,
                                   uint64_t lease) {
  if (mapping_) {
    uint8_t* to = mapping_->At(remote_addr, length);
    if (to == nullptr) return UCS_STATUS_PTR(UCS_ERR_INVALID_ADDR);  // Wait reports it
    std::memcpy(to, src, length);
    return nullptr;
  }
  if (sock_) return AsRequest(sock_->PostPut(src, length, remote_addr, lease));
  ucp_request_param_t p = ParamsFor(src, length);
  return ucp_put_nbx(ep_->get(), src, length, remote_addr, rkey_->get(), &p);
}

void* DataPlaneConnection::PostGet(void* dest, size_t length, uint64_t remote_addr,
                                   uint64_t lease) {
  if (mapping_) {
    const uint8_t* from = mapping_->At(remote_addr, length);
    if (from == nullptr) return UCS_STATUS_PTR(UCS_ERR_INVALID_ADDR);  // Wait reports it
    std::memcpy(dest, from, length);
    return nullptr;
  }
  if (sock_) return AsRequest(sock_->PostGet(dest, length, remote_addr, lease));
  ucp_request_param_t p = ParamsFor(dest, length);
  return ucp_get_nbx(ep_->get(), dest, length, remote_addr, rkey_->get(), &p);
}

void* DataPlaneConnection::PostFlush() {
  if (mapping_) {
    // The copies are visible to the store once the commit RPC that follows
    // is sent; a sequentially consistent read-modify-write orders them
    // before it on any architecture (a plain fence is one TSan cannot check).
    static std::atomic<uint32_t> flushes{0};
    flushes.fetch_add(1, std::memory_order_seq_cst);
    return nullptr;
  }
  if (sock_) return AsRequest(sock_->PostMark());  // a put is answered once in its slot
  ucp_request_param_t p{};
  return ucp_ep_flush_nbx(ep_->get(), &p);
}

absl::Status DataPlaneConnection::Wait(std::vector<void*>& requests,
                                       ucx::Clock::time_point deadline) {
  if (sock_ || (mapping_ && !ep_) ||
      std::any_of(requests.begin(), requests.end(), IsSocketRequest)) {
    // Socket operations (in order: the last one waited for covers the
    // rest), or the mapped arena's copies (done; an error pointer for an
    // address outside the arena).
    uint64_t last = 0;
    bool stale = false;
    absl::Status s = absl::OkStatus();
    for (void*& r : requests) {
      if (r != nullptr && UCS_PTR_IS_ERR(r)) {
        if (s.ok()) s = absl::InternalError("the store answered an address outside its arena");
      } else if (IsSocketRequest(r)) {
        const uint64_t v = reinterpret_cast<uintptr_t>(r) >> 1;
        stale |= !sock_ || (v >> kSeqBits) != (sock_generation_ & 0x3fffff);
        last = std::max<uint64_t>(last, v & ((uint64_t{1} << kSeqBits) - 1));
      }
      r = nullptr;
    }
    if (stale && s.ok()) {
      // Posted on a connection a failure has closed since: failed with it.
      s = absl::UnavailableError("the store's data-plane connection failed");
    }
    if (last > 0 && sock_ && !stale) {
      absl::Status w = sock_->Wait(last, deadline);
      if (s.ok()) s = w;
    }
    if (!s.ok()) Drop();
    return s;
  }
  // Requests a cancel cannot end are ended by closing the endpoint: none may
  // still write into the caller's buffers once this returns.
  absl::Status moved = worker_->WaitAll(requests, deadline, [this] {
    if (ep_) ep_->MarkFailed();
    Drop();
  });
  if (!ep_) {
    // Closed by a failure while waiting for earlier requests: these were
    // posted on it and have now completed (with errors) too.
    return moved.ok() ? absl::UnavailableError("the store's UCX endpoint failed") : moved;
  }
  if (moved.ok() && ep_->failed()) {
    moved = absl::UnavailableError("the store's UCX endpoint failed");
  }
  if (!moved.ok()) {
    ep_->MarkFailed();
    Drop();
  }
  return moved;
}

}  // namespace kvtier
