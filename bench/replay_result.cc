#include "bench/replay_result.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_format.h"
#include "common/config.h"

namespace kvtier::bench {

void ModeResult::Pool(const ModeResult& o) {
  requests += o.requests, prompt_tokens += o.prompt_tokens, computed += o.computed;
  gpu_hit += o.gpu_hit, store_ram += o.store_ram, store_disk += o.store_disk;
  verified += o.verified, mismatched += o.mismatched, load_failures += o.load_failures;
  offloaded_blocks += o.offloaded_blocks, lookups_skipped += o.lookups_skipped;
  late_deliveries += o.late_deliveries;
  late_ms_max = std::max(late_ms_max, o.late_ms_max);
  ttft.insert(ttft.end(), o.ttft.begin(), o.ttft.end());
  for (int p = 0; p < kParts; ++p)
    parts[p].insert(parts[p].end(), o.parts[p].begin(), o.parts[p].end());
  if (work.size() < o.work.size()) work.resize(o.work.size());
  for (size_t w = 0; w < o.work.size(); ++w) work[w] += o.work[w];
  const uint64_t pins = onboard.count + o.onboard.count;
  if (pins > 0) {
    store_pin_handler_ms =
        (store_pin_handler_ms * onboard.count + o.store_pin_handler_ms * o.onboard.count) / pins;
  }
  seconds += o.seconds, onboard_ms += o.onboard_ms;
  onboarded_bytes += o.onboarded_bytes, onboarded_blocks += o.onboarded_blocks;
  onboard.Add(o.onboard);
  offload.Add(o.offload);
  offload_batches += o.offload_batches, offload_round_trips += o.offload_round_trips;
  offloaded_bytes += o.offloaded_bytes, computed_blocks += o.computed_blocks;
  offload_dropped += o.offload_dropped;
  store_begin_puts += o.store_begin_puts, store_grpc_commits += o.store_grpc_commits;
  store_pipelined_commits += o.store_pipelined_commits;
  runs.insert(runs.end(), o.runs.begin(), o.runs.end());
  scale.insert(scale.end(), o.scale.begin(), o.scale.end());
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

nlohmann::json PartsJson(const ModeResult& r) {
  nlohmann::json j;
  for (int p = 0; p < kParts; ++p) {
    j[kPartNames[p]] = {{"mean_ms", Mean(r.parts[p])}, {"p99_ms", Percentile(r.parts[p], 0.99)}};
  }
  // The same parts over the slowest 1% of requests (by TTFT): what their
  // time went to.
  std::vector<size_t> order(r.ttft.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return r.ttft[a] > r.ttft[b]; });
  const size_t tail = std::max<size_t>(1, order.size() / 100);
  for (int p = 0; p < kParts && !order.empty(); ++p) {
    double s = 0;
    for (size_t k = 0; k < tail && k < order.size(); ++k) s += r.parts[p][order[k]];
    j[kPartNames[p]]["slowest_1pct_mean_ms"] = s / std::min(tail, order.size());
  }
  return j;
}

nlohmann::json ToJson(const ModeResult& r) {
  nlohmann::json runs = nlohmann::json::array();
  for (const RunFigures& f : r.runs) {
    runs.push_back({{"ttft_mean_ms", f.ttft_mean_ms},
                    {"ttft_p99_ms", f.ttft_p99_ms},
                    {"late_deliveries", f.late_deliveries}});
  }
  nlohmann::json scale = nlohmann::json::array();
  for (const ScaleFigures& f : r.scale) {
    nlohmann::json drains = nlohmann::json::array();
    for (const auto& [ms, bytes] : f.drains) drains.push_back({{"exit_ms", ms}, {"bytes", bytes}});
    scale.push_back({{"from_request", f.at},
                     {"scaled", f.scaled},
                     {"computed_pct", f.computed_pct},
                     {"ttft_mean_ms", f.ttft_mean_ms},
                     {"ttft_p99_ms", f.ttft_p99_ms},
                     {"retried", f.retried},
                     {"drains", drains}});
  }
  return {
      {"scale_down", scale},
      {"runs", runs},
      {"requests", r.requests},
      {"prompt_tokens", r.prompt_tokens},
      {"computed_fraction", r.Frac(r.computed)},
      {"gpu_hit_fraction", r.Frac(r.gpu_hit)},
      {"store_ram_fraction", r.Frac(r.store_ram)},
      {"store_disk_fraction", r.Frac(r.store_disk)},
      {"ttft_mean_ms", r.TtftMean()},
      {"ttft_p99_ms", r.TtftP99()},
      {"load_balance_max_over_mean", r.Balance()},
      {"verified_blocks", r.verified},
      {"mismatched_blocks", r.mismatched},
      {"load_fallbacks", r.load_failures},
      {"store_lookups_skipped", r.lookups_skipped},
      {"late_deliveries", r.late_deliveries},
      {"late_ms_max", r.late_ms_max},
      {"bytes_moved", r.BytesMoved()},
      {"wire_block_bytes", r.wire_block_bytes},
      {"onboard_gb_per_s", r.onboard_ms > 0 ? r.onboarded_bytes / (r.onboard_ms / 1000) / 1e9 : 0},
      {"onboard_ms", r.onboard_ms},
      {"onboard_load_only_gb_per_s",
       r.onboard_ms > r.onboard.control
           ? r.onboarded_bytes / ((r.onboard_ms - r.onboard.control) / 1000) / 1e9
           : 0},
      {"onboard_breakdown", r.onboard.Json()},
      {"offload_breakdown", r.offload.Json()},
      {"ttft_parts", PartsJson(r)},
      {"offload",
       {{"batches", r.offload_batches},
        {"round_trips", r.offload_round_trips},
        {"offloaded_blocks", r.offloaded_blocks},
        {"offloaded_bytes", r.offloaded_bytes},
        {"computed_blocks", r.computed_blocks},
        {"dropped", r.offload_dropped},
        {"round_trips_per_offloaded_block", r.RoundTripsPerOffloadedBlock()},
        {"store_begin_puts", r.store_begin_puts},
        {"store_grpc_commits", r.store_grpc_commits},
        {"store_pipelined_commits", r.store_pipelined_commits},
        {"store_waits_per_offloaded_block", r.StoreWaitsPerOffloadedBlock()},
        {"bytes_per_computed_block", r.BytesPerComputedBlock()}}},
      {"seconds", r.seconds}};
}

void WritePlot(const std::string& path, const std::vector<ModeResult>& modes, double oracle) {
  std::ofstream svg(path);
  const int w = 720, h = 360, left = 60, bottom = 300, bar = 70;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
      << "' font-family='sans-serif' font-size='12'>\n";
  svg << "<text x='" << left << "' y='20' font-size='14'>Prompt tokens computed (lower is better); "
      << "TTFT p99 above each bar</text>\n";
  svg << "<line x1='" << left << "' y1='" << bottom << "' x2='" << w - 20 << "' y2='" << bottom
      << "' stroke='black'/>\n";
  int x = left + 20;
  auto draw = [&](const std::string& name, double frac, const std::string& note,
                  const char* color) {
    int bh = static_cast<int>(frac * 250);
    svg << "<rect x='" << x << "' y='" << bottom - bh << "' width='" << bar << "' height='" << bh
        << "' fill='" << color << "'/>\n";
    svg << absl::StrFormat("<text x='%d' y='%d'>%.1f%%</text>\n", x + 10, bottom - bh - 18,
                           100 * frac);
    svg << "<text x='" << x << "' y='" << bottom - bh - 4 << "'>" << note << "</text>\n";
    svg << "<text x='" << x << "' y='" << bottom + 16 << "'>" << name << "</text>\n";
    x += bar + 50;
  };
  for (const auto& m : modes) {
    draw(m.name, m.Frac(m.computed), absl::StrFormat("%.0f ms", m.TtftP99()),
         m.name == "kvtier" ? "#2b7a2b" : "#7a8aa0");
  }
  draw("oracle", 1 - oracle, "bound", "#c9a227");
  svg << "</svg>\n";
}

void PrintReport(const ReportHeader& h, const std::vector<ModeResult>& results,
                 double oracle_hit_ratio, uint64_t verified, uint64_t mismatched) {
  std::printf("\nkvtier replay of %zu requests (%s), %ld workers x %ld GPU pages, %s per block\n\n",
              h.requests, h.trace_name.c_str(), h.workers, h.pages,
              FormatBytes(h.block_bytes).c_str());
  std::printf("%-18s %9s %8s %9s %9s %11s %11s %8s %10s\n", "mode", "computed", "GPU hit",
              "store RAM", "store NVMe", "TTFT mean", "TTFT p99", "max/mean", "moved");
  for (const auto& r : results) {
    std::printf("%-18s %8.2f%% %7.2f%% %8.2f%% %9.2f%% %9.0f ms %9.0f ms %8.2f %10s\n",
                r.name.c_str(), 100 * r.Frac(r.computed), 100 * r.Frac(r.gpu_hit),
                100 * r.Frac(r.store_ram), 100 * r.Frac(r.store_disk), r.TtftMean(), r.TtftP99(),
                r.Balance(), FormatBytes(r.BytesMoved()).c_str());
  }
  std::printf("%-18s %8.2f%%   (infinite cache shared by all engines, from the trace)\n", "oracle",
              100 * (1 - oracle_hit_ratio));
  if (!results.empty() && results[0].runs.size() > 1) {
    // --repeat: the table pools every run's requests; each run's own figures.
    std::printf(
        "\n%zu runs of each mode (fresh clusters, modes interleaved); each run's TTFT "
        "mean / p99, ms:\n",
        results[0].runs.size());
    for (const auto& r : results) {
      std::printf("%-18s", r.name.c_str());
      for (const RunFigures& f : r.runs) std::printf(" %.2f/%.2f", f.ttft_mean_ms, f.ttft_p99_ms);
      std::printf("\n");
    }
  }
  std::printf("\nonboarded blocks verified byte for byte: %lu, mismatched: %lu\n", verified,
              mismatched);
  // Where each mode's TTFT went: mean over all requests, and mean over the
  // slowest 1% (what its p99 is made of).
  std::printf("\nwhere TTFT went, ms (%s clock): mean over all requests / over the slowest 1%%\n",
              h.real_clock ? "real" : "simulated");
  std::printf("%-18s", "mode");
  for (int p = 0; p < kParts; ++p) std::printf(" %15s", kPartNames[p]);
  std::printf("\n");
  for (const auto& r : results) {
    nlohmann::json j = PartsJson(r);
    std::printf("%-18s", r.name.c_str());
    for (int p = 0; p < kParts; ++p) {
      std::printf(" %7.1f /%6.0f", j[kPartNames[p]]["mean_ms"].get<double>(),
                  j[kPartNames[p]].value("slowest_1pct_mean_ms", 0.0));
    }
    std::printf("\n");
  }
  for (const auto& r : results) {
    if (r.late_deliveries == 0) continue;
    // The simulated engines' clock is only as good as the host's delivery:
    // say when it was not (their wait behind the engine is not counted).
    std::printf(
        "  %s: %lu requests reached their worker past its reorder window, the latest %.0f "
        "simulated ms late (the host could not deliver them on time at this speed)\n",
        r.name.c_str(), r.late_deliveries, r.late_ms_max);
  }
  for (const auto& r : results) {
    if (r.offloaded_blocks == 0) continue;
    std::printf(
        "  %s offload: %lu blocks written; waits on the store per block written %.3f "
        "(the store's count: %lu reservations, %lu commits over gRPC, %lu behind the "
        "bytes)",
        r.name.c_str(), r.offloaded_blocks, r.StoreWaitsPerOffloadedBlock(), r.store_begin_puts,
        r.store_grpc_commits, r.store_pipelined_commits);
    if (r.computed_blocks > 0) {
      std::printf(
          "; %.2f blocks' bytes sent per block computed (%lu computed, %lu dropped "
          "from a full queue)",
          r.BytesPerComputedBlock() / std::max<uint64_t>(r.wire_block_bytes, 1), r.computed_blocks,
          r.offload_dropped);
    }
    std::printf("\n");
  }
  for (const auto& r : results) {
    if (r.onboard_ms > 0) {
      const Breakdown& b = r.onboard;
      // The pin is the request's matching step too (the store's answer to
      // "how much do you hold?", a Lookup before this path existed): shown
      // with and without it.
      const double load_only_ms = r.onboard_ms - b.control;
      std::printf(
          "  %s: %s onboarded at %.2f GB/s of time inside onboarding with the pin, "
          "%.2f GB/s without it (StartLoad to WaitForLoad)\n",
          r.name.c_str(), FormatBytes(r.onboarded_bytes).c_str(),
          r.onboarded_bytes / (r.onboard_ms / 1000) / 1e9,
          load_only_ms > 0 ? r.onboarded_bytes / (load_only_ms / 1000) / 1e9 : 0.0);

      std::printf(
          "    onboarding %.0f ms in %lu loads (pin p50 %.2f ms, of which the store's "
          "handler %.3f ms mean): pin %.0f, lane "
          "wait %.0f, staging wait %.0f, RMA %.0f, checksum %.0f, unpack %.0f, other "
          "(lookups that found nothing, page allocation, hand-offs, release) %.0f; %lu "
          "lookups skipped (the router knew the store held nothing past the GPU pages)\n",
          r.onboard_ms, b.count, Percentile(b.control_each, 0.5), r.store_pin_handler_ms, b.control,
          b.queue, b.staging, b.rma, b.checksum, b.scatter,
          std::max(0.0,
                   r.onboard_ms - b.control - b.queue - b.staging - b.rma - b.checksum - b.scatter),
          r.lookups_skipped);
      const Breakdown& f = r.offload;
      std::printf(
          "    offloading (background): gather%s %.0f ms, lane wait %.0f, BeginPut+CommitPut "
          "%.0f, RMA %.0f\n",
          h.packed ? "+pack" : "", f.gather, f.queue, f.control, f.rma);
    }
  }
  for (const auto& r : results) {
    for (size_t k = 0; k < r.scale.size(); ++k) {
      const ScaleFigures& f = r.scale[k];
      std::string drains;
      for (const auto& [ms, bytes] : f.drains) {
        drains +=
            absl::StrFormat("%s%.0f ms/%s", drains.empty() ? "" : ", ", ms, FormatBytes(bytes));
      }
      std::printf(
          "  %s run %zu, from request %ld%s: %.2f%% of prompt tokens computed, TTFT mean %.0f "
          "ms, p99 %.0f ms; %lu requests sent again%s%s\n",
          r.name.c_str(), k + 1, f.at, f.scaled ? " (workers left)" : " (no scale-down)",
          f.computed_pct, f.ttft_mean_ms, f.ttft_p99_ms, f.retried,
          drains.empty() ? "" : "; leaving workers (SIGTERM to exit / bytes drained): ",
          drains.c_str());
    }
  }
  for (const auto& r : results) {
    if (r.restarted_at < 0) continue;
    auto ratio = [&](int64_t from, int64_t to) {
      uint64_t hit = 0, all = 0;
      for (int64_t i = std::max<int64_t>(0, from); i < std::min<int64_t>(to, r.per_request.size());
           ++i) {
        hit += r.per_request[i].first;
        all += r.per_request[i].second;
      }
      return all ? 100.0 * hit / all : 0.0;
    };
    std::printf(
        "  %s: %s at request %ld; GPU-hit ratio of the 1,000 requests before %.2f%%, "
        "after %.2f%%\n",
        r.name.c_str(), h.restart_control ? "no restart (control)" : "router killed and restarted",
        r.restarted_at, ratio(r.restarted_at - 1000, r.restarted_at),
        ratio(r.restarted_at, r.restarted_at + 1000));
  }
}

}  // namespace kvtier::bench
