// kvtier-bench dataplane: put and get throughput of kvtier's data plane
// (BeginPut/BeginGet + UCX RMA + Commit/End) over UCX TCP and shared memory,
// and of the inline gRPC path, for several block sizes and batch sizes; each
// beside ucx_perftest on the same transport and size (started here) and
// redis-benchmark against a redis-server started here (same value size,
// pipeline depth = batch), with ratios. Buffers are larger than the CPU
// caches (--working-set).
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/config.h"
#include "common/log.h"
#include "client/store_data_client.h"

namespace kvtier::bench {
namespace {

struct Row {
  std::string path;  // "ucx-tcp", "ucx-shm", "inline-grpc"
  uint64_t block_bytes;
  int64_t batch;
  std::string op;  // "put" / "get"
  double gbps = 0, blocks_per_s = 0;
  double perftest_gbps = 0, redis_gbps = 0, memcpy_gbps = 0;
  std::string note;
};

struct Transport {
  std::string name;     // row label
  std::string ucx_tls;  // for kvtier (needs a sockaddr-capable transport too)
  std::string perf_tls; // for ucx_perftest
};

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
  FlagSet flags("kvtier-bench dataplane",
                "Put/get throughput of kvtier's UCX data plane (TCP and shared memory) and inline\n"
                "gRPC path beside ucx_perftest and redis-benchmark, in one run.");
  flags.String("sizes", &sizes_flag, "Block sizes, comma-separated");
  flags.String("batches", &batches_flag, "Blocks per operation, comma-separated");
  flags.String("transports", &transports_flag, "UCX transports: tcp, shm");
  flags.Bytes("working-set", &working_set, "Bytes moved per case (larger than the CPU caches)");
  flags.Bool("inline", &inline_path, "Also measure the inline gRPC path");
  flags.Bool("references", &references, "Run ucx_perftest and redis-benchmark beside");
  flags.Bool("quick", &quick, "A reduced set (256KiB and 1MiB, 48 MiB per case) in under a minute");
  flags.Bool("json", &json, "Print JSON");
  flags.String("store-bin", &store_bin, "kvtier-store binary [default: next to this one]");
  flags.Bool("verify-commits", &verify_commits, "Run the store with --verify-commits");
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
  for (absl::string_view t : absl::StrSplit(transports_flag, ',', absl::SkipEmpty())) {
    if (t == "tcp") transports.push_back({"ucx-tcp", "tcp", "tcp"});
    else if (t == "shm") transports.push_back({"ucx-shm", "sm", "sm"});
    else {
      std::fprintf(stderr, "kvtier-bench dataplane: flag --transports: \"%s\" is not tcp or shm\n",
                   std::string(t).c_str());
      return 2;
    }
  }
  TempDir dir;
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  // The working set twice (put then get of fresh keys per batch size) plus slack.
  const uint64_t ram = 2 * working_set + 64 * max_size;

  // References per size (independent of our transport loop for redis).
  std::map<std::pair<uint64_t, int64_t>, std::pair<double, double>> redis;  // (size,batch) -> (set,get) GB/s
  std::map<std::tuple<std::string, uint64_t, std::string>, double> perf;    // (tls,size,test) -> GB/s
  std::vector<Row> rows;
  uint64_t salt = 1;

  auto measure = [&](const std::string& path, const std::string& tls) -> int {
    setenv("UCX_TLS", tls.c_str(), 1);
    auto store = LocalServer::Start(
        store_bin, dir.sub("store-" + path),
        {"--data-dir=" + dir.sub("store-" + path), absl::StrCat("--ram-bytes=", ram), absl::StrCat("--ram-slab-bytes=", std::max<uint64_t>(4 << 20, max_size)),
         "--ucx-listen=127.0.0.1:0", "--hugepages=false", "--ram-policy=lru",
         absl::StrCat("--verify-commits=", verify_commits ? "true" : "false"),
         absl::StrCat("--max-message-bytes=", std::max<uint64_t>(64 << 20, 40 * max_size))});
    if (!store.ok()) {
      std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(store.status().message()).c_str());
      return 1;
    }
    DataClientOptions o;
    o.max_inflight_bytes = 256ull << 20;
    o.deadline_ms = 60000;
    o.shared_memory = path == "ucx-shm" ? DataClientOptions::SharedMemory::kOn
                                        : DataClientOptions::SharedMemory::kOff;
    StoreDataClient client((*store)->address(), o);
    StoreClientOptions so;
    so.max_message_bytes = static_cast<int>(std::max<uint64_t>(64 << 20, 40 * max_size));
    so.deadline_ms = 60000;
    StoreClient inline_client((*store)->address(), so);
    bool is_inline = path == "inline-grpc";
    for (uint64_t size : sizes) {
      auto spec = SpecForBlockBytes(size, "kvtier-bench-dataplane");
      if (!spec.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(spec.status().message()).c_str());
        return 2;
      }
      auto ns = client.control().RegisterNamespace(*spec);
      if (!ns.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(ns.status().message()).c_str());
        return 1;
      }
      const uint64_t blocks = std::max<uint64_t>(32, working_set / size);
      std::vector<uint8_t> src(blocks * size), dst(blocks * size);
      for (uint64_t i = 0; i < blocks; ++i) FillBlock(ns->id, BlockHash{i, 0}, src.data() + i * size, size);
      if (!is_inline) {
        if (auto s = client.RegisterMemory(src.data(), src.size()); !s.ok()) return 1;
        if (auto s = client.RegisterMemory(dst.data(), dst.size()); !s.ok()) return 1;
      }
      for (int64_t batch : batches) {
        const uint64_t round = salt++;
        auto hash = [&](uint64_t i) { return BlockHash{round, i}; };
        absl::StatusOr<double> put_s, get_s;
        if (is_inline) {
          put_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
            std::vector<std::pair<BlockHash, std::string_view>> b;
            for (uint64_t i = first; i < first + n; ++i) {
              b.emplace_back(hash(i), std::string_view(reinterpret_cast<char*>(src.data() + i * size), size));
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
            p.set_value(!r.ok() ? r.status()
                                : r->size() == n ? absl::OkStatus()
                                                 : absl::DataLossError("short inline read"));
            return p.get_future();
          });
        } else {
          put_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
            std::vector<PutBlock> b;
            for (uint64_t i = first; i < first + n; ++i) b.push_back({hash(i), src.data() + i * size});
            auto f = client.Put(ns->id, size, std::move(b));
            return std::async(std::launch::deferred, [f = std::move(f), n]() mutable {
              auto r = f.get();
              if (!r.ok()) return r.status();
              return r->written == n ? absl::OkStatus()
                                     : absl::ResourceExhaustedError("store did not take every block");
            });
          });
          get_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
            std::vector<GetBlock> b;
            for (uint64_t i = first; i < first + n; ++i) b.push_back({hash(i), dst.data() + i * size});
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
                         FormatBytes(size).c_str(), batch, std::string(r->status().message()).c_str());
            return 1;
          }
        }
        for (int k = 0; k < 2; ++k) {
          Row row;
          row.path = path;
          row.block_bytes = size;
          row.batch = batch;
          row.op = k == 0 ? "put" : "get";
          double secs = k == 0 ? *put_s : *get_s;
          row.gbps = blocks * static_cast<double>(size) / secs / 1e9;
          row.blocks_per_s = blocks / secs;
          rows.push_back(row);
        }
        v1::EvictRequest all;
        all.set_all(true);
        (void)client.control().Evict(all);
      }
    }
    return 0;
  };

  for (const auto& t : transports) {
    if (int rc = measure(t.name, t.ucx_tls); rc != 0) return rc;
  }
  if (inline_path) {
    if (int rc = measure("inline-grpc", "tcp"); rc != 0) return rc;
  }
  // memcpy of the same working set in this process: the DRAM ceiling for a
  // transfer that must move every byte once (shared memory, at least).
  std::map<uint64_t, double> memcpy_gbps;
  for (uint64_t size : sizes) {
    const uint64_t blocks = std::max<uint64_t>(32, working_set / size);
    std::vector<uint8_t> a(blocks * size, 1), b(blocks * size, 2);
    std::memcpy(b.data(), a.data(), a.size());  // warm both
    auto t = Clock::now();
    for (int rep = 0; rep < 3; ++rep) std::memcpy(b.data(), a.data(), a.size());
    memcpy_gbps[size] = 3.0 * a.size() / Seconds(t) / 1e9;
  }
  if (references) {
    for (uint64_t size : sizes) {
      const int64_t blocks = static_cast<int64_t>(std::max<uint64_t>(32, working_set / size));
      for (int64_t batch : batches) {
        auto r = RedisSetGetRps(dir.path(), size, blocks, 1, batch);
        if (r.ok()) redis[{size, batch}] = {r->first * size / 1e9, r->second * size / 1e9};
      }
      for (const auto& t : transports) {
        for (const char* test : {"ucp_put_bw", "ucp_get"}) {
          auto bw = UcxPerftestBytesPerSec(t.perf_tls, test, size, blocks);
          if (bw.ok()) perf[{t.name, size, test}] = *bw / 1e9;
        }
      }
    }
  }
  for (auto& r : rows) {
    auto rd = redis.find({r.block_bytes, r.batch});
    if (rd != redis.end()) r.redis_gbps = r.op == "put" ? rd->second.first : rd->second.second;
    std::string path = r.path == "inline-grpc" ? "ucx-tcp" : r.path;
    auto pf = perf.find({path, r.block_bytes, r.op == "put" ? "ucp_put_bw" : "ucp_get"});
    if (pf != perf.end()) r.perftest_gbps = pf->second;
    r.memcpy_gbps = memcpy_gbps[r.block_bytes];
  }

  if (json) {
    nlohmann::json j;
    for (const auto& r : rows) {
      nlohmann::json c = {{"path", r.path},       {"block_bytes", r.block_bytes},
                          {"batch", r.batch},     {"op", r.op},
                          {"gb_per_s", r.gbps},   {"blocks_per_s", r.blocks_per_s}};
      if (r.perftest_gbps > 0) {
        c["perftest_gb_per_s"] = r.perftest_gbps;
        c["ratio_vs_perftest"] = r.gbps / r.perftest_gbps;
      }
      if (r.redis_gbps > 0) {
        c["redis_gb_per_s"] = r.redis_gbps;
        c["ratio_vs_redis"] = r.gbps / r.redis_gbps;
      }
      c["memcpy_gb_per_s"] = r.memcpy_gbps;
      c["ratio_vs_memcpy"] = r.gbps / r.memcpy_gbps;
      j["cases"].push_back(c);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("kvtier-bench dataplane: %s per case; ucx_perftest on the same transport and size;\n"
              "redis-benchmark with the same value size and pipeline depth = batch\n\n",
              FormatBytes(working_set).c_str());
  std::printf("%-12s %9s %6s %4s | %8s %10s | %12s %6s | %9s %6s | %10s %6s\n", "path", "block",
              "batch", "op", "GB/s", "blocks/s", "perftest GB/s", "ratio", "redis GB/s", "ratio",
              "memcpy GB/s", "ratio");
  for (const auto& r : rows) {
    auto ratio = [](double a, double b) { return b > 0 ? absl::StrFormat("%.2f", a / b) : std::string("n/a"); };
    std::printf("%-12s %9s %6ld %4s | %8.2f %10.0f | %12.2f %6s | %9.2f %6s | %10.2f %6s\n",
                r.path.c_str(), FormatBytes(r.block_bytes).c_str(), r.batch, r.op.c_str(), r.gbps,
                r.blocks_per_s, r.perftest_gbps, ratio(r.gbps, r.perftest_gbps).c_str(),
                r.redis_gbps, ratio(r.gbps, r.redis_gbps).c_str(), r.memcpy_gbps,
                ratio(r.gbps, r.memcpy_gbps).c_str());
  }
  std::printf("\n(inline-grpc rows are compared with ucx_perftest over TCP)\n");
  return 0;
}

}  // namespace kvtier::bench
