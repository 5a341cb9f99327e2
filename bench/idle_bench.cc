// kvtier-bench idle: what idle data-plane connections of one tenant cost
// another tenant and the store. A store with two tenants; tenant "idle"
// opens --idle authenticated socket data-plane connections (each proves
// its session and then says nothing); tenant "busy" reads one 64 KiB block
// at a time meanwhile. Rounds alternate none / --idle open, and each pair's
// get p99 is printed with its ratio (this host's speed drifts). Last, the
// store's threads and resident memory with --many idle connections beside
// the same with none.
#include <fcntl.h>
#include <openssl/sha.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "client/store_data_client.h"
#include "common/config.h"
#include "common/data_hello.h"
#include "common/data_wire.h"
#include "common/log.h"
#include "common/rpc/tls.h"
#include "common/socket_io.h"
#include "kvtier/v1/store.grpc.pb.h"
#include "testing/process.h"

namespace kvtier::bench {
namespace {

constexpr char kIdleToken[] = "idle-bench-idle-tenant-token";
constexpr char kBusyToken[] = "idle-bench-busy-tenant-token";
constexpr uint64_t kBlock = 64 << 10;
constexpr uint64_t kBlocks = 64;

std::string Sha256Hex(const std::string& s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  std::string hex;
  for (unsigned char c : d) absl::StrAppend(&hex, absl::Hex(c, absl::kZeroPad2));
  return hex;
}

// Opens n authenticated connections as `token`'s tenant (one session);
// their fds.
absl::StatusOr<std::vector<int>> OpenIdle(const std::string& address, const std::string& token,
                                          int n) {
  auto stub = v1::Store::NewStub(OpenChannel(address, {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ctx.AddMetadata("x-kvtier-tenant-token", token);
  v1::ConnectDataPlaneResponse resp;
  if (auto s = stub->ConnectDataPlane(&ctx, {}, &resp); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("ConnectDataPlane: ", s.error_message()));
  }
  const std::string& at = resp.data_address();
  const int port = std::stoi(at.substr(at.rfind(':') + 1));
  std::vector<int> fds;
  auto fail = [&](const std::string& what) {
    for (int fd : fds) close(fd);
    return absl::UnavailableError(absl::StrCat("idle connection ", fds.size(), ": ", what));
  };
  for (int i = 0; i < n; ++i) {
    const auto by = net::Clock::now() + std::chrono::seconds(10);
    auto fd = net::Connect("127.0.0.1", port, by);
    if (!fd.ok()) return fail(std::string(fd.status().message()));
    fds.push_back(*fd);
    wire::Reply r;
    std::string nonce(wire::kNonceBytes, '\0');
    if (!net::ReadAll(*fd, &r, sizeof(r), by).ok() || r.magic != wire::kChallengeMagic ||
        r.data_bytes != nonce.size() || !net::ReadAll(*fd, nonce.data(), nonce.size(), by).ok()) {
      return fail("no challenge");
    }
    const std::string payload = wire::HelloPayload(resp.session(), nonce);
    wire::Frame f{wire::kFrameMagic, wire::kHello, 0, 0, 0, payload.size()};
    if (!net::WriteAll(*fd, &f, sizeof(f), by).ok() ||
        !net::WriteAll(*fd, payload.data(), payload.size(), by).ok() ||
        !net::ReadAll(*fd, &r, sizeof(r), by).ok()) {
      return fail("no answer to the hello");
    }
    std::string text(r.message_bytes, '\0');
    if (!net::ReadAll(*fd, text.data(), text.size(), by).ok() || r.code != 0) {
      return fail(absl::StrCat("hello refused: ", text));
    }
  }
  return fds;
}

void CloseAll(std::vector<int>* fds) {
  for (int fd : *fds) close(fd);
  fds->clear();
}

}  // namespace

int RunIdleBench(int argc, const char* const* argv) {
  int64_t idle = 1000, many = 4000, rounds = 2, gets = 2000;
  std::string store_bin;
  FlagSet flags("kvtier-bench idle",
                "Another tenant's 64 KiB get latency beside N idle data-plane connections, and "
                "the store's threads and memory with many");
  flags.Int("idle", &idle, 1, 100000, "Idle connections while the gets are timed");
  flags.Int("many", &many, 1, 100000, "Idle connections for the threads and memory figure");
  flags.Int("rounds", &rounds, 1, 100, "Pairs of (none, --idle) timings");
  flags.Int("gets", &gets, 10, 10000000, "Gets per timing");
  flags.String("store-bin", &store_bin, "kvtier-store binary [default: next to this one]");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  if (store_bin.empty()) store_bin = DefaultBinary("cachestore", "kvtier-store");
  TempDir dir;
  {
    std::ofstream t(dir.sub("tenants"));
    t << "secret idle-bench\n"
      << "tenant idle ram=16MiB connections=" << many + 16
      << " token-sha256=" << Sha256Hex(kIdleToken) << "\n"
      << "tenant busy ram=16MiB token-sha256=" << Sha256Hex(kBusyToken) << "\n";
    std::ofstream a(dir.sub("admin"));
    a << "idle-bench-admin-token\n";
  }
  auto store = LocalServer::Start(
      store_bin, dir.sub("store"),
      {"--data-dir=" + dir.sub("db"), "--data-listen=127.0.0.1:0", "--hugepages=false",
       "--ram-bytes=64MiB", "--tenants-file=" + dir.sub("tenants"),
       "--admin-token-file=" + dir.sub("admin"),
       absl::StrCat("--data-max-connections=", many + 64)});
  if (!store.ok()) {
    std::fprintf(stderr, "kvtier-bench idle: %s\n", std::string(store.status().message()).c_str());
    return 1;
  }
  DataClientOptions o;
  o.tenant_token = kBusyToken;
  StoreDataClient busy((*store)->address(), o);
  auto spec = SpecForBlockBytes(kBlock, "kvtier-bench-idle");
  if (!spec.ok()) return 2;
  auto ns = busy.control().RegisterNamespace(*spec);
  if (!ns.ok()) {
    std::fprintf(stderr, "kvtier-bench idle: register: %s\n",
                 std::string(ns.status().message()).c_str());
    return 1;
  }
  std::vector<uint8_t> src(kBlocks * kBlock), dst(kBlock);
  std::vector<PutBlock> put;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    FillBlock(ns->id, BlockHash{i, 7}, src.data() + i * kBlock, kBlock);
    put.push_back({BlockHash{i, 7}, src.data() + i * kBlock});
  }
  if (auto w = busy.Put(ns->id, kBlock, put).get(); !w.ok()) {
    std::fprintf(stderr, "kvtier-bench idle: put: %s\n", std::string(w.status().message()).c_str());
    return 1;
  }
  // p50 and p99 of `gets` one-block gets, in microseconds.
  auto time_gets = [&]() -> absl::StatusOr<std::pair<double, double>> {
    std::vector<double> us;
    us.reserve(static_cast<size_t>(gets));
    for (int64_t i = 0; i < gets; ++i) {
      const uint64_t b = static_cast<uint64_t>(i) % kBlocks;
      const auto t0 = Clock::now();
      auto got = busy.Get(ns->id, kBlock, {{BlockHash{b, 7}, dst.data()}}).get();
      us.push_back(Seconds(t0) * 1e6);
      if (!got.ok()) return got.status();
      if (got->blocks != 1 || std::memcmp(dst.data(), src.data() + b * kBlock, kBlock) != 0) {
        return absl::DataLossError(absl::StrCat("block ", b, " did not come back byte-exact"));
      }
    }
    return std::make_pair(Percentile(us, 0.5), Percentile(us, 0.99));
  };
  if (auto warm = time_gets(); !warm.ok()) {
    std::fprintf(stderr, "kvtier-bench idle: %s\n", std::string(warm.status().message()).c_str());
    return 1;
  }
  std::printf(
      "busy tenant's 64 KiB get (us), %lld gets per timing, beside %lld idle connections "
      "of another tenant\n",
      static_cast<long long>(gets), static_cast<long long>(idle));
  std::printf("%-6s | %9s %9s | %9s %9s | %9s\n", "round", "none p50", "none p99", "idle p50",
              "idle p99", "p99 ratio");
  std::vector<int> fds;
  for (int64_t r = 0; r < rounds; ++r) {
    auto none = time_gets();
    auto opened = OpenIdle((*store)->address(), kIdleToken, static_cast<int>(idle));
    if (!opened.ok()) {
      std::fprintf(stderr, "kvtier-bench idle: %s\n",
                   std::string(opened.status().message()).c_str());
      return 1;
    }
    fds = std::move(*opened);
    auto with = time_gets();
    CloseAll(&fds);
    if (!none.ok() || !with.ok()) {
      std::fprintf(stderr, "kvtier-bench idle: %s\n",
                   std::string((none.ok() ? with.status() : none.status()).message()).c_str());
      return 1;
    }
    std::printf("%-6lld | %9.1f %9.1f | %9.1f %9.1f | %9.2f\n", static_cast<long long>(r + 1),
                none->first, none->second, with->first, with->second, with->second / none->second);
  }
  // Threads and memory: let the closed connections go first.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const pid_t pid = (*store)->pid();
  const int threads0 = ThreadCount(pid);
  const uint64_t rss0 = RssBytes(pid);
  auto opened = OpenIdle((*store)->address(), kIdleToken, static_cast<int>(many));
  if (!opened.ok()) {
    std::fprintf(stderr, "kvtier-bench idle: %s\n", std::string(opened.status().message()).c_str());
    return 1;
  }
  fds = std::move(*opened);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int threads1 = ThreadCount(pid);
  const uint64_t rss1 = RssBytes(pid);
  CloseAll(&fds);
  std::printf(
      "store with %lld idle connections: threads %d (none: %d, +%d), resident %.1f MiB "
      "(none: %.1f MiB, +%.1f MiB); cores %u\n",
      static_cast<long long>(many), threads1, threads0, threads1 - threads0, rss1 / 1048576.0,
      rss0 / 1048576.0, (double(rss1) - double(rss0)) / 1048576.0,
      std::thread::hardware_concurrency());
  return 0;
}

}  // namespace kvtier::bench
