// kvtier-bench crash: kill the store with SIGKILL at random moments under
// mixed put / get / evict load with demotions to NVMe running, restart it
// on the same data, and check it against an expected-state oracle, in the
// style of RocksDB's db_crashtest.py (docs/reliability.md, "Crash test").
//
// The oracle: a block the store reported on NVMe (Lookup answered
// TIER_DISK) is acknowledged; it must come back byte-exact after every
// restart unless this driver asked to evict it since (an eviction in
// flight at a kill leaves the block in doubt: absent or exact, both fine).
// Every block any get serves must be byte-exact (each block's bytes are a
// function of its hash). After each restart the blocks acknowledged in the
// last cycle and a random sample of the older ones are read back one by
// one; at the end, all of them.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "client/store_client.h"
#include "common/block_key.h"
#include "common/config.h"
#include "common/log.h"
#include "testing/process.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kChain = 8;  // blocks per put

BlockHash KeyOf(uint64_t n) { return BlockHash{n * 0x9E3779B97F4A7C15ull + 17, n}; }

// Block n's bytes: a function of n alone.
std::string BytesOf(uint64_t n, size_t size) {
  std::string s(size, '\0');
  std::mt19937_64 rng(n * 0x2545F4914F6CDD1Dull + 3);
  for (size_t i = 0; i + 8 <= size; i += 8) {
    const uint64_t v = rng();
    std::memcpy(s.data() + i, &v, 8);
  }
  return s;
}

struct Oracle {
  std::mutex mu;
  std::set<uint64_t> acked;     // reported on NVMe, not evicted since
  std::set<uint64_t> doubtful;  // an eviction was asked for: absent or exact
  std::vector<uint64_t> acked_this_cycle;
};

struct Figures {
  uint64_t kills = 0, puts = 0, put_blocks = 0, gets = 0, served_blocks = 0, evicts = 0;
  uint64_t acked = 0, checked = 0, lost = 0, wrong = 0, failed_calls = 0;
  uint64_t checked_acked = 0;  // checks of blocks acknowledged on NVMe (not doubtful)
  double load_seconds = 0;     // under load, restarts and checks aside
  std::vector<double> restart_ms, check_ms;
  std::vector<std::string> problems;  // the first few, for the report
};

class Driver {
 public:
  Driver(std::string dir, uint64_t seed, size_t block_bytes, std::string disk_sync)
      : dir_(std::move(dir)),
        rng_(seed),
        block_bytes_(block_bytes),
        disk_sync_(std::move(disk_sync)) {}

  // Starts the store, or (once started) restarts it on the same data and port.
  absl::Status Start() {
    const auto t = Clock::now();
    if (store_) {
      if (auto s = store_->Restart(); !s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat(s.message(), "; its log ends:\n", store_->LogTail()));
      }
      figures_.restart_ms.push_back(
          std::chrono::duration<double, std::milli>(Clock::now() - t).count());
      // A fresh channel: the old one backs off after the refused connects.
      client_ = std::make_unique<StoreClient>(store_->address(), Options());
    } else {
      auto s =
          LocalServer::Start(DefaultBinary("cachestore", "kvtier-store"), dir_ + "/store",
                             {"--data-dir=" + dir_ + "/db", "--ram-bytes=1MiB",
                              "--ram-slab-bytes=64KiB", "--disk-bytes=2GiB", "--hugepages=false",
                              "--demote-queue-bytes=4MiB", "--disk-sync=" + disk_sync_});
      if (!s.ok()) return s.status();
      store_ = std::move(*s);
      client_ = std::make_unique<StoreClient>(store_->address(), Options());
    }
    auto ns = client_->RegisterNamespace(Spec());
    if (!ns.ok()) return ns.status();
    ns_ = ns->id;
    return absl::OkStatus();
  }

  static NamespaceSpec Spec() {
    return NamespaceSpec{"crash", "fp16", 1, 1, 64, 16, 0, 1, "", "", ""};
  }
  static StoreClientOptions Options() {
    StoreClientOptions o;
    o.deadline_ms = 2000;
    return o;
  }

  // Reads each of `blocks` alone: an acknowledged one must be there and
  // exact, a doubtful one absent or exact.
  void Check(const std::vector<uint64_t>& blocks) {
    const auto t = Clock::now();
    for (uint64_t n : blocks) {
      bool doubtful;
      {
        std::lock_guard lk(oracle_.mu);
        if (oracle_.acked.count(n) == 0 && oracle_.doubtful.count(n) == 0) continue;
        doubtful = oracle_.doubtful.count(n) > 0;
      }
      auto got = client_->GetInline(ns_, {KeyOf(n)});
      figures_.checked++;
      if (!doubtful) figures_.checked_acked++;
      if (!got.ok()) {
        Problem(absl::StrCat("block ", n, ": get failed after restart: ", got.status().message()));
        figures_.lost += doubtful ? 0 : 1;
        continue;
      }
      if (got->empty()) {
        if (!doubtful) {
          figures_.lost++;
          Problem(absl::StrCat("block ", n, " was acknowledged on NVMe and is gone"));
        }
        continue;
      }
      if ((*got)[0].data != BytesOf(n, block_bytes_)) {
        figures_.wrong++;
        Problem(absl::StrCat("block ", n, " came back with other bytes"));
      }
    }
    figures_.check_ms.push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - t).count());
  }

  // After a restart: last cycle's acknowledgements and a sample of the rest.
  void CheckAfterRestart(size_t sample) {
    std::vector<uint64_t> blocks;
    {
      std::lock_guard lk(oracle_.mu);
      blocks = oracle_.acked_this_cycle;
      oracle_.acked_this_cycle.clear();
      std::vector<uint64_t> older(oracle_.acked.begin(), oracle_.acked.end());
      std::shuffle(older.begin(), older.end(), rng_);
      older.resize(std::min(older.size(), sample));
      blocks.insert(blocks.end(), older.begin(), older.end());
      blocks.insert(blocks.end(), oracle_.doubtful.begin(), oracle_.doubtful.end());
    }
    Check(blocks);
  }

  void CheckAll() {
    std::vector<uint64_t> blocks;
    {
      std::lock_guard lk(oracle_.mu);
      blocks.assign(oracle_.acked.begin(), oracle_.acked.end());
    }
    Check(blocks);
  }

  // Mixed load until stop: puts of new chains, gets of known blocks (every
  // served byte checked), evictions of acknowledged blocks, and Lookups
  // that acknowledge what reached NVMe.
  void Load(std::atomic<bool>* stop, uint64_t thread_seed) {
    std::mt19937_64 rng(thread_seed);
    while (!*stop) {
      const int op = static_cast<int>(rng() % 10);
      if (op < 5) {  // put a new chain
        const uint64_t first = next_.fetch_add(kChain);
        std::vector<std::string> data;
        std::vector<std::pair<BlockHash, std::string_view>> blocks;
        data.reserve(kChain);
        for (uint32_t i = 0; i < kChain; ++i) data.push_back(BytesOf(first + i, block_bytes_));
        for (uint32_t i = 0; i < kChain; ++i) blocks.emplace_back(KeyOf(first + i), data[i]);
        auto r = client_->PutInline(ns_, blocks);
        Count(&Figures::puts, r.ok());
        if (r.ok()) {
          std::lock_guard lk(mu_);
          figures_.put_blocks += r->stored;
          put_chains_.push_back(first);
        }
      } else if (op < 8) {  // look up a put chain: acknowledge its NVMe blocks; get some
        uint64_t first;
        {
          std::lock_guard lk(mu_);
          if (put_chains_.empty()) continue;
          first = put_chains_[rng() % put_chains_.size()];
        }
        std::vector<BlockHash> chain;
        for (uint32_t i = 0; i < kChain; ++i) chain.push_back(KeyOf(first + i));
        // Acknowledge only what is on NVMe before an eviction of it can start.
        std::vector<uint64_t> in_doubt;
        {
          std::lock_guard lk(oracle_.mu);
          for (uint32_t i = 0; i < kChain; ++i) {
            if (oracle_.doubtful.count(first + i)) in_doubt.push_back(first + i);
          }
        }
        auto tiers = client_->Lookup(ns_, chain);
        if (tiers.ok()) {
          std::lock_guard lk(oracle_.mu);
          for (size_t i = 0; i < tiers->size(); ++i) {
            const uint64_t n = first + i;
            if ((*tiers)[i] == v1::TIER_DISK && !oracle_.doubtful.count(n) &&
                oracle_.acked.insert(n).second) {
              oracle_.acked_this_cycle.push_back(n);
            }
          }
        }
        auto got = client_->GetInline(ns_, chain);
        Count(&Figures::gets, got.ok());
        if (got.ok()) {
          std::lock_guard lk(mu_);
          for (const auto& b : *got) {
            figures_.served_blocks++;
            if (b.data != BytesOf(first + b.index, block_bytes_)) {
              figures_.wrong++;
              Problem(absl::StrCat("block ", first + b.index, " served with other bytes"));
            }
          }
        }
      } else if (op == 8) {  // evict an acknowledged block
        uint64_t n;
        {
          std::lock_guard lk(oracle_.mu);
          if (oracle_.acked.empty()) continue;
          auto it = oracle_.acked.begin();
          std::advance(it, rng() % std::min<size_t>(oracle_.acked.size(), 64));
          n = *it;
          oracle_.acked.erase(it);
          oracle_.doubtful.insert(n);  // from now on: absent or exact
        }
        v1::EvictRequest req;
        auto* k = req.mutable_keys()->add_keys();
        k->set_namespace_id(ns_);
        k->mutable_hash()->set_hi(KeyOf(n).hi);
        k->mutable_hash()->set_lo(KeyOf(n).lo);
        Count(&Figures::evicts, client_->Evict(req).ok());
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  // One cycle: load for a random time, SIGKILL mid-load, restart, check.
  // wipe: remove the data dir before the restart (to show the oracle
  // catches a loss).
  absl::Status Cycle(size_t sample, bool wipe = false) {
    std::atomic<bool> stop{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) threads.emplace_back([this, &stop, t] { Load(&stop, rng_() + t); });
    std::uniform_int_distribution<int> ms(30, 400);
    const auto loaded = Clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(ms(rng_)));
    store_->Kill9();
    figures_.load_seconds += std::chrono::duration<double>(Clock::now() - loaded).count();
    figures_.kills++;
    stop = true;
    for (auto& t : threads) t.join();
    if (wipe) RunShell("rm -rf '" + dir_ + "/db'");
    if (auto s = Start(); !s.ok()) return s;
    CheckAfterRestart(sample);
    return absl::OkStatus();
  }

  Figures& figures() { return figures_; }
  size_t acked() {
    std::lock_guard lk(oracle_.mu);
    return oracle_.acked.size();
  }
  void Stop() { store_.reset(); }

 private:
  void Count(uint64_t Figures::*what, bool ok) {
    std::lock_guard lk(mu_);
    figures_.*what += 1;
    figures_.failed_calls += ok ? 0 : 1;
  }
  void Problem(std::string p) {
    if (figures_.problems.size() < 10) figures_.problems.push_back(std::move(p));
  }

  std::string dir_;
  std::mt19937_64 rng_;
  size_t block_bytes_;
  std::string disk_sync_;  // the store's --disk-sync
  std::unique_ptr<LocalServer> store_;
  std::unique_ptr<StoreClient> client_;
  uint64_t ns_ = 0;
  Oracle oracle_;
  std::mutex mu_;
  Figures figures_;
  std::vector<uint64_t> put_chains_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace

int RunCrash(int argc, const char* const* argv) {
  int64_t kills = 100, sample = 200, seed = 1, wipe_at = 0, min_acked = 0;
  bool json = false;
  std::string disk_sync = "none";
  FlagSet flags("kvtier-bench crash",
                "Kills kvtier-store with SIGKILL at random moments under mixed put/get/evict\n"
                "load with demotions to NVMe, restarts it on the same data, and checks an\n"
                "expected-state oracle after every restart: each block the store reported on\n"
                "NVMe comes back byte-exact (unless evicted since), and every block served is\n"
                "exact. Exit 1 if anything was lost or wrong.");
  flags.Int("kills", &kills, 1, 1000000, "SIGKILLs (and restarts)");
  flags.Int("min-acknowledged", &min_acked, 0, int64_t{1} << 40,
            "Keeps killing past --kills (up to 12x as many) until this many reads after "
            "restarts were of blocks the store had reported on NVMe, so a slow host still "
            "gives the checks something to hold the store to");
  flags.Int("sample", &sample, 0, 1 << 20,
            "Older acknowledged blocks read back after each restart");
  flags.Int("seed", &seed, 0, int64_t{1} << 62, "Random seed (kill moments, operations)");
  flags.Int("wipe-at", &wipe_at, 0, 1000000,
            "Checks the checker: delete the store's data before restart N (0: never); the run "
            "must then report lost blocks");
  flags.Choice("disk-sync", &disk_sync, {"none", "commit", "group"},
               "The store's --disk-sync: when its NVMe writes are fsynced");
  flags.Bool("json", &json, "Print JSON");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  TempDir dir;
  const size_t block_bytes = BlockBytes(Driver::Spec());
  Driver d(dir.path(), static_cast<uint64_t>(seed), block_bytes, disk_sync);
  if (auto s = d.Start(); !s.ok()) {
    std::fprintf(stderr, "kvtier-bench crash: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const auto t0 = Clock::now();
  // Past --kills only while the oracle holds too little (a slow host: seen
  // 12 blocks after 4x the kills beside a CPU hog), up to 12x.
  auto more = [&](int64_t k) {
    return k < kills ||
           (k < 12 * kills && d.figures().checked_acked < static_cast<uint64_t>(min_acked));
  };
  for (int64_t k = 0; more(k); ++k) {
    if (auto s = d.Cycle(static_cast<size_t>(sample), k + 1 == wipe_at); !s.ok()) {
      std::fprintf(stderr, "kvtier-bench crash: restart %ld: %s\n", static_cast<long>(k + 1),
                   std::string(s.message()).c_str());
      return 1;
    }
    if (!json && isatty(2))
      std::fprintf(stderr, "\r  %ld/%ld kills", static_cast<long>(k + 1), static_cast<long>(kills));
  }
  d.CheckAll();
  d.Stop();
  Figures& f = d.figures();
  f.acked = d.acked();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const double put_rate = f.load_seconds > 0 ? f.put_blocks / f.load_seconds : 0;
  nlohmann::json j = {{"disk_sync", disk_sync},
                      {"kills", f.kills},
                      {"seconds", seconds},
                      {"load_seconds", f.load_seconds},
                      {"put_blocks_per_s", put_rate},
                      {"puts", f.puts},
                      {"put_blocks", f.put_blocks},
                      {"gets", f.gets},
                      {"served_blocks", f.served_blocks},
                      {"evicts", f.evicts},
                      {"acknowledged_on_nvme", f.acked},
                      {"checked_after_restarts", f.checked},
                      {"acknowledged_checked_after_restarts", f.checked_acked},
                      {"lost", f.lost},
                      {"wrong", f.wrong},
                      {"failed_calls", f.failed_calls},
                      {"restart_p50_ms", Percentile(f.restart_ms, 0.5)},
                      {"restart_p99_ms", Percentile(f.restart_ms, 0.99)},
                      {"problems", f.problems}};
  if (json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    if (isatty(2)) std::fprintf(stderr, "\n");
    std::printf(
        "kvtier-bench crash: %lu SIGKILLs in %.0f s under put/get/evict load with demotions "
        "(--disk-sync=%s)\n"
        "  %lu puts (%lu blocks, %.0f blocks/s under load), %lu gets (%lu blocks served, every "
        "one checked), %lu evictions\n"
        "  %lu blocks acknowledged on NVMe at the end; %lu reads after restarts\n"
        "  lost: %lu   wrong bytes: %lu   calls failed around kills: %lu\n"
        "  restart to serving: p50 %.0f ms, p99 %.0f ms\n",
        f.kills, seconds, disk_sync.c_str(), f.puts, f.put_blocks, put_rate, f.gets,
        f.served_blocks, f.evicts, f.acked, f.checked, f.lost, f.wrong, f.failed_calls,
        Percentile(f.restart_ms, 0.5), Percentile(f.restart_ms, 0.99));
    for (const auto& p : f.problems) std::printf("  problem: %s\n", p.c_str());
  }
  return f.lost == 0 && f.wrong == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
