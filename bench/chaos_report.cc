#include "bench/chaos_report.h"

#include <cstdio>
#include <string>

namespace kvtier::bench {

namespace {

std::string Row(const std::string& phase, const nlohmann::json& f) {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "  %-7s %5lu done %3lu failed %3lu loads recomputed %5lu verified %lu wrong | TTFT "
                "p50/p99 %6.0f / %6.0f ms | request p50/p99 %6.0f / %6.0f ms",
                phase.c_str(), f["done"].get<uint64_t>(), f["failed"].get<uint64_t>(),
                f["loads_failed_recomputed"].get<uint64_t>(), f["verified_blocks"].get<uint64_t>(),
                f["wrong_blocks"].get<uint64_t>(), f["ttft_p50_ms"].get<double>(),
                f["ttft_p99_ms"].get<double>(), f["wall_p50_ms"].get<double>(),
                f["wall_p99_ms"].get<double>());
  return buf;
}

}  // namespace

void PrintChaosReport(const nlohmann::json& out, double phase_s, int64_t concurrency) {
  std::printf(
      "kvtier-bench chaos: 3 store shards, a router, 4 workers and a client, each in its own "
      "network namespace; %.1f s per phase, %ld requests in flight\n\n",
      phase_s, static_cast<long>(concurrency));
  for (const auto& j : out) {
    if (j.contains("skipped")) {
      std::printf("%s: skipped (%s)\n\n", j["scenario"].get<std::string>().c_str(),
                  j["skipped"].get<std::string>().c_str());
      continue;
    }
    std::printf("%s: %s\n", j["scenario"].get<std::string>().c_str(),
                j["fault"].get<std::string>().c_str());
    for (const char* p : {"before", "during", "after"}) std::printf("%s\n", Row(p, j[p]).c_str());
    if (j["during"]["routes_failed"].get<uint64_t>() > 0) {
      std::printf("  routes that failed (sent round-robin instead): %lu during, %lu after\n",
                  j["during"]["routes_failed"].get<uint64_t>(),
                  j["after"]["routes_failed"].get<uint64_t>());
    }
    std::printf(
        "  every source back at the router %.2f s after healing; last failed request or "
        "load %.2f s after healing\n\n",
        j["sources_back_s"].get<double>(), j["last_failure_after_heal_s"].get<double>());
  }
}

}  // namespace kvtier::bench
