// kvtier-bench replay's results: a request's TTFT parts, a mode's totals
// and figures, and how they are printed as JSON and drawn as SVG.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "kvtier/v1/worker.pb.h"

namespace kvtier::bench {

// The parts of a request's TTFT, in the replay's clock: simulated
// milliseconds for the sim engine (real costs of the tier enter as
// measured), real ones for the torch engine.
//   window   waiting for a free slot in the client's window (--concurrency)
//   route    the router's answer (KV-aware modes)
//   onboard  the store lookup and the load of its blocks
//   queue    the sim engine: waiting for it, behind other requests
//   prefill  the sim engine: computing the prompt's uncached tokens
//   other    the torch engine: everything else (its own queue and compute,
//            real; it does not tell them apart)
enum Part { kWindow, kRoute, kOnboard, kQueue, kPrefill, kOther, kParts };
constexpr const char* kPartNames[kParts] = {"window", "route",   "onboard",
                                            "queue",  "prefill", "other"};

// One request's TTFT parts, and where it ran.
struct Timed {
  int64_t worker = -1;  // -1: not served
  std::array<double, kParts> part{};
  uint64_t prompt = 0, computed = 0, gpu_hit = 0, onboarded = 0;
  double late_ms = 0;  // SubmitResponse::late_ms: past the reorder window
};

// Milliseconds per step, summed (the SubmitResponse / worker stats breakdown).
struct Breakdown {
  double control = 0, queue = 0, rma = 0, checksum = 0, staging = 0, scatter = 0, gather = 0;
  uint64_t count = 0;                // operations (loads) added
  std::vector<double> control_each;  // per load, for the median
  void Add(const v1::TimeBreakdown& b) {
    ++count;
    control_each.push_back(b.control_ms());
    control += b.control_ms();
    queue += b.queue_ms();
    rma += b.rma_ms();
    checksum += b.checksum_ms();
    staging += b.staging_ms();
    scatter += b.scatter_ms();
    gather += b.gather_ms();
  }
  void Add(const Breakdown& b) {
    control += b.control, queue += b.queue, rma += b.rma, checksum += b.checksum;
    staging += b.staging, scatter += b.scatter, gather += b.gather, count += b.count;
    control_each.insert(control_each.end(), b.control_each.begin(), b.control_each.end());
  }
  nlohmann::json Json() const {
    return {{"control_ms", control},   {"lane_wait_ms", queue},      {"rma_ms", rma},
            {"checksum_ms", checksum}, {"staging_wait_ms", staging}, {"scatter_ms", scatter},
            {"gather_ms", gather}};
  }
};

// One run of a mode, as --repeat lists it.
struct RunFigures {
  double ttft_mean_ms = 0, ttft_p99_ms = 0;
  uint64_t late_deliveries = 0;
};

// The replay's second half, from --scale-down-at: what a scale-down cost.
struct ScaleFigures {
  int64_t at = 0;           // the request the second half starts at
  bool scaled = false;      // workers left (MODE@down, MODE@drain)
  double computed_pct = 0;  // prompt tokens computed, % of the second half's
  double ttft_mean_ms = 0, ttft_p99_ms = 0;
  uint64_t retried = 0;  // requests sent again after their worker refused or left
  // Per leaving worker: ms from SIGTERM to exit, and the bytes its drain
  // saved (from its log; 0 without a drain).
  std::vector<std::pair<double, uint64_t>> drains;
};

struct ModeResult {
  std::string name;
  uint64_t requests = 0, prompt_tokens = 0, computed = 0, gpu_hit = 0, store_ram = 0,
           store_disk = 0, verified = 0, mismatched = 0, load_failures = 0, offloaded_blocks = 0,
           lookups_skipped = 0;  // store lookups skipped on the router's hint
  // Requests that reached their simulated worker past its reorder window
  // (the host did not deliver them on time), and the latest, simulated ms.
  uint64_t late_deliveries = 0;
  double late_ms_max = 0;
  std::vector<double> ttft;
  // Where each request's TTFT went, in the replay's clock (see Part).
  std::array<std::vector<double>, kParts> parts;
  std::vector<uint64_t> work;  // prefill tokens per worker
  std::vector<std::pair<uint64_t, uint64_t>>
      per_request;  // (gpu hit tokens, prompt tokens) by index
  int64_t restarted_at = -1;
  double seconds = 0, onboard_ms = 0;
  uint64_t onboarded_bytes = 0;  // KV bytes delivered into pages
  uint64_t onboarded_blocks = 0;
  uint64_t wire_block_bytes = 0;  // bytes a block takes in the store and on the wire
  Breakdown onboard, offload;
  double store_pin_handler_ms = 0;  // the store's own time in BeginGet, mean per call
  // The offload path, from the workers' stats.
  uint64_t offload_batches = 0, offload_round_trips = 0, offloaded_bytes = 0, computed_blocks = 0,
           offload_dropped = 0;
  // The store's count of put calls: reservations, and commits over gRPC (a
  // round trip of their own, after a flush) or behind the bytes on the data
  // plane (none of their own).
  uint64_t store_begin_puts = 0, store_grpc_commits = 0, store_pipelined_commits = 0;
  // Each run's own figures (--repeat; one entry for a single run).
  std::vector<RunFigures> runs;
  std::vector<ScaleFigures> scale;  // one per run, with --scale-down-at
  // Adds another run of the same mode (--repeat): its requests join the
  // TTFT distributions (the mean and p99 are then over every run's
  // requests), its counts and times the totals. Not for runs with a
  // router restart (per_request stays this run's).
  void Pool(const ModeResult& other);
  // Waits on the store per block written, counted by the store: a
  // reservation's, and for a gRPC commit the flush's and the commit's; a
  // pipelined commit's is the bytes' own.
  double StoreWaitsPerOffloadedBlock() const {
    return offloaded_blocks
               ? double(store_begin_puts + 2 * store_grpc_commits + store_pipelined_commits) /
                     offloaded_blocks
               : 0;
  }
  double RoundTripsPerOffloadedBlock() const {
    return offloaded_blocks ? double(offload_round_trips) / offloaded_blocks : 0;
  }
  double BytesPerComputedBlock() const {
    return computed_blocks ? double(offloaded_bytes) / computed_blocks : 0;
  }
  uint64_t BytesMoved() const { return (onboarded_blocks + offloaded_blocks) * wire_block_bytes; }
  double Frac(uint64_t x) const { return prompt_tokens ? double(x) / prompt_tokens : 0; }
  double TtftMean() const {
    double s = 0;
    for (double t : ttft) s += t;
    return ttft.empty() ? 0 : s / ttft.size();
  }
  double TtftP99() const { return Percentile(ttft, 0.99); }
  double Balance() const {
    if (work.empty()) return 0;
    double sum = 0, mx = 0;
    for (auto w : work) {
      sum += w;
      mx = std::max<double>(mx, w);
    }
    return sum > 0 ? mx / (sum / work.size()) : 1.0;
  }
};

double Mean(const std::vector<double>& v);
// Each part's mean and p99, and its mean over the slowest 1% of requests.
nlohmann::json PartsJson(const ModeResult& r);
nlohmann::json ToJson(const ModeResult& r);
// An SVG bar chart of the computed fraction per mode, beside the bound.
void WritePlot(const std::string& path, const std::vector<ModeResult>& modes, double oracle);

// What the printed report says of the replay itself.
struct ReportHeader {
  size_t requests = 0;
  std::string trace_name;
  int64_t workers = 0, pages = 0;
  uint64_t block_bytes = 0;
  bool real_clock = false;  // the torch engine: TTFT parts in real time
  bool packed = false;      // --kv-wire: offloads pack
  bool restart_control = false;
};
// The comparison table, where TTFT went, and the offload and onboarding
// breakdowns, on stdout.
void PrintReport(const ReportHeader& h, const std::vector<ModeResult>& results,
                 double oracle_hit_ratio, uint64_t verified, uint64_t mismatched);

}  // namespace kvtier::bench
