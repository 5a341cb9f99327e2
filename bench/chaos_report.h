// kvtier-bench chaos: what one phase of a scenario measured, and the
// printed report of every scenario.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/bench_util.h"

namespace kvtier::bench {

struct PhaseFigures {
  uint64_t done = 0, failed = 0, load_failed = 0, verified = 0, mismatched = 0, unrouted = 0;
  std::vector<double> ttft, wall;  // simulated TTFT; wall time of the whole request
  nlohmann::json Json() const {
    return {{"done", done},
            {"failed", failed},
            {"loads_failed_recomputed", load_failed},
            {"verified_blocks", verified},
            {"wrong_blocks", mismatched},
            {"routes_failed", unrouted},
            {"ttft_p50_ms", Percentile(ttft, 0.5)},
            {"ttft_p99_ms", Percentile(ttft, 0.99)},
            {"wall_p50_ms", Percentile(wall, 0.5)},
            {"wall_p99_ms", Percentile(wall, 0.99)}};
  }
};

// The scenarios' results (Chaos::Run's JSON, or {"scenario", "skipped"}),
// as text on stdout.
void PrintChaosReport(const nlohmann::json& out, double phase_s, int64_t concurrency);

}  // namespace kvtier::bench
