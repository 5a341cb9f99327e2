// kvtier-bench trace: replays a Mooncake trace against one kvtier-store used
// as a cache shared by all engines. For each request: Lookup the hash chain,
// read the present prefix (every byte checked against the block's known
// contents), write the rest. Prints where the prompt blocks came from beside
// the infinite-cache bound and a shared LRU of the same capacity, both
// computed from the trace.
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/trace.h"
#include "client/store_client.h"
#include "common/config.h"

namespace kvtier::bench {
namespace {

struct Options {
  std::string trace = KVTIER_SOURCE_DIR "/bench/traces/conversation_trace.jsonl";
  int64_t limit = 2000;
  uint64_t block_bytes = 64 << 10;
  uint64_t ram_bytes = 256ull << 20;
  uint64_t disk_bytes = 2ull << 30;
  std::string store;
  std::string store_bin;
  bool json = false;
  bool progress = true;
};

void Progress(size_t done, size_t total) {
  int width = 40;
  int filled = static_cast<int>(width * done / std::max<size_t>(total, 1));
  std::fprintf(stderr, "\r  replay [%s%s] %zu/%zu", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
}

}  // namespace

int RunTraceStore(int argc, const char* const* argv) {
  Options o;
  FlagSet flags("kvtier-bench trace",
                "Replays a Mooncake-format trace against a kvtier-store (started here unless\n"
                "--store is given) as one shared KV cache, verifying every byte read back.");
  flags.String("trace", &o.trace, "Trace file (Mooncake JSONL format)");
  flags.Int("limit", &o.limit, 0, 1 << 30, "Replay only the first N requests (0: all)");
  flags.Bytes("block-bytes", &o.block_bytes, "KV bytes per 512-token block (scaled to fit)");
  flags.Bytes("ram-bytes", &o.ram_bytes, "RAM tier of the store started here");
  flags.Bytes("disk-bytes", &o.disk_bytes, "NVMe tier quota of the store started here");
  flags.HostPort("store", &o.store, "Use this running kvtier-store instead of starting one");
  flags.String("store-bin", &o.store_bin, "kvtier-store binary [default: next to this one]");
  flags.Bool("json", &o.json, "Print JSON instead of a table");
  flags.Bool("progress", &o.progress, "Draw a progress bar on stderr");
  ParseFlagsOrExit(flags, argc, argv);
  if (o.store_bin.empty()) o.store_bin = DefaultBinary("cachestore", "kvtier-store");

  auto trace = ReadTrace(o.trace, static_cast<size_t>(o.limit));
  if (!trace.ok()) {
    std::fprintf(stderr, "kvtier-bench trace: %s\n", std::string(trace.status().message()).c_str());
    return 1;
  }
  // 512-token blocks of fp16, 1 layer, 1 KV head: head_dim sets the bytes.
  NamespaceSpec spec{"mooncake-trace",
                     "fp16",
                     1,
                     1,
                     static_cast<uint32_t>(o.block_bytes / 2048),
                     kTraceBlockTokens,
                     0,
                     1,
                     "",
                     "",
                     ""};
  if (o.block_bytes % 2048 != 0 || !ValidateNamespace(spec).ok()) {
    std::fprintf(stderr,
                 "kvtier-bench trace: flag --block-bytes: %s is not a multiple of 2KiB between "
                 "2KiB and 8MiB\n",
                 FormatBytes(o.block_bytes).c_str());
    return 2;
  }

  TempDir dir;
  std::unique_ptr<LocalServer> local;
  std::string address = o.store;
  if (address.empty()) {
    auto s = LocalServer::Start(
        o.store_bin, dir.sub("store"),
        {"--data-dir=" + dir.sub("store"), absl::StrCat("--ram-bytes=", o.ram_bytes),
         absl::StrCat("--disk-bytes=", o.disk_bytes),
         absl::StrCat("--ram-slab-bytes=", std::max<uint64_t>(4 << 20, o.block_bytes)),
         "--hugepages=false"});
    if (!s.ok()) {
      std::fprintf(stderr, "kvtier-bench trace: %s\n", std::string(s.status().message()).c_str());
      return 1;
    }
    local = std::move(*s);
    address = local->address();
  }
  StoreClient client(address);
  auto ns = client.RegisterNamespace(spec);
  if (!ns.ok()) {
    std::fprintf(stderr, "kvtier-bench trace: store %s: %s\n", address.c_str(),
                 std::string(ns.status().message()).c_str());
    return 1;
  }

  uint64_t blocks = 0, from_ram = 0, from_disk = 0, verified = 0, mismatched = 0, written = 0;
  uint64_t bytes_moved = 0;
  auto start = Clock::now();
  for (size_t r = 0; r < trace->size(); ++r) {
    const auto& req = (*trace)[r];
    std::vector<BlockHash> chain;
    for (uint64_t id : req.hash_ids) chain.push_back(TraceHash(ns->id, id));
    blocks += chain.size();
    auto tiers = client.Lookup(ns->id, chain);
    if (!tiers.ok()) {
      std::fprintf(stderr, "\nkvtier-bench trace: Lookup: %s\n",
                   std::string(tiers.status().message()).c_str());
      return 1;
    }
    size_t have = tiers->size();
    if (have > 0) {
      std::vector<BlockHash> prefix(chain.begin(), chain.begin() + have);
      auto got = client.GetInline(ns->id, prefix);
      if (!got.ok()) {
        std::fprintf(stderr, "\nkvtier-bench trace: GetBlocks: %s\n",
                     std::string(got.status().message()).c_str());
        return 1;
      }
      // The store may have evicted a block between Lookup and Get: the
      // prefix actually read is what counts.
      have = got->size();
      for (const auto& b : *got) {
        ++verified;
        bytes_moved += b.data.size();
        if (b.data != BlockContent(ns->id, chain[b.index], o.block_bytes)) ++mismatched;
        (b.tier == v1::TIER_DISK ? from_disk : from_ram)++;
      }
    }
    if (have < chain.size()) {
      std::vector<std::string> data;
      std::vector<std::pair<BlockHash, std::string_view>> put;
      data.reserve(chain.size() - have);
      for (size_t i = have; i < chain.size(); ++i) {
        data.push_back(BlockContent(ns->id, chain[i], o.block_bytes));
        put.emplace_back(chain[i], data.back());
      }
      auto p = client.PutInline(ns->id, put);
      if (!p.ok()) {
        std::fprintf(stderr, "\nkvtier-bench trace: PutBlocks: %s\n",
                     std::string(p.status().message()).c_str());
        return 1;
      }
      written += p->stored;
      bytes_moved += data.size() * o.block_bytes;
    }
    if (o.progress && isatty(2) && (r % 50 == 0 || r + 1 == trace->size()))
      Progress(r + 1, trace->size());
  }
  double secs = Seconds(start);
  auto stats = client.GetStats();
  uint64_t capacity_blocks = (o.ram_bytes + o.disk_bytes) / (o.block_bytes + 32);
  PrefixCacheFigures oracle = SharedPrefixCache(*trace, 0);
  PrefixCacheFigures lru = SharedPrefixCache(*trace, capacity_blocks);
  double hit = blocks ? double(from_ram + from_disk) / blocks : 0;

  if (o.json) {
    nlohmann::json j;
    j["requests"] = trace->size();
    j["prompt_blocks"] = blocks;
    j["hit_ram_blocks"] = from_ram;
    j["hit_disk_blocks"] = from_disk;
    j["computed_blocks"] = blocks - from_ram - from_disk;
    j["store_hit_ratio"] = hit;
    j["infinite_cache_hit_ratio"] = oracle.block_hit_ratio();
    j["shared_lru_hit_ratio"] = lru.block_hit_ratio();
    j["shared_lru_blocks"] = capacity_blocks;
    j["verified_blocks"] = verified;
    j["mismatched_blocks"] = mismatched;
    j["bytes_moved"] = bytes_moved;
    j["seconds"] = secs;
    std::printf("%s\n", j.dump(2).c_str());
    return mismatched == 0 ? 0 : 1;
  }
  std::printf(
      "\nkvtier trace replay: %zu requests, %lu prompt blocks of 512 tokens, %s of KV per block\n",
      trace->size(), blocks, FormatBytes(o.block_bytes).c_str());
  std::printf("store %s: RAM %s, NVMe %s\n\n", address.c_str(), FormatBytes(o.ram_bytes).c_str(),
              FormatBytes(o.disk_bytes).c_str());
  std::printf("  %-34s %10s %8s\n", "prompt blocks", "blocks", "share");
  auto line = [&](const char* what, uint64_t n) {
    std::printf("  %-34s %10lu %7.2f%%\n", what, n, blocks ? 100.0 * n / blocks : 0);
  };
  line("hit in store RAM", from_ram);
  line("hit in store NVMe", from_disk);
  line("computed (not cached)", blocks - from_ram - from_disk);
  std::printf("\n  %-34s %7.2f%%\n", "kvtier store hit ratio", 100 * hit);
  std::printf("  %-34s %7.2f%%   (upper bound, from the trace)\n", "infinite shared cache",
              100 * oracle.block_hit_ratio());
  std::printf("  %-34s %7.2f%%   (same capacity, from the trace)\n",
              absl::StrFormat("shared LRU of %lu blocks", capacity_blocks).c_str(),
              100 * lru.block_hit_ratio());
  std::printf("\n  blocks read back and verified: %lu, mismatched: %lu\n", verified, mismatched);
  std::printf("  blocks written: %lu; data moved: %s in %.1f s (%.2f GB/s over inline gRPC)\n",
              written, FormatBytes(bytes_moved).c_str(), secs, bytes_moved / secs / 1e9);
  if (stats.ok()) {
    std::printf("  store: RAM %lu blocks, NVMe %lu blocks, %lu demotions, %lu promotions\n",
                stats->tiers(0).items(), stats->tiers(1).items(), stats->tiers(0).demotions(),
                stats->tiers(0).promotions());
  }
  return mismatched == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
