// The socket data plane's listener: start and stop, accepting (capped,
// paused when out of descriptors), unhelloed connections evicted, stats.
#include "cachestore/socket_dataplane_loop.h"

namespace kvtier::store {

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
