// kvtier-bench dataplane: put and get throughput of kvtier's data plane
// (BeginPut/BeginGet + transfer + Commit/End) over TCP (the socket data
// plane, the default, and the UCX RMA one, --data-plane ucx, side by side:
// the socket row's ratio to the UCX row is the cost of a store that checks
// every transfer), over shared memory, and of the inline gRPC path, for
// several block sizes and batch sizes, each beside references measured in
// the same run, with ratios. Buffers are larger than the CPU caches
// (--working-set).
//
// What each row is compared with, and why (a ratio against a crippled or an
// impossible reference says nothing):
//  - raw RMA, always: a RawRma (bench/raw_rma.h) over the same store, with
//    the same DataClientOptions (so the same transport and shared-memory
//    choice) and the same registered buffers, moving every block of the case
//    once with no control plane in the loop: the data plane's own ceiling.
//    Socket and inline-gRPC rows are compared with the UCX TCP one (a
//    socket store serves no RMA).
//  - the transport's ceiling for distinct buffers: ucx_perftest (ucp_put_bw /
//    ucp_get over TCP, started here) for TCP and inline gRPC; for shared
//    memory, memcpy of the same working set between distinct buffers, since
//    ucx_perftest over shm reuses one cache-resident buffer (40-120 GB/s, a
//    figure no transfer of distinct blocks can reach), and a same-host client
//    maps the store's arena, so the shm path is a memcpy through the mapping.
//  - Redis at its best on this machine (redis-server and redis-benchmark
//    started here): per block size, the best SET and the best GET over
//    1/4/8 connections x pipeline depth 1/4/16, each printed with the
//    configuration that gave it. (One connection at -P = batch made Redis
//    collapse on large values: 0.2 GB/s at 1 MiB, -P 32.)
// ucx_perftest and Redis run only with --references (the default), and a
// reference that cannot be measured fails the run; the raw RMA loop is ours
// and cheap, so it always runs.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/raw_rma.h"
#include "client/store_data_client.h"
#include "common/config.h"
#include "common/limits.h"
#include "common/log.h"

namespace kvtier::bench {
namespace {

struct Row {
  std::string path;  // "socket", "ucx-tcp", "shm", "inline-grpc"
  uint64_t block_bytes;
  int64_t batch;
  std::string op;  // "put" / "get"
  double gbps = 0, blocks_per_s = 0;
  double raw_gbps = 0;         // the raw RMA loop of the same case (inline: ucx-tcp's)
  double perftest_gbps = 0;    // ucx_perftest over TCP (ucx-tcp and inline-grpc rows)
  double memcpy_gbps = 0;      // memcpy of distinct buffers (shm rows)
  double redis_best_gbps = 0;  // Redis at its best for this block size
  double ucx_gbps = 0;         // socket rows: the UCX data plane's (ucx-tcp) figure, same case
  double mooncake_gbps = 0;    // TCP rows: Mooncake Store, same block size, batch and clients
};

struct Transport {
  std::string name;        // row label
  std::string ucx_tls;     // for kvtier (needs a sockaddr-capable transport too)
  std::string data_plane;  // the store's --data-plane
};

// Redis's best SET and best GET for one value size, and where each was found.
struct RedisBest {
  double set_gbps = 0, get_gbps = 0;
  int64_t set_clients = 0, set_pipeline = 0, get_clients = 0, get_pipeline = 0;
};

// The store takes at most this many blocks per BeginGet / BeginPut.
constexpr size_t kMaxBlocksPerCall = limits::kMaxBlocksPerRequest;
// Blocks per raw Get/Put call (all posted, then waited): bounds the requests
// outstanding at once.
constexpr size_t kRawChunk = 1024;

struct RawRates {
  double put_gbps = 0, get_gbps = 0;
};

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// The data plane's own ceiling for one case: a RawRma over the same store
// with the same options, the case's blocks pinned where they lie in the
// arena and as many fresh slots reserved, then one raw Get of every block
// into dst (checked against src) and one raw Put of every block from src,
// each timed alone. The pins and reservations end when this returns (the
// reservations are aborted: nothing is stored).
absl::StatusOr<RawRates> MeasureRawRma(const std::string& store, const DataClientOptions& o,
                                       uint64_t ns, uint64_t size,
                                       const std::vector<BlockHash>& hashes, uint64_t first_put_id,
                                       HugeBuffer& src, HugeBuffer& dst) {
  auto raw = RawRma::Connect(store, o);
  if (!raw.ok()) return Annotate(raw.status(), "raw RMA connect");
  for (auto* buf : {&src, &dst}) {
    if (auto s = (*raw)->Register(buf->data(), buf->size()); !s.ok()) {
      return Annotate(s, "raw RMA register");
    }
  }
  const size_t blocks = hashes.size();
  if (blocks == 0) return absl::InvalidArgumentError("raw RMA: no blocks");
  std::vector<uint64_t> get_addrs, put_addrs;
  for (size_t first = 0; first < blocks; first += kMaxBlocksPerCall) {
    const size_t n = std::min(kMaxBlocksPerCall, blocks - first);
    std::vector<BlockHash> chunk(hashes.begin() + first, hashes.begin() + first + n);
    auto a = (*raw)->PinForGet(ns, chunk);
    if (!a.ok()) return Annotate(a.status(), "raw RMA pin");
    if (a->size() != n) {
      return absl::DataLossError(absl::StrCat("raw RMA pin: the store holds ", a->size(),
                                              " of the ", n, " blocks from block ", first));
    }
    get_addrs.insert(get_addrs.end(), a->begin(), a->end());
  }
  for (size_t first = 0; first < blocks; first += kMaxBlocksPerCall) {
    const size_t n = std::min(kMaxBlocksPerCall, blocks - first);
    auto a = (*raw)->ReserveForPut(ns, first_put_id + first, n);
    if (!a.ok()) return Annotate(a.status(), "raw RMA reserve");
    if (a->size() != n) {
      return absl::ResourceExhaustedError(
          absl::StrCat("raw RMA reserve: the store reserved ", a->size(), " of ", n, " slots"));
    }
    put_addrs.insert(put_addrs.end(), a->begin(), a->end());
  }
  auto split = [](const std::vector<uint64_t>& addrs) {
    std::vector<std::vector<uint64_t>> out;
    for (size_t first = 0; first < addrs.size(); first += kRawChunk) {
      out.emplace_back(addrs.begin() + first,
                       addrs.begin() + std::min(addrs.size(), first + kRawChunk));
    }
    return out;
  };
  const auto gets = split(get_addrs), puts = split(put_addrs);
  // One untimed block each way first (endpoint wire-up, remote key
  // unpacking, the arena mapping), so the ceiling is the steady state.
  if (auto s = (*raw)->Get({get_addrs[0]}, size, dst.data()); !s.ok()) {
    return Annotate(s, "raw RMA get");
  }
  if (auto s = (*raw)->Put({put_addrs[0]}, size, src.data()); !s.ok()) {
    return Annotate(s, "raw RMA put");
  }
  // The kvtier get left the right bytes in dst: clear them so the check
  // below sees what the raw get moved.
  std::memset(dst.data(), 0, dst.size());
  auto start = Clock::now();
  for (size_t c = 0; c < gets.size(); ++c) {
    if (auto s = (*raw)->Get(gets[c], size, dst.data() + c * kRawChunk * size); !s.ok()) {
      return Annotate(s, "raw RMA get");
    }
  }
  const double get_s = Seconds(start);
  if (std::memcmp(src.data(), dst.data(), blocks * size) != 0) {
    return absl::DataLossError("raw RMA get: bytes read back differ from bytes written");
  }
  start = Clock::now();
  for (size_t c = 0; c < puts.size(); ++c) {
    if (auto s = (*raw)->Put(puts[c], size, src.data() + c * kRawChunk * size); !s.ok()) {
      return Annotate(s, "raw RMA put");
    }
  }
  const double put_s = Seconds(start);
  const double bytes = static_cast<double>(blocks) * static_cast<double>(size);
  return RawRates{bytes / put_s / 1e9, bytes / get_s / 1e9};
}

// Times `ops` operations of `batch` blocks, all submitted at once.
template <typename Submit>
absl::StatusOr<double> TimeOps(uint64_t blocks, int64_t batch, Submit submit) {
  auto start = Clock::now();
  std::vector<std::future<absl::Status>> pending;
  for (uint64_t first = 0; first < blocks; first += batch) {
    pending.push_back(submit(first, std::min<uint64_t>(batch, blocks - first)));
  }
  for (auto& f : pending) {
    if (auto s = f.get(); !s.ok()) return s;
  }
  return Seconds(start);
}

}  // namespace

int RunDataPlaneBench(int argc, const char* const* argv) {
  std::string sizes_flag = "256KiB,1MiB,4MiB", batches_flag = "1,32", transports_flag = "tcp,shm";
  uint64_t working_set = 512ull << 20;
  bool quick = false, json = false, inline_path = true, references = true;
  std::string store_bin;
  bool verify_commits = true;
  int64_t repeats = 3;
  FlagSet flags("kvtier-bench dataplane",
                "Put/get throughput of kvtier's data plane (UCX TCP and shared memory) and inline\n"
                "gRPC path beside the raw RMA loop over the same endpoints (the data plane's\n"
                "ceiling), ucx_perftest over TCP, memcpy of distinct buffers (the shared-memory\n"
                "ceiling), Redis at its best and Mooncake Store over TCP, in one run.");
  flags.String("sizes", &sizes_flag, "Block sizes, comma-separated");
  flags.String("batches", &batches_flag, "Blocks per operation, comma-separated");
  flags.String("transports", &transports_flag, "Transports: tcp (UCX), shm (shared memory)");
  flags.Bytes("working-set", &working_set, "Bytes moved per case (larger than the CPU caches)");
  flags.Bool("inline", &inline_path, "Also measure the inline gRPC path");
  flags.Bool("references", &references,
             "Run ucx_perftest, redis-benchmark and Mooncake Store beside (the raw RMA loop "
             "always runs)");
  flags.Bool("quick", &quick, "A reduced set (256KiB and 1MiB, 48 MiB per case) in under a minute");
  flags.Bool("json", &json, "Print JSON");
  flags.String("store-bin", &store_bin, "kvtier-store binary [default: next to this one]");
  flags.Bool("verify-commits", &verify_commits, "Run the store with --verify-commits");
  flags.Int("repeats", &repeats, 1, 100,
            "Rounds per case, each of the project's path then the raw RMA loop; the best "
            "round of each is reported (this VM's throughput swings by 2x between rounds)");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  if (quick) {
    sizes_flag = "256KiB,1MiB";
    working_set = 48ull << 20;
  }
  if (store_bin.empty()) store_bin = DefaultBinary("cachestore", "kvtier-store");
  auto sizes_or = ParseSizeList("sizes", sizes_flag);
  auto batches_or = ParseIntList("batches", batches_flag, 1, 1 << 20);
  for (const absl::Status& s : {sizes_or.status(), batches_or.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  const std::vector<uint64_t>& sizes = *sizes_or;
  const std::vector<int64_t>& batches = *batches_or;
  std::vector<Transport> transports;
  bool have_tcp = false, have_shm = false;
  for (absl::string_view t : absl::StrSplit(transports_flag, ',', absl::SkipEmpty())) {
    if (t == "tcp") {
      transports.push_back({"ucx-tcp", "tcp", "ucx"});
      transports.push_back({"socket", "tcp", "socket"});
      have_tcp = true;
    } else if (t == "shm") {
      transports.push_back({"shm", "sm", "socket"});
      have_shm = true;
    } else {
      std::fprintf(stderr, "kvtier-bench dataplane: flag --transports: \"%s\" is not tcp or shm\n",
                   std::string(t).c_str());
      return 2;
    }
  }
  TempDir dir;
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  auto blocks_of = [&](uint64_t size) { return std::max<uint64_t>(32, working_set / size); };
  uint64_t case_bytes = 0;
  for (uint64_t size : sizes) case_bytes = std::max(case_bytes, blocks_of(size) * size);
  // Three working sets plus slack: a case's blocks, the raw RMA's reserved
  // slots beside them, and room for the next case's fresh keys should the
  // Evict between cases leave some blocks behind (still pinned).
  const uint64_t ram = 3 * case_bytes + 64 * max_size;

  std::vector<Row> rows;
  uint64_t salt = 1;

  auto measure = [&](const std::string& path, const std::string& tls,
                     const std::string& data_plane) -> int {
    setenv("UCX_TLS", tls.c_str(), 1);
    auto store = LocalServer::Start(
        store_bin, dir.sub("store-" + path),
        {"--data-dir=" + dir.sub("store-" + path), absl::StrCat("--ram-bytes=", ram),
         absl::StrCat("--ram-slab-bytes=", std::max<uint64_t>(4 << 20, max_size)),
         "--data-listen=127.0.0.1:0", "--data-plane=" + data_plane, "--hugepages=false",
         "--ram-policy=lru", absl::StrCat("--verify-commits=", verify_commits ? "true" : "false"),
         absl::StrCat("--max-message-bytes=", std::max<uint64_t>(64 << 20, 40 * max_size))});
    if (!store.ok()) {
      std::fprintf(stderr, "kvtier-bench dataplane: %s: %s\n", path.c_str(),
                   std::string(store.status().message()).c_str());
      return 1;
    }
    DataClientOptions o;
    o.max_inflight_bytes = 256ull << 20;
    o.deadline_ms = 60000;
    o.shared_memory = path == "shm" ? DataClientOptions::SharedMemory::kOn
                                    : DataClientOptions::SharedMemory::kOff;
    StoreDataClient client((*store)->address(), o);
    StoreClientOptions so;
    so.max_message_bytes = static_cast<int>(std::max<uint64_t>(64 << 20, 40 * max_size));
    so.deadline_ms = 60000;
    StoreClient inline_client((*store)->address(), so);
    bool is_inline = path == "inline-grpc";
    // RMA needs a UCX store; the shared-memory path's raw loop is memcpys
    // through the mapped arena.
    const bool raw_here = !is_inline && (data_plane == "ucx" || path == "shm");
    for (uint64_t size : sizes) {
      auto spec = SpecForBlockBytes(size, "kvtier-bench-dataplane");
      if (!spec.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s\n",
                     std::string(spec.status().message()).c_str());
        return 2;
      }
      auto ns = client.control().RegisterNamespace(*spec);
      if (!ns.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s %s: register namespace: %s\n",
                     path.c_str(), FormatBytes(size).c_str(),
                     std::string(ns.status().message()).c_str());
        return 1;
      }
      const uint64_t blocks = blocks_of(size);
      HugeBuffer src(blocks * size), dst(blocks * size);
      for (uint64_t i = 0; i < blocks; ++i)
        FillBlock(ns->id, BlockHash{i, 0}, src.data() + i * size, size);
      if (!is_inline) {
        for (auto* buf : {&src, &dst}) {
          if (auto s = client.RegisterMemory(buf->data(), buf->size()); !s.ok()) {
            std::fprintf(stderr, "kvtier-bench dataplane: %s %s: register memory: %s\n",
                         path.c_str(), FormatBytes(size).c_str(), std::string(s.message()).c_str());
            return 1;
          }
        }
      }
      if (!is_inline) {
        // Connect every lane before timing (as the raw loop's connection is):
        // a connection is made once per client, not per transfer. One put
        // and one get per lane, of a block that is evicted with the case.
        std::vector<std::future<absl::StatusOr<PutOutcome>>> warm;
        for (int lane = 0; lane < 4; ++lane) {
          warm.push_back(client.Put(ns->id, size,
                                    {{BlockHash{~0ull, static_cast<uint64_t>(lane)}, src.data()}}));
        }
        for (auto& f : warm) {
          if (auto r = f.get(); !r.ok()) {
            std::fprintf(stderr, "kvtier-bench dataplane: %s %s: warm-up put: %s\n", path.c_str(),
                         FormatBytes(size).c_str(), std::string(r.status().message()).c_str());
            return 1;
          }
        }
        for (int lane = 0; lane < 4; ++lane) {
          (void)client
              .Get(ns->id, size, {{BlockHash{~0ull, static_cast<uint64_t>(lane)}, dst.data()}})
              .get();
        }
      }
      for (int64_t batch : batches) {
        double best_gbps[2] = {0, 0}, best_raw[2] = {0, 0};
        for (int64_t rep = 0; rep < repeats; ++rep) {
          const uint64_t round = salt++;
          auto hash = [&](uint64_t i) { return BlockHash{round, i}; };
          absl::StatusOr<double> put_s, get_s;
          if (is_inline) {
            put_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<std::pair<BlockHash, std::string_view>> b;
              for (uint64_t i = first; i < first + n; ++i) {
                b.emplace_back(hash(i), std::string_view(
                                            reinterpret_cast<char*>(src.data() + i * size), size));
              }
              std::promise<absl::Status> p;
              auto r = inline_client.PutInline(ns->id, b);
              p.set_value(r.ok() ? absl::OkStatus() : r.status());
              return p.get_future();
            });
            get_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<BlockHash> hs;
              for (uint64_t i = first; i < first + n; ++i) hs.push_back(hash(i));
              std::promise<absl::Status> p;
              auto r = inline_client.GetInline(ns->id, hs);
              p.set_value(!r.ok()          ? r.status()
                          : r->size() == n ? absl::OkStatus()
                                           : absl::DataLossError("short inline read"));
              return p.get_future();
            });
          } else {
            put_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<PutBlock> b;
              for (uint64_t i = first; i < first + n; ++i)
                b.push_back({hash(i), src.data() + i * size});
              auto f = client.Put(ns->id, size, std::move(b));
              return std::async(std::launch::deferred, [f = std::move(f), n]() mutable {
                auto r = f.get();
                if (!r.ok()) return r.status();
                return r->written == n
                           ? absl::OkStatus()
                           : absl::ResourceExhaustedError("store did not take every block");
              });
            });
            get_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<GetBlock> b;
              for (uint64_t i = first; i < first + n; ++i)
                b.push_back({hash(i), dst.data() + i * size});
              auto f = client.Get(ns->id, size, std::move(b));
              return std::async(std::launch::deferred, [f = std::move(f), n]() mutable {
                auto r = f.get();
                if (!r.ok()) return r.status();
                return r->blocks == n ? absl::OkStatus() : absl::DataLossError("short read");
              });
            });
            if (get_s.ok() && std::memcmp(src.data(), dst.data(), src.size()) != 0) {
              get_s = absl::DataLossError("bytes read back differ from bytes written");
            }
          }
          for (auto* r : {&put_s, &get_s}) {
            if (!r->ok()) {
              std::fprintf(stderr, "kvtier-bench dataplane: %s %s batch %ld: %s\n", path.c_str(),
                           FormatBytes(size).c_str(), batch,
                           std::string(r->status().message()).c_str());
              return 1;
            }
          }
          // The raw RMA ceiling of the blocks just written, over the same
          // transport. It does not depend on the batch, but it is measured per
          // case (simple, and "the same run" for each row); its pins and
          // reservations end before the Evict below.
          RawRates raw;
          if (raw_here) {
            std::vector<BlockHash> hashes;
            hashes.reserve(blocks);
            for (uint64_t i = 0; i < blocks; ++i) hashes.push_back(hash(i));
            auto r =
                MeasureRawRma((*store)->address(), o, ns->id, size, hashes, round << 32, src, dst);
            if (!r.ok()) {
              std::fprintf(stderr, "kvtier-bench dataplane: %s %s batch %ld: %s\n", path.c_str(),
                           FormatBytes(size).c_str(), batch,
                           std::string(r.status().message()).c_str());
              return 1;
            }
            raw = *r;
          }
          for (int k = 0; k < 2; ++k) {
            const double secs = k == 0 ? *put_s : *get_s;
            best_gbps[k] = std::max(best_gbps[k], blocks * static_cast<double>(size) / secs / 1e9);
            best_raw[k] = std::max(best_raw[k], k == 0 ? raw.put_gbps : raw.get_gbps);
          }
          v1::EvictRequest all;
          all.set_all(true);
          if (auto ev = client.control().Evict(all); !ev.ok()) {
            std::fprintf(stderr, "kvtier-bench dataplane: %s %s batch %ld: evict: %s\n",
                         path.c_str(), FormatBytes(size).c_str(), batch,
                         std::string(ev.status().message()).c_str());
            return 1;
          }
        }
        for (int k = 0; k < 2; ++k) {
          Row row;
          row.path = path;
          row.block_bytes = size;
          row.batch = batch;
          row.op = k == 0 ? "put" : "get";
          row.gbps = best_gbps[k];
          row.blocks_per_s = best_gbps[k] * 1e9 / static_cast<double>(size);
          row.raw_gbps = best_raw[k];
          rows.push_back(row);
        }
      }
    }
    return 0;
  };

  for (const auto& t : transports) {
    if (int rc = measure(t.name, t.ucx_tls, t.data_plane); rc != 0) return rc;
  }
  if (inline_path) {
    if (int rc = measure("inline-grpc", "tcp", "socket"); rc != 0) return rc;
  }
  // memcpy of the same working set between distinct buffers in this
  // process: the ceiling of the shared-memory path (a memcpy through the
  // mapped arena), where ucx_perftest's one cache-resident buffer is not.
  std::map<uint64_t, double> memcpy_gbps;
  if (have_shm) {
    for (uint64_t size : sizes) {
      const uint64_t blocks = blocks_of(size);
      HugeBuffer a(blocks * size, 1), b(blocks * size, 2);
      std::memcpy(b.data(), a.data(), a.size());  // warm both
      auto t = Clock::now();
      for (int rep = 0; rep < 3; ++rep) std::memcpy(b.data(), a.data(), a.size());
      memcpy_gbps[size] = 3.0 * a.size() / Seconds(t) / 1e9;
    }
  }
  // Redis at its best per size, and ucx_perftest over TCP (ucx-tcp and
  // inline-grpc rows) per size and direction.
  constexpr int64_t kRedisClients[] = {1, 4, 8};
  constexpr int64_t kRedisPipelines[] = {1, 4, 16};
  std::map<uint64_t, RedisBest> redis_best;
  std::map<std::pair<uint64_t, std::string>, double> perftest;  // (size, test) -> GB/s over TCP
  const bool want_perftest = have_tcp || inline_path;
  if (references) {
    for (const char* tool : {"redis-server", "redis-benchmark"}) {
      if (!HaveCommand(tool)) {
        std::fprintf(stderr,
                     "kvtier-bench dataplane: %s is not installed (--references=false runs "
                     "without Redis and ucx_perftest)\n",
                     tool);
        return 1;
      }
    }
    if (want_perftest && !HaveCommand("ucx_perftest")) {
      std::fprintf(stderr,
                   "kvtier-bench dataplane: ucx_perftest is not installed (--references=false "
                   "runs without Redis and ucx_perftest)\n");
      return 1;
    }
    for (uint64_t size : sizes) {
      const int64_t keys = static_cast<int64_t>(blocks_of(size));
      RedisBest best;
      std::string last_error;
      for (int64_t clients : kRedisClients) {
        for (int64_t pipeline : kRedisPipelines) {
          auto r = RedisSetGetRps(dir.path(), size, keys, clients, pipeline);
          if (r.ok() && (r->first <= 0 || r->second <= 0)) {
            r = absl::InternalError("redis-benchmark reported no throughput");
          }
          if (!r.ok()) {
            last_error = std::string(r.status().message());
            std::fprintf(stderr,
                         "kvtier-bench dataplane: redis at %s, %ld clients, pipeline %ld: %s "
                         "(skipped)\n",
                         FormatBytes(size).c_str(), clients, pipeline, last_error.c_str());
            continue;
          }
          const double set = r->first * size / 1e9, get = r->second * size / 1e9;
          if (set > best.set_gbps) {
            best.set_gbps = set;
            best.set_clients = clients;
            best.set_pipeline = pipeline;
          }
          if (get > best.get_gbps) {
            best.get_gbps = get;
            best.get_clients = clients;
            best.get_pipeline = pipeline;
          }
        }
      }
      if (best.set_gbps <= 0 || best.get_gbps <= 0) {
        std::fprintf(stderr,
                     "kvtier-bench dataplane: redis at %s: every configuration failed (last: %s)\n",
                     FormatBytes(size).c_str(), last_error.c_str());
        return 1;
      }
      redis_best[size] = best;
      if (!want_perftest) continue;
      for (const char* test : {"ucp_put_bw", "ucp_get"}) {
        auto bw = UcxPerftestBytesPerSec("tcp", test, size, keys);
        if (bw.ok() && *bw <= 0) bw = absl::InternalError("ucx_perftest reported no throughput");
        if (!bw.ok()) {
          std::fprintf(stderr, "kvtier-bench dataplane: ucx_perftest %s over tcp at %s: %s\n", test,
                       FormatBytes(size).c_str(), std::string(bw.status().message()).c_str());
          return 1;
        }
        perftest[{size, test}] = *bw / 1e9;
      }
    }
  }
  // Mooncake Store over TCP (its zero-copy batch calls, one client as here)
  // per size and batch, beside the TCP rows.
  std::map<std::pair<uint64_t, int64_t>, MooncakeFigures> mooncake;
  std::string mooncake_why;
  if (references && (have_tcp || inline_path)) {
    for (uint64_t size : sizes) {
      for (int64_t batch : batches) {
        if (!mooncake_why.empty()) break;
        // The best of --repeats rounds, as for kvtier's paths.
        MooncakeFigures best;
        for (int64_t rep = 0; rep < repeats && mooncake_why.empty(); ++rep) {
          auto m = MooncakeStoreGbps(size, blocks_of(size), batch, 1);
          if (!m.ok()) {
            mooncake_why = std::string(m.status().message());
            std::fprintf(stderr, "kvtier-bench dataplane: Mooncake Store not measured: %s\n",
                         mooncake_why.c_str());
            break;
          }
          best.put_gbps = std::max(best.put_gbps, m->put_gbps);
          best.get_gbps = std::max(best.get_gbps, m->get_gbps);
        }
        if (mooncake_why.empty()) mooncake[{size, batch}] = best;
      }
    }
  }
  for (auto& r : rows) {
    const bool put = r.op == "put";
    if (r.path != "shm") {
      if (auto m = mooncake.find({r.block_bytes, r.batch}); m != mooncake.end()) {
        r.mooncake_gbps = put ? m->second.put_gbps : m->second.get_gbps;
      }
    }
    if (r.path == "inline-grpc" || r.path == "socket") {
      // No raw RMA of its own: compared with UCX TCP's of the same case
      // (and a socket row with the UCX data plane's own figure).
      for (const auto& t : rows) {
        if (t.path == "ucx-tcp" && t.block_bytes == r.block_bytes && t.batch == r.batch &&
            t.op == r.op) {
          r.raw_gbps = t.raw_gbps;
          if (r.path == "socket") r.ucx_gbps = t.gbps;
        }
      }
    }
    if (auto rb = redis_best.find(r.block_bytes); rb != redis_best.end()) {
      r.redis_best_gbps = put ? rb->second.set_gbps : rb->second.get_gbps;
    }
    if (r.path == "shm") {
      r.memcpy_gbps = memcpy_gbps[r.block_bytes];
    } else if (auto pf = perftest.find({r.block_bytes, put ? "ucp_put_bw" : "ucp_get"});
               pf != perftest.end()) {
      r.perftest_gbps = pf->second;
    }
  }

  if (json) {
    nlohmann::json j;
    j["working_set_bytes"] = working_set;
    for (const auto& r : rows) {
      nlohmann::json c = {{"path", r.path},     {"block_bytes", r.block_bytes},
                          {"batch", r.batch},   {"op", r.op},
                          {"gb_per_s", r.gbps}, {"blocks_per_s", r.blocks_per_s}};
      // A reference's figure and the case's ratio to it, when measured.
      auto beside = [&](const char* name, const char* ratio, double ref) {
        if (ref <= 0) return;
        c[name] = ref;
        c[ratio] = r.gbps / ref;
      };
      beside("raw_rma_gb_per_s", "ratio_vs_raw_rma", r.raw_gbps);
      beside("redis_best_gb_per_s", "ratio_vs_redis_best", r.redis_best_gbps);
      beside("perftest_gb_per_s", "ratio_vs_perftest", r.perftest_gbps);
      beside("memcpy_gb_per_s", "ratio_vs_memcpy", r.memcpy_gbps);
      beside("ucx_data_plane_gb_per_s", "ratio_vs_ucx_data_plane", r.ucx_gbps);
      beside("mooncake_gb_per_s", "ratio_vs_mooncake", r.mooncake_gbps);
      j["cases"].push_back(c);
    }
    for (const auto& [size, b] : redis_best) {
      j["redis_best"].push_back({{"block_bytes", size},
                                 {"set_gb_per_s", b.set_gbps},
                                 {"set_clients", b.set_clients},
                                 {"set_pipeline", b.set_pipeline},
                                 {"get_gb_per_s", b.get_gbps},
                                 {"get_clients", b.get_clients},
                                 {"get_pipeline", b.get_pipeline}});
    }
    if (!mooncake_why.empty()) j["mooncake_not_measured"] = mooncake_why;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "kvtier-bench dataplane: %s per case. raw RMA: a UCX RMA loop over the same endpoints\n"
      "and registered arena, no control plane (the data plane's ceiling); ceiling:\n"
      "ucx_perftest for TCP, memcpy of distinct buffers for shared memory; redis-best:\n"
      "Redis's best over 1/4/8 connections x pipeline 1/4/16 for the same value size;\n"
      "mooncake: Mooncake Store (mooncake_master + a mooncake_client holding the memory)\n"
      "over TCP, batch_put_from/batch_get_into of registered buffers, same block size,\n"
      "batch and one client, the best of --repeats rounds\n\n",
      FormatBytes(working_set).c_str());
  if (!mooncake_why.empty())
    std::printf("Mooncake Store not measured: %s\n\n", mooncake_why.c_str());
  for (const auto& [size, b] : redis_best) {
    std::printf(
        "redis best at %s: SET %.2f GB/s (%ld clients, pipeline %ld), GET %.2f GB/s "
        "(%ld clients, pipeline %ld)\n",
        FormatBytes(size).c_str(), b.set_gbps, b.set_clients, b.set_pipeline, b.get_gbps,
        b.get_clients, b.get_pipeline);
  }
  if (!redis_best.empty()) std::printf("\n");
  auto num = [](double v) { return v > 0 ? absl::StrFormat("%.2f", v) : std::string("n/a"); };
  auto ratio = [](double a, double b) {
    return b > 0 ? absl::StrFormat("%.2f", a / b) : std::string("n/a");
  };
  std::printf("%-12s %9s %6s %4s | %8s %10s | %8s %6s | %-8s %8s %6s | %10s %6s | %8s %6s | %7s\n",
              "path", "block", "batch", "op", "GB/s", "blocks/s", "raw GB/s", "ratio", "ceiling",
              "GB/s", "ratio", "redis GB/s", "ratio", "mooncake", "ratio", "vs ucx");
  for (const auto& r : rows) {
    const bool shm = r.path == "shm";
    const double ceiling = shm ? r.memcpy_gbps : r.perftest_gbps;
    std::printf(
        "%-12s %9s %6ld %4s | %8.2f %10.0f | %8s %6s | %-8s %8s %6s | %10s %6s | %8s %6s | %7s\n",
        r.path.c_str(), FormatBytes(r.block_bytes).c_str(), r.batch, r.op.c_str(), r.gbps,
        r.blocks_per_s, num(r.raw_gbps).c_str(), ratio(r.gbps, r.raw_gbps).c_str(),
        shm ? "memcpy" : "perftest", num(ceiling).c_str(), ratio(r.gbps, ceiling).c_str(),
        num(r.redis_best_gbps).c_str(), ratio(r.gbps, r.redis_best_gbps).c_str(),
        num(r.mooncake_gbps).c_str(), ratio(r.gbps, r.mooncake_gbps).c_str(),
        ratio(r.gbps, r.ucx_gbps).c_str());
  }
  std::printf(
      "\n(socket and inline-grpc rows are compared with ucx-tcp's raw RMA and with "
      "ucx_perftest over TCP; shm rows have no Mooncake figure (it ran over TCP); \"vs ucx\": a "
      "socket row over the UCX data plane's figure "
      "for the same case, --data-plane ucx; n/a: not measured, with --references=false or "
      "without a ucx-tcp run)\n");
  return 0;
}

}  // namespace kvtier::bench
