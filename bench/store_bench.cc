// kvtier-bench store: inline gRPC put/get throughput of a real kvtier-store
// for RAM hits and NVMe hits, beside redis-benchmark (SET/GET of the same
// value size against a redis-server started here) and fio (random reads of
// the same block size from a file in the same directory) and Mooncake Store
// (its zero-copy batch calls over TCP), with ratios.
#include <atomic>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "client/store_client.h"
#include "common/config.h"

namespace kvtier::bench {
namespace {

struct Options {
  int64_t blocks = 2000;
  uint64_t block_bytes = 256 << 10;
  int64_t clients = 4;
  int64_t batch = 16;
  bool quick = false;
  bool json = false;
  std::string store_bin;
  std::string work_dir;
};

struct Figure {
  double blocks_per_s = 0;
  double gb_per_s = 0;
};

struct Row {
  std::string name;
  Figure kvtier;
  std::string ref_name;
  Figure ref;
  std::string note;
};

BlockHash H(uint64_t i) { return BlockHash{i + 1, 0xB0B}; }

// Runs fn(first, count) over [0, total) in batches on `clients` threads.
template <typename Fn>
absl::StatusOr<double> Parallel(int clients, uint64_t total, uint64_t batch, Fn fn) {
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  absl::Status first_error;
  std::mutex mu;
  auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      for (;;) {
        uint64_t first = next.fetch_add(batch);
        if (first >= total || failed) return;
        absl::Status s = fn(first, std::min(batch, total - first));
        if (!s.ok()) {
          std::lock_guard lk(mu);
          if (!failed.exchange(true)) first_error = s;
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failed) return first_error;
  return Seconds(start);
}

Figure Rate(uint64_t blocks, uint64_t bytes, double seconds) {
  return Figure{blocks / seconds, blocks * static_cast<double>(bytes) / seconds / 1e9};
}

struct StorePhase {
  Figure put, get;
  uint64_t from_ram = 0, from_disk = 0;
};

// Puts `blocks` blocks, then reads them all back; RAM sized by ram_bytes.
absl::StatusOr<StorePhase> RunStore(const Options& o, const std::string& dir, uint64_t ram_bytes) {
  uint64_t data = o.blocks * o.block_bytes;
  uint64_t slab = std::max<uint64_t>(4 << 20, o.block_bytes);
  ram_bytes = std::max(ram_bytes, 4 * slab);
  auto store = LocalServer::Start(
      o.store_bin, dir,
      {"--data-dir=" + dir, absl::StrCat("--ram-bytes=", ram_bytes),
       absl::StrCat("--ram-slab-bytes=", slab), absl::StrCat("--disk-bytes=", 4 * data + (1 << 30)),
       "--ram-policy=lru", absl::StrCat("--demote-queue-bytes=", 2 * data)});
  if (!store.ok()) return store.status();
  StoreClient client((*store)->address());
  auto spec = SpecForBlockBytes(o.block_bytes, "kvtier-bench");
  if (!spec.ok()) return spec.status();
  auto ns = client.RegisterNamespace(*spec);
  if (!ns.ok()) return ns.status();

  // A pool of distinct blocks larger than the CPU caches, reused round-robin.
  std::vector<std::string> pool;
  for (uint64_t i = 0; i < std::min<uint64_t>(64, o.blocks); ++i) {
    pool.push_back(BlockContent(ns->id, H(i), o.block_bytes));
  }
  StorePhase r;
  auto put_s = Parallel(o.clients, o.blocks, o.batch, [&](uint64_t first, uint64_t n) {
    std::vector<std::pair<BlockHash, std::string_view>> blocks;
    for (uint64_t i = first; i < first + n; ++i) blocks.emplace_back(H(i), pool[i % pool.size()]);
    auto s = client.PutInline(ns->id, blocks);
    return s.ok() ? absl::OkStatus() : s.status();
  });
  if (!put_s.ok()) return put_s.status();
  r.put = Rate(o.blocks, o.block_bytes, *put_s);

  // Let the write-back queue drain so reads see a settled tier.
  for (int i = 0; i < 6000; ++i) {
    auto st = client.GetStats();
    if (st.ok() && st->demotion_queue_blocks() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::atomic<uint64_t> ram{0}, disk{0};
  auto get_s = Parallel(o.clients, o.blocks, o.batch, [&](uint64_t first, uint64_t n) {
    std::vector<BlockHash> hs;
    for (uint64_t i = first; i < first + n; ++i) hs.push_back(H(i));
    auto got = client.GetInline(ns->id, hs);
    if (!got.ok()) return got.status();
    if (got->size() != n) {
      return absl::DataLossError(
          absl::StrCat("blocks ", first, "..", first + n, ": only ", got->size(), " came back"));
    }
    for (const auto& b : *got) {
      if (b.data != pool[(first + b.index) % pool.size()]) {
        return absl::DataLossError(absl::StrCat("block ", first + b.index, " came back altered"));
      }
      (b.tier == v1::TIER_DISK ? disk : ram)++;
    }
    return absl::OkStatus();
  });
  if (!get_s.ok()) return get_s.status();
  r.get = Rate(o.blocks, o.block_bytes, *get_s);
  r.from_ram = ram;
  r.from_disk = disk;
  return r;
}

// redis-benchmark SET and GET rps with the same value size, clients and pipeline depth.
absl::StatusOr<std::pair<Figure, Figure>> RunRedis(const Options& o, const std::string& dir) {
  auto rps = RedisSetGetRps(dir, o.block_bytes, o.blocks, o.clients, o.batch);
  if (!rps.ok()) return rps.status();
  auto fig = [&](double r) { return Figure{r, r * o.block_bytes / 1e9}; };
  return std::make_pair(fig(rps->first), fig(rps->second));
}

// fio random reads of the same block size from a file of the same total size
// in the same directory, buffered like RocksDB's reads here.
absl::StatusOr<Figure> RunFio(const Options& o, const std::string& dir) {
  if (!HaveCommand("fio")) return absl::UnavailableError("fio not installed");
  uint64_t size = o.blocks * o.block_bytes;
  auto out = RunCapture(absl::StrCat("fio --name=kvtier --directory=", dir, " --rw=randread --bs=",
                                     o.block_bytes, " --size=", size, " --numjobs=", o.clients,
                                     " --ioengine=psync --direct=0 "
                                     "--group_reporting --output-format=json 2>/dev/null"));
  if (!out.ok()) return out.status();
  auto j = nlohmann::json::parse(*out, nullptr, false);
  if (j.is_discarded() || !j.contains("jobs"))
    return absl::InternalError("cannot parse fio output");
  double bw = j["jobs"][0]["read"]["bw_bytes"].get<double>();
  return Figure{bw / o.block_bytes, bw / 1e9};
}

}  // namespace

int RunStoreBench(int argc, const char* const* argv) {
  Options o;
  FlagSet flags("kvtier-bench store",
                "Inline gRPC put/get throughput of kvtier-store (RAM hits and NVMe hits) beside\n"
                "redis-benchmark, fio and Mooncake Store (TCP) with the same block size, in one\n"
                "run.");
  flags.Int("blocks", &o.blocks, 16, 1 << 24, "Blocks to put and get");
  flags.Bytes("block-bytes", &o.block_bytes, "Block (value) size, a multiple of 8KiB");
  flags.Int("clients", &o.clients, 1, 256, "Concurrent clients (redis-benchmark -c, fio jobs)");
  flags.Int("batch", &o.batch, 1, 1024, "Blocks per gRPC stream (redis-benchmark -P)");
  flags.Bool("quick", &o.quick, "A reduced run (500 blocks) for smoke tests");
  flags.Bool("json", &o.json, "Print JSON instead of a table");
  flags.String("store-bin", &o.store_bin, "kvtier-store binary [default: next to this one]");
  ParseFlagsOrExit(flags, argc, argv);
  if (o.quick) o.blocks = std::min<int64_t>(o.blocks, 500);
  if (o.store_bin.empty()) o.store_bin = DefaultBinary("cachestore", "kvtier-store");
  if (auto s = SpecForBlockBytes(o.block_bytes, "x"); !s.ok()) {
    std::fprintf(stderr, "kvtier-bench store: flag --block-bytes: %s\n",
                 std::string(s.status().message()).c_str());
    return 2;
  }
  TempDir dir;
  uint64_t data = o.blocks * o.block_bytes;
  auto ram = RunStore(o, dir.sub("ram"), data + data / 4);
  if (!ram.ok()) {
    std::fprintf(stderr, "kvtier-bench store: RAM phase: %s\n",
                 std::string(ram.status().message()).c_str());
    return 1;
  }
  auto disk = RunStore(o, dir.sub("nvme"), data / 10);
  if (!disk.ok()) {
    std::fprintf(stderr, "kvtier-bench store: NVMe phase: %s\n",
                 std::string(disk.status().message()).c_str());
    return 1;
  }
  auto redis = RunRedis(o, dir.path());
  auto fio = RunFio(o, dir.path());

  std::vector<Row> rows;
  std::string why_redis = redis.ok() ? "" : std::string(redis.status().message());
  std::string why_fio = fio.ok() ? "" : std::string(fio.status().message());
  rows.push_back(
      {"put (into RAM)", ram->put, "redis SET", redis.ok() ? redis->first : Figure{}, why_redis});
  rows.push_back(
      {"get, RAM hit", ram->get, "redis GET", redis.ok() ? redis->second : Figure{}, why_redis});
  rows.push_back(
      {"get, NVMe hit", disk->get, "fio randread", fio.ok() ? *fio : Figure{},
       absl::StrFormat("%d of %d blocks from NVMe%s%s", disk->from_disk,
                       disk->from_disk + disk->from_ram, why_fio.empty() ? "" : "; ", why_fio)});
  rows.push_back(
      {"get, NVMe hit", disk->get, "redis GET", redis.ok() ? redis->second : Figure{}, why_redis});
  // Mooncake Store over TCP, same blocks, clients and batch; its SSD tier is
  // not configured here, so it has no disk-hit figure.
  auto moon = MooncakeStoreGbps(o.block_bytes, o.blocks, o.batch, o.clients);
  std::string why_moon = moon.ok() ? "" : std::string(moon.status().message());
  auto moon_fig = [&](bool put) {
    if (!moon.ok()) return Figure{};
    const double gbps = put ? moon->put_gbps : moon->get_gbps;
    return Figure{gbps * 1e9 / o.block_bytes, gbps};
  };
  rows.push_back({"put (into RAM)", ram->put, "mooncake put", moon_fig(true), why_moon});
  rows.push_back({"get, RAM hit", ram->get, "mooncake get", moon_fig(false), why_moon});

  if (o.json) {
    nlohmann::json j;
    j["blocks"] = o.blocks;
    j["block_bytes"] = o.block_bytes;
    j["clients"] = o.clients;
    j["batch"] = o.batch;
    for (const auto& r : rows) {
      nlohmann::json c;
      c["case"] = r.name;
      c["blocks_per_s"] = r.kvtier.blocks_per_s;
      c["gb_per_s"] = r.kvtier.gb_per_s;
      c["reference"] = r.ref_name;
      c["reference_gb_per_s"] = r.ref.gb_per_s;
      c["ratio"] = r.ref.gb_per_s > 0 ? r.kvtier.gb_per_s / r.ref.gb_per_s : 0;
      if (!r.note.empty()) c["note"] = r.note;
      j["cases"].push_back(c);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("kvtier-bench store: %ld blocks of %s, %ld clients, %ld blocks per stream\n\n",
              o.blocks, FormatBytes(o.block_bytes).c_str(), o.clients, o.batch);
  std::printf("%-16s %12s %8s   %-14s %12s %8s   %6s  %s\n", "case", "kvtier blk/s", "GB/s",
              "reference", "ref blk/s", "GB/s", "ratio", "note");
  for (const auto& r : rows) {
    std::string ratio =
        r.ref.gb_per_s > 0 ? absl::StrFormat("%.2f", r.kvtier.gb_per_s / r.ref.gb_per_s) : "n/a";
    std::printf("%-16s %12.0f %8.2f   %-14s %12.0f %8.2f   %6s  %s\n", r.name.c_str(),
                r.kvtier.blocks_per_s, r.kvtier.gb_per_s, r.ref_name.c_str(), r.ref.blocks_per_s,
                r.ref.gb_per_s, ratio.c_str(), r.note.c_str());
  }
  return 0;
}

}  // namespace kvtier::bench
