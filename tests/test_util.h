// Test helpers: deterministic block contents; processes and temp dirs come
// from common/process.h.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "testing/process.h"

namespace kvtier::testing {

using kvtier::Process;
using kvtier::TempDir;
using kvtier::WaitForPortFile;

// Deterministic pseudo-random bytes for block n.
inline std::string BlockBytesFor(uint64_t n, size_t size) {
  std::string s(size, '\0');
  std::mt19937_64 rng(n * 0x9E3779B97F4A7C15ull + 1);
  for (size_t i = 0; i + 8 <= size; i += 8) {
    uint64_t v = rng();
    std::memcpy(s.data() + i, &v, 8);
  }
  return s;
}

}  // namespace kvtier::testing

namespace kvtier::testing {

// Polls pred every 10 ms until it holds or timeout passes; returns pred().
template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// A free TCP port on 127.0.0.1 (for servers that must come back on the same port).
inline int FreePort() { return FreeLoopbackPort(); }

// A kvtier server binary on 127.0.0.1 that reports its port through
// --port-file; stopped (SIGKILL) on destruction.
class ServerProcess {
 public:
  ServerProcess(std::string binary, std::string scratch, std::vector<std::string> args)
      : binary_(std::move(binary)), scratch_(std::move(scratch)), args_(std::move(args)) {
    Start();
  }
  void Start() {
    std::string port_file = scratch_ + ".port";
    std::remove(port_file.c_str());
    std::vector<std::string> args = args_;
    args.push_back("--port-file=" + port_file);
    proc_ = std::make_unique<Process>(binary_, args, scratch_ + ".log");
    port_ = WaitForPortFile(port_file, std::chrono::seconds(20), proc_->pid());
  }
  int port() const { return port_; }
  // The server's log so far (for failure messages).
  std::string Log() const {
    std::ifstream in(scratch_ + ".log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  Process& proc() { return *proc_; }

 private:
  std::string binary_, scratch_;
  std::vector<std::string> args_;
  std::unique_ptr<Process> proc_;
  int port_ = 0;
};

// A server whose flags name ports picked with FreePort. Such a port was free
// when picked, but a process running beside may bind it first (a listener,
// or an outgoing connection's ephemeral port), and the server then exits at
// start. So while it reports no port, it is started again with flags from
// `args`, which picks fresh ports on each call (3 tries).
inline std::unique_ptr<ServerProcess> StartOnFreePorts(
    const std::string& binary, const std::string& scratch,
    const std::function<std::vector<std::string>()>& args) {
  std::unique_ptr<ServerProcess> server;
  for (int attempt = 0; attempt < 3; ++attempt) {
    server = std::make_unique<ServerProcess>(binary, scratch, args());
    if (server->port() > 0) break;
  }
  return server;
}

// Flags of a kvtier-store on 127.0.0.1 with a data plane (the socket one
// unless `extra` says --data-plane=ucx), its data in `scratch` + "-db", no
// hugepages and a 64 MiB RAM tier, then `extra`.
inline std::vector<std::string> LoopbackStoreArgs(const std::string& scratch,
                                                  std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0",
                                   "--data-dir=" + scratch + "-db", "--hugepages=false",
                                   "--ram-bytes=64MiB"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

#ifdef KVTIER_STORE_BIN
// A kvtier-store of LoopbackStoreArgs in `scratch` (UCX_TLS=tcp for both
// processes, for a UCX data plane).
inline std::unique_ptr<ServerProcess> StartLoopbackStore(const std::string& scratch,
                                                         std::vector<std::string> extra = {}) {
  setenv("UCX_TLS", "tcp", 1);
  return std::make_unique<ServerProcess>(KVTIER_STORE_BIN, scratch,
                                         LoopbackStoreArgs(scratch, std::move(extra)));
}
#endif

// The whole HTTP/1.0 response to GET path on 127.0.0.1:port ("" if the
// connection is refused).
inline std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[8192];
  ssize_t r;
  while ((r = read(fd, buf, sizeof(buf))) > 0) out.append(buf, r);
  close(fd);
  return out;
}

}  // namespace kvtier::testing
