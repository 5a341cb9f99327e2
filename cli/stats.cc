// kvctl stats: per-tier statistics of every store shard and their sum, as a
// table (refreshed in place with --watch) or JSON.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "cli/cli.h"
#include "cli/commands.h"

namespace kvtier::cli {
namespace {

std::string Ratio(uint64_t hits, uint64_t misses) {
  return hits + misses ? absl::StrFormat("%.1f%%", 100.0 * hits / (hits + misses)) : "-";
}

nlohmann::json TierJson(const v1::TierStats& t) {
  return {{"capacity_bytes", t.capacity_bytes()},
          {"used_bytes", t.used_bytes()},
          {"items", t.items()},
          {"hits", t.hits()},
          {"misses", t.misses()},
          {"hit_ratio", t.hits() + t.misses() ? double(t.hits()) / (t.hits() + t.misses()) : 0.0},
          {"evictions", t.evictions()},
          {"promotions", t.promotions()},
          {"demotions", t.demotions()},
          {"bytes_in", t.bytes_in()},
          {"bytes_out", t.bytes_out()},
          {"policy", t.policy()},
          {"degraded", t.degraded()},
          {"degraded_reason", t.degraded_reason()}};
}

void Add(v1::TierStats* sum, const v1::TierStats& t) {
  sum->set_capacity_bytes(sum->capacity_bytes() + t.capacity_bytes());
  sum->set_used_bytes(sum->used_bytes() + t.used_bytes());
  sum->set_items(sum->items() + t.items());
  sum->set_hits(sum->hits() + t.hits());
  sum->set_misses(sum->misses() + t.misses());
  sum->set_evictions(sum->evictions() + t.evictions());
  sum->set_promotions(sum->promotions() + t.promotions());
  sum->set_demotions(sum->demotions() + t.demotions());
  sum->set_bytes_in(sum->bytes_in() + t.bytes_in());
  sum->set_bytes_out(sum->bytes_out() + t.bytes_out());
  if (sum->policy().empty())
    sum->set_policy(t.policy());
  else if (sum->policy() != t.policy())
    sum->set_policy("mixed");
  sum->set_degraded(sum->degraded() || t.degraded());
}

using Shards = std::vector<std::pair<std::string, v1::GetStatsResponse>>;

void PrintShardsJson(const Shards& shards, const v1::TierStats (&sum)[2]) {
  // Keyed by shard address, as every kvctl --json output is.
  nlohmann::json j = {{"shards", nlohmann::json::object()}};
  for (const auto& [a, s] : shards) {
    nlohmann::json shard = {{"demotion_queue_blocks", s.demotion_queue_blocks()},
                            {"demotion_queue_dropped", s.demotion_queue_dropped()},
                            {"put_leases", s.put_leases()},
                            {"get_leases", s.get_leases()},
                            {"checksum_failures", s.checksum_failures()}};
    for (const auto& t : s.tiers()) shard["tiers"][TierName(t.tier())] = TierJson(t);
    j["shards"][a] = shard;
  }
  j["total"]["tiers"]["ram"] = TierJson(sum[0]);
  j["total"]["tiers"]["disk"] = TierJson(sum[1]);
  PrintJson(j);
}

void PrintShardsTable(const Shards& shards, const v1::TierStats (&sum)[2]) {
  auto row = [](const std::string& shard, const char* tier, const v1::TierStats& t) {
    std::printf("%-22s %-5s %-7s %11s %11s %9lu %7s %10lu %10lu %10lu %11s %11s%s\n", shard.c_str(),
                tier, t.policy().c_str(), FormatBytes(t.capacity_bytes()).c_str(),
                FormatBytes(t.used_bytes()).c_str(), t.items(), Ratio(t.hits(), t.misses()).c_str(),
                t.evictions(), t.promotions(), t.demotions(), FormatBytes(t.bytes_in()).c_str(),
                FormatBytes(t.bytes_out()).c_str(), t.degraded() ? "  DEGRADED" : "");
  };
  std::printf("%-22s %-5s %-7s %11s %11s %9s %7s %10s %10s %10s %11s %11s\n", "shard", "tier",
              "policy", "capacity", "used", "items", "hits", "evictions", "promotions", "demotions",
              "bytes in", "bytes out");
  for (const auto& [a, s] : shards) {
    for (const auto& t : s.tiers()) row(a, TierName(t.tier()), t);
  }
  if (shards.size() > 1) {
    row("total", "ram", sum[0]);
    row("total", "disk", sum[1]);
  }
}

}  // namespace

// --watch refreshes no faster than this: a refresh is a GetStats on every
// shard, and a spinning kvctl would load them and its own core.
constexpr uint64_t kMinWatchIntervalMs = 100;

int RunStats(const CommandLine& line) {
  SharedFlags c;
  bool watch = false;
  uint64_t interval_ms = 2000;
  FlagSet f("kvctl stats", "Per-tier statistics of every store shard, and their sum.");
  c.Register(f, SharedFlags::Dials::kStores);
  f.Bool("watch", &watch, "Refresh in place until interrupted");
  f.DurationMs("interval", &interval_ms,
               "Refresh period with --watch (at least 100ms: each refresh asks every shard)");
  ParseCommandFlags(f, line);
  if (interval_ms < kMinWatchIntervalMs) {
    std::fprintf(stderr,
                 "kvctl stats: --interval %lums is below the minimum of %lums (each refresh asks "
                 "every shard for its statistics)\n",
                 static_cast<unsigned long>(interval_ms),
                 static_cast<unsigned long>(kMinWatchIntervalMs));
    return kUsage;
  }
  for (bool first = true;; first = false) {
    Shards shards;
    for (const auto& addr : c.StoreList()) {
      StoreClient client = c.StoreAt(addr);
      auto s = client.GetStats();
      if (!s.ok()) return Report(s.status(), "store " + addr);
      shards.emplace_back(addr, *s);
    }
    v1::TierStats sum[2];
    for (const auto& [a, s] : shards) {
      for (int t = 0; t < s.tiers_size() && t < 2; ++t) Add(&sum[t], s.tiers(t));
    }
    if (c.json) {
      PrintShardsJson(shards, sum);
    } else {
      // Home and clear, so each refresh of --watch overwrites the last.
      if (watch && !first) std::printf("\033[H\033[2J");
      PrintShardsTable(shards, sum);
    }
    if (!watch) return kOk;
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
}

}  // namespace kvtier::cli
