// Shared pieces of kvtier-bench: starting a real kvtier-store, namespaces of
// a chosen block size, deterministic block contents, timing and tables.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "common/huge_pages.h"
#include "testing/process.h"

namespace kvtier::bench {

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// A namespace whose blocks are exactly block_bytes (a multiple of 8 KiB):
// fp16, 1 layer, 16 tokens, head_dim 128, block_bytes / 8 KiB KV heads.
absl::StatusOr<NamespaceSpec> SpecForBlockBytes(uint64_t block_bytes, const std::string& model);

// The bytes a block holds in benchmarks and the demo: a pure function of
// (namespace, hash), so every read can be checked byte for byte.
void FillBlock(uint64_t ns, const BlockHash& hash, uint8_t* out, size_t len);
std::string BlockContent(uint64_t ns, const BlockHash& hash, size_t len);

// The value at fraction p (0..1) of the sorted values; 0 for none.
double Percentile(std::vector<double> values, double p);

// Comma-separated flag lists; an error names the flag and the bad entry, and
// an empty list is an error. Sizes take 64KiB-style units and must be
// multiples of `multiple_of`; integers must lie in [min, max].
absl::StatusOr<std::vector<uint64_t>> ParseSizeList(const std::string& flag,
                                                    const std::string& text,
                                                    uint64_t multiple_of = 1);
absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& flag, const std::string& text,
                                                  int64_t min, int64_t max);

// A kvtier binary in the build tree (../SUBDIR/NAME from this binary), next to
// this binary, or on PATH.
std::string DefaultBinary(const std::string& subdir, const std::string& name);

// Any kvtier server that takes --listen and --port-file, on 127.0.0.1:0;
// stopped (SIGTERM, then SIGKILL) on destruction.
class LocalServer {
 public:
  static absl::StatusOr<std::unique_ptr<LocalServer>> Start(const std::string& binary,
                                                            const std::string& scratch,
                                                            const std::vector<std::string>& flags);
  ~LocalServer();
  const std::string& address() const { return address_; }
  pid_t pid() const;
  // kill -9 and start again with the same flags on the same port.
  absl::Status Restart();
  // kill -9, no restart (Restart brings it back).
  void Kill9();
  // Sends `sig` and returns (WaitExit waits for the process).
  void Signal(int sig);
  // Waits up to `timeout` for the process to exit (then kill -9); its
  // wait status.
  int WaitExit(std::chrono::milliseconds timeout);
  // The last `bytes` of the server's log (for failure messages).
  std::string LogTail(size_t bytes = 2000) const;

 private:
  std::unique_ptr<Process> proc_;
  std::string address_, binary_, scratch_;
  std::vector<std::string> args_;
};

// nginx (Debian's, sendfile, keepalive) serving one body of `bytes` from
// `dir` over HTTP and over HTTPS (TLS 1.3 with `cert`/`key`), each read by
// wrk with `connections` keep-alive connections for `seconds`: bytes per
// second over each, {plain, tls}.
absl::StatusOr<std::pair<double, double>> NginxPlainTlsBytesPerSec(const std::string& dir,
                                                                   const std::string& cert,
                                                                   const std::string& key,
                                                                   uint64_t bytes, int connections,
                                                                   int seconds);

// Starts a redis-server on a free loopback port and runs redis-benchmark
// SET then GET with values of value_bytes over `keys` keys (-r), `clients`
// connections and `pipeline` requests per round trip. Returns (SET rps,
// GET rps). GETs are timed after the key space is mostly filled.
absl::StatusOr<std::pair<double, double>> RedisSetGetRps(const std::string& dir,
                                                         uint64_t value_bytes, int64_t keys,
                                                         int64_t clients, int64_t pipeline);

// ucx_perftest between two processes on loopback with the given UCX_TLS:
// test is "ucp_put_bw" or "ucp_get"; returns bytes per second.
absl::StatusOr<double> UcxPerftestBytesPerSec(const std::string& tls, const std::string& test,
                                              uint64_t size, int64_t iterations);

// Mooncake Store, the reference beside kvtier's store: bench/mooncake_ref.py
// run with the project's Python environment (KVTIER_PYTHON, else
// BUILD/venv/bin/python next to this binary's directory) starts
// mooncake_master and a mooncake_client holding the memory on 127.0.0.1,
// then `clients` processes put `blocks` blocks of block_bytes with its
// zero-copy batch calls over TCP, `batch` a call, and get them back.
// UNAVAILABLE (saying why) when Mooncake cannot run here.
struct MooncakeFigures {
  double put_gbps = 0, get_gbps = 0;  // 1e9 bytes per second
};
absl::StatusOr<MooncakeFigures> MooncakeStoreGbps(uint64_t block_bytes, uint64_t blocks,
                                                  int64_t batch, int64_t clients);

// Runs a shell command and returns its standard output.
absl::StatusOr<std::string> RunCapture(const std::string& command);
bool HaveCommand(const std::string& name);

// Allocates in 2 MiB-aligned blocks that ask for transparent huge pages (as
// an engine's pinned host buffers usually are), so a benchmark's buffers do
// not add a TLB miss per 4 KiB to whatever moves through them. Every path
// and reference of a benchmark uses the same kind of buffer.
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = AllocateHugePageBacked(n * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
};
using HugeBuffer = std::vector<uint8_t, HugePageAllocator<uint8_t>>;

}  // namespace kvtier::bench
