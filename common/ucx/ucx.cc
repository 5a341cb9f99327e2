#include "common/ucx/ucx.h"

#include <poll.h>

#include <arpa/inet.h>
#include <netdb.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"

namespace kvtier::ucx {

absl::Status FromUcs(ucs_status_t s, const std::string& what) {
  if (s == UCS_OK) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", ucs_status_string(s));
  switch (s) {
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
      return absl::UnavailableError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::StatusOr<std::shared_ptr<Context>> Context::Create() {
  // Large TCP segments: ~2.4x the bandwidth for MiB-sized blocks on loopback.
  // These are transport (UCT) options, read from the environment only; an
  // operator's own setting wins.
  setenv("UCX_TCP_TX_SEG_SIZE", "512k", 0);
  setenv("UCX_TCP_RX_SEG_SIZE", "512k", 0);
  ucp_config_t* cfg;
  if (auto s = ucp_config_read(nullptr, nullptr, &cfg); s != UCS_OK) {
    return FromUcs(s, "reading the UCX configuration");
  }
  ucp_params_t p{};
  p.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // Workers of one context live on different threads (client lanes), and
  // memory is registered from yet another: make the context thread-safe.
  p.mt_workers_shared = 1;
  p.name = "kvtier";
  ucp_context_h ctx;
  ucs_status_t s = ucp_init(&p, cfg, &ctx);
  ucp_config_release(cfg);
  if (s != UCS_OK) return FromUcs(s, "initialising UCX");
  return std::shared_ptr<Context>(new Context(ctx));
}

bool NetworkTransportsAllowed() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0' || *tls == '^') return true;  // all, or all but some
  for (absl::string_view t : absl::StrSplit(tls, ',')) {
    for (absl::string_view net : {"all", "tcp", "rc", "ud", "dc", "ib"}) {
      if (absl::StartsWith(t, net)) return true;
    }
  }
  return false;
}

Context::~Context() { ucp_cleanup(ctx_); }

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(std::shared_ptr<Context> ctx, bool wakeup) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  (void)wakeup;  // the context enables wakeup; events are only armed when used
  ucp_worker_h w;
  if (auto s = ucp_worker_create(ctx->get(), &wp, &w); s != UCS_OK) {
    return FromUcs(s, "creating a UCX worker");
  }
  return std::unique_ptr<Worker>(new Worker(std::move(ctx), w));
}

Worker::~Worker() { ucp_worker_destroy(worker_); }

absl::StatusOr<std::string> Worker::Address() {
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  if (auto s = ucp_worker_query(worker_, &attr); s != UCS_OK) {
    return FromUcs(s, "querying the UCX worker's address");
  }
  std::string out(reinterpret_cast<char*>(attr.address), attr.address_length);
  ucp_worker_release_address(worker_, attr.address);
  return out;
}

absl::StatusOr<int> Worker::EventFd() {
  int fd;
  if (auto s = ucp_worker_get_efd(worker_, &fd); s != UCS_OK) {
    return FromUcs(s, "getting the UCX worker's event fd");
  }
  return fd;
}

absl::Status Worker::WaitAll(std::vector<void*>& reqs, Clock::time_point deadline,
                             const std::function<void()>& close_endpoint) {
  absl::Status first = absl::OkStatus();
  auto note = [&](ucs_status_t s) {
    if (s != UCS_OK && first.ok()) first = FromUcs(s, "UCX transfer");
  };
  bool cancelled = false, close_endpoint_called = false;
  Clock::time_point give_up{}, hard_stop{};
  size_t open = 0;
  for (void*& r : reqs) {
    if (r == nullptr) continue;
    if (UCS_PTR_IS_ERR(r)) {
      note(UCS_PTR_STATUS(r));
      r = nullptr;
      continue;
    }
    ++open;
  }
  auto last_progress = Clock::now();
  while (open > 0) {
    const bool progressed = Progress() != 0;
    const size_t was_open = open;
    open = 0;
    for (void*& r : reqs) {
      if (r == nullptr) continue;
      ucs_status_t s = ucp_request_check_status(r);
      if (s == UCS_INPROGRESS) {
        ++open;
        continue;
      }
      note(s);
      ucp_request_free(r);
      r = nullptr;
    }
    if (progressed || open < was_open) {
      last_progress = Clock::now();
    } else if (open > 0) {
      RestIfIdle(last_progress);
    }
    if (open > 0 && !cancelled && Clock::now() > deadline) {
      for (void* r : reqs) {
        if (r) ucp_request_cancel(worker_, r);
      }
      cancelled = true;
      give_up = Clock::now() + std::chrono::milliseconds(500);
      if (first.ok() || first.code() == absl::StatusCode::kUnavailable) {
        first = absl::DeadlineExceededError("UCX transfer did not complete before its deadline");
      }
    }
    if (open > 0 && cancelled && Clock::now() > give_up) {
      // Some transports cannot cancel (e.g. shared memory to a dead peer).
      // A request still open may yet write into its buffer, which the
      // caller frees once this returns: close the endpoint (its requests
      // then complete, failed) and go on progressing until they have.
      if (close_endpoint) {
        close_endpoint();
        close_endpoint_called = true;
        give_up = Clock::time_point::max();
        hard_stop = Clock::now() + std::chrono::seconds(10);
        continue;
      }
      // No endpoint to close: let UCX release the requests whenever they
      // end, and stop waiting (their buffers must outlive them).
      for (void*& r : reqs) {
        if (r) ucp_request_free(r);
        r = nullptr;
      }
      break;
    }
    if (open > 0 && close_endpoint_called && Clock::now() > hard_stop) {
      // Closed and still not complete after 10 s: UCX has lost them.
      Log("ucx", open,
          " requests did not complete 10 s after their endpoint was closed; "
          "released to UCX");
      for (void*& r : reqs) {
        if (r) ucp_request_free(r);
        r = nullptr;
      }
      break;
    }
  }
  return first;
}

void Worker::RestIfIdle(Clock::time_point& last_progress) {
  if (Clock::now() - last_progress <= std::chrono::microseconds(50)) return;
  // Nothing for a while: sleep until the transport has news (armed only
  // when no event is pending; BUSY means progress again at once).
  if (efd_ == -2) {
    auto fd = EventFd();
    efd_ = fd.ok() ? *fd : -1;
  }
  if (efd_ >= 0 && ucp_worker_arm(worker_) == UCS_OK) {
    pollfd p{efd_, POLLIN, 0};
    poll(&p, 1, 1);
  }
  last_progress = Clock::now();
}

bool Worker::WaitUntil(const std::function<bool()>& done, Clock::time_point deadline) {
  auto last_progress = Clock::now();
  for (;;) {
    if (Progress() != 0) last_progress = Clock::now();
    if (done()) return true;
    if (Clock::now() > deadline) return false;
    RestIfIdle(last_progress);
  }
}

absl::Status Worker::SetAmHandler(uint16_t id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                 UCP_AM_HANDLER_PARAM_FIELD_ARG;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  return FromUcs(ucp_worker_set_am_recv_handler(worker_, &p),
                 absl::StrCat("setting the UCX active-message handler ", id));
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> MemoryRegion::Map(std::shared_ptr<Context> ctx,
                                                                void* addr, size_t length) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = addr;
  mp.length = length;
  ucp_mem_h memh;
  if (auto s = ucp_mem_map(ctx->get(), &mp, &memh); s != UCS_OK) {
    return FromUcs(s, absl::StrCat("registering ", length, " bytes with UCX"));
  }
  return std::unique_ptr<MemoryRegion>(new MemoryRegion(std::move(ctx), memh, addr, length));
}

MemoryRegion::~MemoryRegion() { ucp_mem_unmap(ctx_->get(), memh_); }

absl::StatusOr<std::string> MemoryRegion::PackRkey() const {
  void* buf;
  size_t size;
  if (auto s = ucp_rkey_pack(ctx_->get(), memh_, &buf, &size); s != UCS_OK) {
    return FromUcs(s, "packing a UCX remote key");
  }
  std::string out(static_cast<char*>(buf), size);
  ucp_rkey_buffer_release(buf);
  return out;
}

void Endpoint::OnError(void* arg, ucp_ep_h, ucs_status_t) {
  static_cast<Endpoint*>(arg)->failed_ = true;
}

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::Connect(Worker* worker, const std::string& host,
                                                            int port) {
  sockaddr_storage ss{};
  socklen_t len;
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve UCX address ", host));
  }
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  freeaddrinfo(res);
  std::unique_ptr<Endpoint> e(new Endpoint(worker));
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  p.sockaddr.addrlen = len;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &Endpoint::OnError;
  p.err_handler.arg = e.get();
  if (auto s = ucp_ep_create(worker->get(), &p, &e->ep_); s != UCS_OK) {
    e->ep_ = nullptr;
    return FromUcs(s, absl::StrCat("connecting to UCX listener ", host, ":", port));
  }
  return e;
}

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::ConnectToWorker(Worker* worker,
                                                                    const std::string& address,
                                                                    bool peer_failure_handling) {
  std::unique_ptr<Endpoint> e(new Endpoint(worker));
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  p.err_mode = peer_failure_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = &Endpoint::OnError;
  p.err_handler.arg = e.get();
  if (auto s = ucp_ep_create(worker->get(), &p, &e->ep_); s != UCS_OK) {
    e->ep_ = nullptr;
    return FromUcs(s, "connecting to the store's UCX worker");
  }
  return e;
}

absl::StatusOr<std::unique_ptr<RemoteKey>> Endpoint::Unpack(const std::string& packed) {
  ucp_rkey_h k;
  if (auto s = ucp_ep_rkey_unpack(ep_, packed.data(), &k); s != UCS_OK) {
    return FromUcs(s, "unpacking the store's remote key");
  }
  return std::make_unique<RemoteKey>(k);
}

absl::Status Endpoint::Flush(Clock::time_point deadline) {
  ucp_request_param_t p{};
  std::vector<void*> reqs = {ucp_ep_flush_nbx(ep_, &p)};
  absl::Status s = worker_->WaitAll(reqs, deadline);
  if (s.ok() && failed_) return absl::UnavailableError("the UCX peer failed");
  return s;
}

Endpoint::~Endpoint() {
  if (!ep_) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = failed_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  std::vector<void*> reqs = {ucp_ep_close_nbx(ep_, &p)};
  worker_->WaitAll(reqs, Clock::now() + std::chrono::seconds(1)).IgnoreError();
}

}  // namespace kvtier::ucx
