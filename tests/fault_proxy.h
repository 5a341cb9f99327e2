// A TCP proxy on 127.0.0.1 that a test puts between two kvtier processes and
// turns faulty on demand: forward, black-hole (connections stay open, no byte
// moves either way: a partition), or reset (every connection, open or new,
// is closed with RST). Thread per connection; bounded to test scale. It
// keeps every byte it forwarded, both ways (Seen): what an eavesdropper on
// the link reads.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvtier::testing {

class FaultProxy {
 public:
  enum class Mode { kForward, kBlackhole, kReset };

  explicit FaultProxy(int target_port) : target_port_(target_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a = Loopback(0);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(listen_fd_, 64);
    socklen_t len = sizeof(a);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~FaultProxy() {
    stop_ = true;
    acceptor_.join();
    std::lock_guard lk(mu_);
    for (auto& t : pumps_) t.join();
    close(listen_fd_);
  }
  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void Set(Mode m) { mode_ = m; }
  uint64_t connections() const { return connections_; }
  // When each connection came, forwarded or not (a refused upstream, or
  // reset mode, resets it).
  std::vector<std::chrono::steady_clock::time_point> Accepted() const {
    std::lock_guard lk(seen_mu_);
    return accepted_;
  }
  // Every byte forwarded so far, either way, in the order forwarded.
  std::string Seen() const {
    std::lock_guard lk(seen_mu_);
    return seen_;
  }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }
  // Close with RST (SO_LINGER 0), as a reset by the network would.
  static void Reset(int fd) {
    linger l{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    close(fd);
  }
  static bool WriteAll(int fd, const char* p, ssize_t n) {
    while (n > 0) {
      ssize_t w = send(fd, p, static_cast<size_t>(n), MSG_NOSIGNAL);
      if (w <= 0) return false;
      p += w;
      n -= w;
    }
    return true;
  }

  void AcceptLoop() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      {
        std::lock_guard lk(seen_mu_);
        accepted_.push_back(std::chrono::steady_clock::now());
      }
      if (mode_ == Mode::kReset) {
        Reset(client);
        continue;
      }
      int upstream = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a = Loopback(target_port_);
      if (connect(upstream, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        close(upstream);
        Reset(client);
        continue;
      }
      ++connections_;
      std::lock_guard lk(mu_);
      pumps_.emplace_back([this, client, upstream] { Pump(client, upstream); });
    }
  }

  void Pump(int a, int b) {
    char buf[64 << 10];
    while (!stop_) {
      Mode m = mode_;
      if (m == Mode::kReset) break;
      if (m == Mode::kBlackhole) {  // hold both ends open; move nothing
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (poll(p, 2, 20) <= 0) continue;
      bool closed = false;
      for (int i = 0; i < 2 && !closed; ++i) {
        if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        int from = i == 0 ? a : b, to = i == 0 ? b : a;
        ssize_t n = recv(from, buf, sizeof(buf), 0);
        if (n > 0) {
          std::lock_guard lk(seen_mu_);
          seen_.append(buf, static_cast<size_t>(n));
        }
        closed = n <= 0 || !WriteAll(to, buf, n);
      }
      if (closed) break;
    }
    Reset(a);
    Reset(b);
  }

  int target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<Mode> mode_{Mode::kForward};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> connections_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> pumps_;  // guarded by mu_
  mutable std::mutex seen_mu_;
  std::string seen_;                                             // guarded by seen_mu_
  std::vector<std::chrono::steady_clock::time_point> accepted_;  // guarded by seen_mu_
};

}  // namespace kvtier::testing
