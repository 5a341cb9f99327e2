// kvtier-bench worker's latency cases: loads of a few blocks into a
// worker, p50/p99, beside the raw RMA of the same bytes and one control
// round trip.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "worker/connector.h"

namespace kvtier::bench {

// A namespace of `block_bytes` blocks: layers x 8 KV heads x 128 dims x
// fp16, 4 KiB per token and layer; tokens set the size.
inline NamespaceSpec SpecFor(uint64_t block_bytes, const std::string& model, uint32_t layers = 8) {
  return NamespaceSpec{
      model, "fp16", layers, 8,  128, static_cast<uint32_t>(block_bytes / (4096ull * layers)),
      0,     1,      "",     "", ""};
}

// One latency case: loads of `blocks` blocks into a worker, p50/p99, beside
// the raw RMA of the same bytes and one control round trip.
struct LatencyCase {
  uint64_t block_bytes = 0, blocks = 0;
  uint32_t layers = 0;
  double p50_ms = 0, p99_ms = 0, raw_rma_p50_ms = 0, rtt_p50_ms = 0;
  double first_layer_p50_ms = 0;  // Begin until layer 0 of every block is in
  worker::LoadTimes mean;         // per load
  double target_ms() const { return raw_rma_p50_ms + 1.5 * rtt_p50_ms; }
};

// `reps` loads of `n` blocks of `size` bytes (`layers` layers) from `store`
// into a worker, timed.
absl::StatusOr<LatencyCase> MeasureLatency(const std::string& store, uint64_t size, uint64_t n,
                                           uint32_t layers, int reps);

}  // namespace kvtier::bench
