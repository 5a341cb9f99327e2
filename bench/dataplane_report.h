// kvtier-bench dataplane's rows, the references measured beside them
// (memcpy, Redis at its best, ucx_perftest, Mooncake Store) and the report.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/bench_util.h"
#include "client/store_data_client.h"
#include "common/block_key.h"

namespace kvtier::bench {

struct Row {
  std::string path;  // "socket", "socket-tls", "ucx-tcp", "shm", "inline-grpc"
  uint64_t block_bytes;
  int64_t batch;
  std::string op;  // "put" / "get"
  double gbps = 0, blocks_per_s = 0;
  double raw_gbps = 0;         // the raw RMA loop of the same case (inline: ucx-tcp's)
  double perftest_gbps = 0;    // ucx_perftest over TCP (ucx-tcp and inline-grpc rows)
  double memcpy_gbps = 0;      // memcpy of distinct buffers (shm rows)
  double redis_best_gbps = 0;  // Redis at its best for this block size
  double ucx_gbps = 0;         // socket rows: the UCX data plane's (ucx-tcp) figure, same case
  double mooncake_gbps = 0;    // TCP rows: Mooncake Store, same block size, batch and clients
  double plain_gbps = 0;       // socket-tls rows: the plaintext socket row's figure, same case
  double nginx_tls_gbps = 0;   // socket-tls get rows: nginx over HTTPS, same body size
};

// nginx serving one body of a block's size, over HTTP and HTTPS (bytes/s).
struct NginxFigures {
  double plain_gbps = 0, tls_gbps = 0;
};

// Redis's best SET and best GET for one value size, and where each was found.
struct RedisBest {
  double set_gbps = 0, get_gbps = 0;
  int64_t set_clients = 0, set_pipeline = 0, get_clients = 0, get_pipeline = 0;
};

struct RawRates {
  double put_gbps = 0, get_gbps = 0;
};

// The data plane's own ceiling for one case: a RawRma (bench/raw_rma.h)
// over the same store with the same options, the case's blocks pinned where
// they lie in the arena and as many fresh slots reserved, then one raw Get
// of every block into dst (checked against src) and one raw Put of every
// block from src, each timed alone. The pins and reservations end when this
// returns (the reservations are aborted: nothing is stored).
absl::StatusOr<RawRates> MeasureRawRma(const std::string& store, const DataClientOptions& o,
                                       uint64_t ns, uint64_t size,
                                       const std::vector<BlockHash>& hashes, uint64_t first_put_id,
                                       HugeBuffer& src, HugeBuffer& dst);

// What to measure the references for.
struct RefPlan {
  std::vector<uint64_t> sizes;
  std::vector<int64_t> batches;
  std::function<uint64_t(uint64_t)> blocks_of;  // blocks per case of a size
  std::string dir;                              // scratch for Redis
  int64_t repeats = 1;
  bool have_tcp = false, have_shm = false, inline_path = false;
  bool have_tls = false;   // nginx over HTTP and HTTPS (certificates in dir: store.pem, store.key)
  bool references = true;  // Redis, ucx_perftest and Mooncake (memcpy always with shm)
};

// The references' figures, by block size (and batch, test).
struct References {
  std::map<uint64_t, double> memcpy_gbps;
  std::map<uint64_t, RedisBest> redis_best;
  std::map<std::pair<uint64_t, std::string>, double> perftest;  // (size, test) -> GB/s over TCP
  std::map<std::pair<uint64_t, int64_t>, MooncakeFigures> mooncake;
  std::string mooncake_why;                // why Mooncake was not measured ("" : it was)
  std::map<uint64_t, NginxFigures> nginx;  // by block size
};

// Measures the references. A reference that cannot be measured (a tool not
// installed, every configuration failing) is an error, but for Mooncake,
// which is then left out with the reason.
absl::Status MeasureReferences(const RefPlan& p, References* out);
// Sets each row's reference figures.
void AttachReferences(const References& refs, std::vector<Row>* rows);
// The rows with their references and ratios, as a table or JSON, on stdout.
void PrintDataPlaneReport(const std::vector<Row>& rows, const References& refs,
                          uint64_t working_set, bool json);

}  // namespace kvtier::bench
