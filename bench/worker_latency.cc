#include "bench/worker_latency.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "bench/raw_rma.h"
#include "client/store_data_client.h"
#include "common/elapsed.h"
#include "worker/model.h"

namespace kvtier::bench {

namespace {

// Saves `chain` through a write-through connector (so the store holds it).
absl::Status StoreChain(worker::KvConnector& a, uint64_t id, const std::vector<BlockHash>& chain) {
  auto m = a.Begin(id, chain);
  if (!m.ok()) return m.status();
  auto pages = a.AllocateForCompute(id);
  if (!pages.ok()) return pages.status();
  for (size_t i = 0; i < pages->size(); ++i) {
    worker::ComputeIntoPage(a.pool().layout(), a.pool().layer_bases(), (*pages)[i],
                            a.namespace_id(), chain[m->gpu_blocks + i]);
  }
  if (auto s = a.Save(id); !s.ok()) return s;
  auto s = a.WaitForSave(id);
  a.Finished(id);
  return s;
}

}  // namespace

absl::StatusOr<LatencyCase> MeasureLatency(const std::string& store, uint64_t size, uint64_t n,
                                           uint32_t layers, int reps) {
  LatencyCase c;
  c.block_bytes = size;
  c.blocks = n;
  c.layers = layers;
  worker::ConnectorOptions o;
  o.spec = SpecFor(size, absl::StrCat("latency-", size, "-", n, "-", layers), layers);
  o.num_pages = 2 * n;
  o.stores = {store};
  o.staging_blocks = 64;
  o.data.deadline_ms = 60000;
  o.offload = "write-through";
  auto a = worker::KvConnector::Create(o);
  if (!a.ok()) return a.status();
  // Two chains the store holds; a worker with room for one alternates
  // between them, so every load comes from the store.
  std::vector<BlockHash> x, y;
  for (uint64_t i = 0; i < n; ++i) {
    x.push_back(BlockHash{size * 1000 + n, 2 * i + 1});
    y.push_back(BlockHash{size * 1000 + n, 2 * i + 2});
  }
  if (auto s = StoreChain(**a, 1, x); !s.ok()) return s;
  if (auto s = StoreChain(**a, 2, y); !s.ok()) return s;
  o.offload = "none";
  o.num_pages = n;
  auto b = worker::KvConnector::Create(o);
  if (!b.ok()) return b.status();
  // One control round trip (a one-block Lookup) before each load, on a
  // channel of its own: measured under the same conditions as the loads.
  StoreClient control(store);
  std::vector<double> ms, first_ms, rtt;
  for (int r = 0; r < reps + 2; ++r) {  // two warm-up loads
    const auto& chain = r % 2 ? y : x;
    const uint64_t id = 10 + r;
    auto t = Clock::now();
    auto l = control.Lookup((*b)->namespace_id(), {x[0]});
    if (!l.ok()) return l.status();
    if (r >= 2) rtt.push_back(MsSince(t));
    t = Clock::now();
    auto m = (*b)->Begin(id, chain);
    if (!m.ok()) return m.status();
    if (m->store_blocks != n) {
      (*b)->Finished(id);
      return absl::InternalError(absl::StrCat("the store holds ", m->store_blocks, " of ", n));
    }
    if (auto s = (*b)->StartLoad(id); !s.ok()) return s;
    if (auto s = (*b)->WaitForLayer(id, 0); !s.ok()) return s;
    const double first = MsSince(t);
    auto loaded = (*b)->WaitForLoad(id);
    const double all = MsSince(t);
    if (!loaded.ok()) return loaded.status();
    if (*loaded != n) return absl::InternalError(absl::StrCat("loaded ", *loaded, " of ", n));
    if (r >= 2) {
      ms.push_back(all);
      first_ms.push_back(first);
      c.mean += (*b)->LoadTimesOf(id);
    }
    (*b)->Finished(id);
  }
  c.p50_ms = Percentile(ms, 0.5);
  c.p99_ms = Percentile(ms, 0.99);
  c.first_layer_p50_ms = Percentile(first_ms, 0.5);
  const double k = 1.0 / reps;
  c.mean.transfer.control_ms *= k;
  c.mean.transfer.queue_ms *= k;
  c.mean.transfer.rma_ms *= k;
  c.mean.transfer.checksum_ms *= k;
  // The raw RMA of the same bytes: the same two chains, alternating, into
  // two distinct registered buffers (the worker's pages alternate too), so
  // neither side reads a cache-resident copy the other does not.
  auto raw = bench::RawRma::Connect(store);
  if (!raw.ok()) return raw.status();
  std::vector<uint8_t> buf(2 * n * size);
  if (auto s = (*raw)->Register(buf.data(), buf.size()); !s.ok()) return s;
  auto x_addrs = (*raw)->PinForGet((*b)->namespace_id(), x);
  auto y_addrs = (*raw)->PinForGet((*b)->namespace_id(), y);
  if (!x_addrs.ok()) return x_addrs.status();
  if (!y_addrs.ok()) return y_addrs.status();
  if (x_addrs->size() != n || y_addrs->size() != n) {
    return absl::InternalError("raw RMA: the store holds fewer blocks");
  }
  std::vector<double> raw_ms;
  for (int r = 0; r < reps + 2; ++r) {
    auto t = Clock::now();
    const auto& addrs = r % 2 ? *y_addrs : *x_addrs;
    if (auto s = (*raw)->Get(addrs, size, buf.data() + (r % 2) * n * size); !s.ok()) return s;
    if (r >= 2) raw_ms.push_back(MsSince(t));
  }
  c.raw_rma_p50_ms = Percentile(raw_ms, 0.5);
  c.rtt_p50_ms = Percentile(rtt, 0.5);
  if (getenv("KVTIER_BENCH_DEBUG")) {
    auto st = control.GetStats();
    for (const auto& h : st->rpc_latency()) {
      if (h.count())
        std::fprintf(stderr, "  store %s: %lu calls, mean %.1f us\n", h.rpc().c_str(), h.count(),
                     double(h.sum_us()) / h.count());
    }
  }
  return c;
}

}  // namespace kvtier::bench
