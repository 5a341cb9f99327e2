// kvtier-bench worker: the worker library end to end -- offload (pool ->
// gather -> staging -> store) and onboard (store -> staging -> scatter ->
// pool) -- beside the plain data-plane put/get of the same blocks in the same
// run (the gap is the worker's overhead), and CPU gather/scatter beside
// memcpy of the same bytes. On a GPU machine the CUDA kernels are measured
// against cudaMemcpy device-to-device (not available here: reported so).
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/raw_rma.h"
#include "bench/worker_latency.h"
#include "client/store_data_client.h"
#include "common/config.h"
#include "common/elapsed.h"
#include "common/log.h"
#include "gpu/kv_layout.h"
#include "worker/connector.h"
#include "worker/model.h"

namespace kvtier::bench {
namespace {

struct Case {
  uint64_t block_bytes = 0;
  double offload_gbps = 0, onboard_gbps = 0, put_gbps = 0, get_gbps = 0;
  double gather_gbps = 0, scatter_gbps = 0, memcpy_gbps = 0;
};

}  // namespace

int RunWorkerBench(int argc, const char* const* argv) {
  uint64_t working_set = 256ull << 20;
  std::string sizes_flag = "1MiB,4MiB", store_bin, data_plane = "socket";
  std::string latency_sizes_flag = "64KiB,1MiB", latency_blocks_flag = "4,16,64";
  int64_t reps = 30, layerwise_layers = 32, latency_layers = 8;
  bool json = false, quick = false, store_hugepages = false;
  FlagSet flags("kvtier-bench worker",
                "Offload/onboard throughput of the worker library beside the plain data plane,\n"
                "and CPU gather/scatter beside memcpy, in one run.");
  flags.Bytes("working-set", &working_set, "Bytes per case");
  flags.String("sizes", &sizes_flag, "Block sizes (multiples of 32 KiB)");
  flags.String("latency-sizes", &latency_sizes_flag, "Block sizes of the load-latency cases");
  flags.String("latency-blocks", &latency_blocks_flag, "Blocks per load of the latency cases");
  flags.Int("reps", &reps, 3, 100000, "Loads measured per latency case");
  flags.Int("latency-layers", &latency_layers, 1, 1024, "Layers of the latency cases' namespace");
  flags.Int("layerwise-layers", &layerwise_layers, 2, 1024,
            "Layers of the layer-wise case (64 blocks of the largest latency size)");
  flags.Bool("quick", &quick, "A reduced run (32 MiB, 1 MiB blocks; fewer latency cases)");
  flags.Choice("data-plane", &data_plane, {"socket", "ucx"},
               "The store's --data-plane (run both to compare them on the same machine)");
  flags.Bool("store-hugepages", &store_hugepages,
             "Run the store with --hugepages (its arena in 2 MiB pages where the host has them "
             "reserved: /proc/sys/vm/nr_hugepages)");
  flags.Bool("json", &json, "Print JSON");
  flags.String("store-bin", &store_bin, "kvtier-store binary [default: next to this one]");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  if (quick) {
    working_set = 32ull << 20;
    sizes_flag = "1MiB";
    latency_sizes_flag = "64KiB";
    latency_blocks_flag = "4,16";
    reps = 5;
  }
  auto latency_sizes = ParseSizeList("latency-sizes", latency_sizes_flag, 32768);
  auto latency_blocks = ParseIntList("latency-blocks", latency_blocks_flag, 1, 4096);
  for (const absl::Status& st : {latency_sizes.status(), latency_blocks.status()}) {
    if (!st.ok()) {
      std::fprintf(stderr, "kvtier-bench worker: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  if (store_bin.empty()) store_bin = DefaultBinary("cachestore", "kvtier-store");
  auto sizes_or = ParseSizeList("sizes", sizes_flag, 32768);
  if (!sizes_or.ok()) {
    std::fprintf(stderr, "kvtier-bench worker: %s\n",
                 std::string(sizes_or.status().message()).c_str());
    return 2;
  }
  const std::vector<uint64_t>& sizes = *sizes_or;
  TempDir dir;
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  // Room in RAM for every case (the latency cases store two chains each), so
  // no load waits for an NVMe promotion.
  uint64_t latency_bytes = 0;
  for (uint64_t size : *latency_sizes) {
    for (int64_t n : *latency_blocks) latency_bytes += 2 * static_cast<uint64_t>(n) * size;
    latency_bytes += 2 * 64 * size;  // the layer-wise case
  }
  setenv("UCX_TLS", "sm,tcp", 0);
  auto store =
      LocalServer::Start(store_bin, dir.sub("store"),
                         {"--data-dir=" + dir.sub("store"),
                          absl::StrCat("--ram-bytes=", (2 * sizes.size() + 1) * working_set +
                                                           64 * max_size + 2 * latency_bytes),
                          absl::StrCat("--ram-slab-bytes=", std::max<uint64_t>(4 << 20, max_size)),
                          "--data-listen=127.0.0.1:0", "--data-plane=" + data_plane,
                          absl::StrCat("--hugepages=", store_hugepages ? "true" : "false")});
  if (!store.ok()) {
    std::fprintf(stderr, "kvtier-bench worker: %s\n",
                 std::string(store.status().message()).c_str());
    return 1;
  }
  std::vector<Case> cases;
  for (uint64_t size : sizes) {
    Case c;
    c.block_bytes = size;
    const uint64_t n = std::max<uint64_t>(16, working_set / size);
    worker::ConnectorOptions o;
    o.spec = SpecFor(size, absl::StrCat("worker-bench-", size));
    o.num_pages = n;
    o.stores = {(*store)->address()};
    o.staging_blocks = 64;
    o.data.deadline_ms = 60000;
    o.offload = "write-through";
    auto a = worker::KvConnector::Create(o);
    o.offload = "none";
    auto b = worker::KvConnector::Create(o);
    if (!a.ok() || !b.ok()) {
      std::fprintf(stderr, "kvtier-bench worker: %s\n",
                   std::string((a.ok() ? b.status() : a.status()).message()).c_str());
      return 1;
    }
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "kvtier-bench worker: %lu-byte blocks: %s\n",
                   static_cast<unsigned long>(size), what.c_str());
      return 1;
    };
    std::vector<BlockHash> chain;
    for (uint64_t i = 0; i < n; ++i) chain.push_back(BlockHash{size, i + 1});
    // Offload: a computed request saved write-through.
    auto m = (*a)->Begin(1, chain);
    auto pages = (*a)->AllocateForCompute(1);
    if (!m.ok() || !pages.ok()) return fail("the offload request did not open");
    for (uint64_t i = 0; i < n; ++i) {
      worker::ComputeIntoPage((*a)->pool().layout(), (*a)->pool().layer_bases(), (*pages)[i],
                              (*a)->namespace_id(), chain[i]);
    }
    auto t = Clock::now();
    if (!(*a)->Save(1).ok() || !(*a)->WaitForSave(1).ok()) return fail("the offload failed");
    c.offload_gbps = n * static_cast<double>(size) / Seconds(t) / 1e9;
    (*a)->Finished(1);
    // Onboard into an empty pool (Begin pins the blocks: it is onboarding time).
    t = Clock::now();
    auto mb = (*b)->Begin(2, chain);
    if (!mb.ok() || mb->store_blocks != n) {
      std::fprintf(stderr, "kvtier-bench worker: the store holds %u of %lu blocks\n",
                   mb.ok() ? mb->store_blocks : 0, n);
      return 1;
    }
    if (!(*b)->StartLoad(2).ok()) return fail("the onboard did not start");
    auto loaded = (*b)->WaitForLoad(2);
    c.onboard_gbps = n * static_cast<double>(size) / Seconds(t) / 1e9;
    if (!loaded.ok() || *loaded != n) return fail("the onboard did not load every block");
    (*b)->Finished(2);
    // The plain data plane on the same store, same block count, batches of 32.
    {
      StoreDataClient dc((*store)->address());
      auto ns = dc.control().RegisterNamespace(SpecFor(size, absl::StrCat("plain-", size)));
      if (!ns.ok()) return fail(std::string(ns.status().message()));
      std::vector<uint8_t> buf(n * size);
      std::memset(buf.data(), 7, buf.size());
      (void)dc.RegisterMemory(buf.data(), buf.size());
      std::vector<std::future<absl::StatusOr<PutOutcome>>> puts;
      t = Clock::now();
      for (uint64_t i = 0; i < n; i += 32) {
        std::vector<PutBlock> blocks;
        for (uint64_t j = i; j < std::min(n, i + 32); ++j)
          blocks.push_back({BlockHash{7, j}, buf.data() + j * size});
        puts.push_back(dc.Put(ns->id, size, blocks));
      }
      uint64_t put_blocks = 0;  // a failed or partial put must not pass for a fast one
      for (auto& f : puts) {
        auto r = f.get();
        if (r.ok()) put_blocks += r->written + r->already_present;
      }
      if (put_blocks != n) return fail(absl::StrCat("plain puts stored ", put_blocks, " of ", n));
      c.put_gbps = n * static_cast<double>(size) / Seconds(t) / 1e9;
      std::vector<std::future<absl::StatusOr<GetOutcome>>> gets;
      t = Clock::now();
      for (uint64_t i = 0; i < n; i += 32) {
        std::vector<GetBlock> blocks;
        for (uint64_t j = i; j < std::min(n, i + 32); ++j)
          blocks.push_back({BlockHash{7, j}, buf.data() + j * size});
        gets.push_back(dc.Get(ns->id, size, blocks));
      }
      uint64_t got_blocks = 0;
      for (auto& f : gets) {
        auto r = f.get();
        if (r.ok()) got_blocks += r->blocks;
      }
      if (got_blocks != n) return fail(absl::StrCat("plain gets read ", got_blocks, " of ", n));
      c.get_gbps = n * static_cast<double>(size) / Seconds(t) / 1e9;
    }
    // CPU gather/scatter of 64-page batches beside memcpy of the same bytes.
    {
      const auto& layout = (*b)->pool().layout();
      std::mt19937_64 rng(9);
      const uint64_t batch = std::min<uint64_t>(64, n);
      std::vector<uint32_t> pg(batch);
      for (auto& p : pg) p = static_cast<uint32_t>(rng() % n);
      std::vector<uint8_t> staging(batch * size), copy(batch * size);
      std::vector<uint8_t*> dst(batch);
      std::vector<const uint8_t*> src(batch);
      for (uint64_t i = 0; i < batch; ++i) {
        dst[i] = staging.data() + i * size;
        src[i] = dst[i];
      }
      const int reps = 5;
      gpu::GatherCpu(layout, (*b)->pool().layer_bases(), pg.data(), batch, dst.data());
      t = Clock::now();
      for (int r = 0; r < reps; ++r)
        gpu::GatherCpu(layout, (*b)->pool().layer_bases(), pg.data(), batch, dst.data());
      c.gather_gbps = reps * batch * static_cast<double>(size) / Seconds(t) / 1e9;
      t = Clock::now();
      for (int r = 0; r < reps; ++r)
        gpu::ScatterCpu(layout, const_cast<uint8_t* const*>((*b)->pool().layer_bases()), pg.data(),
                        batch, src.data());
      c.scatter_gbps = reps * batch * static_cast<double>(size) / Seconds(t) / 1e9;
      std::memcpy(copy.data(), staging.data(), staging.size());
      t = Clock::now();
      for (int r = 0; r < reps; ++r) std::memcpy(copy.data(), staging.data(), staging.size());
      c.memcpy_gbps = reps * staging.size() / Seconds(t) / 1e9;
    }
    cases.push_back(c);
  }
  // Load latency: small loads, where round trips and not bandwidth decide.
  std::vector<LatencyCase> latency;
  for (uint64_t size : *latency_sizes) {
    for (int64_t n : *latency_blocks) {
      auto c = MeasureLatency((*store)->address(), size, static_cast<uint64_t>(n),
                              static_cast<uint32_t>(latency_layers), static_cast<int>(reps));
      if (!c.ok()) {
        std::fprintf(stderr, "kvtier-bench worker: latency of %ld x %s: %s\n", n,
                     FormatBytes(size).c_str(), std::string(c.status().message()).c_str());
        return 1;
      }
      latency.push_back(*c);
    }
  }
  // Layer-wise: a deep namespace, 64 blocks of the largest latency size.
  const uint64_t lw_size = *std::max_element(latency_sizes->begin(), latency_sizes->end());
  auto layerwise = MeasureLatency((*store)->address(), lw_size, quick ? 16 : 64,
                                  static_cast<uint32_t>(layerwise_layers),
                                  static_cast<int>(std::min<int64_t>(reps, 10)));
  if (!layerwise.ok()) {
    std::fprintf(stderr, "kvtier-bench worker: layer-wise case: %s\n",
                 std::string(layerwise.status().message()).c_str());
    return 1;
  }
  const bool gpu = gpu::CudaAvailable();
  if (json) {
    nlohmann::json j;
    for (const auto& c : latency) {
      j["latency"].push_back({{"block_bytes", c.block_bytes},
                              {"blocks", c.blocks},
                              {"layers", c.layers},
                              {"load_p50_ms", c.p50_ms},
                              {"load_p99_ms", c.p99_ms},
                              {"raw_rma_p50_ms", c.raw_rma_p50_ms},
                              {"rtt_p50_ms", c.rtt_p50_ms},
                              {"target_ms", c.target_ms()},
                              {"ratio_vs_target", c.p50_ms / c.target_ms()},
                              {"pin_ms", c.mean.transfer.control_ms},
                              {"lane_wait_ms", c.mean.transfer.queue_ms},
                              {"rma_ms", c.mean.transfer.rma_ms},
                              {"checksum_ms", c.mean.transfer.checksum_ms}});
    }
    j["layerwise"] = {{"layers", layerwise->layers},
                      {"blocks", layerwise->blocks},
                      {"block_bytes", layerwise->block_bytes},
                      {"first_layer_p50_ms", layerwise->first_layer_p50_ms},
                      {"all_layers_p50_ms", layerwise->p50_ms},
                      {"first_over_all", layerwise->first_layer_p50_ms / layerwise->p50_ms}};
    for (const auto& c : cases) {
      j["cases"].push_back({{"block_bytes", c.block_bytes},
                            {"offload_gb_per_s", c.offload_gbps},
                            {"dataplane_put_gb_per_s", c.put_gbps},
                            {"offload_overhead", 1 - c.offload_gbps / c.put_gbps},
                            {"onboard_gb_per_s", c.onboard_gbps},
                            {"dataplane_get_gb_per_s", c.get_gbps},
                            {"onboard_overhead", 1 - c.onboard_gbps / c.get_gbps},
                            {"gather_gb_per_s", c.gather_gbps},
                            {"scatter_gb_per_s", c.scatter_gbps},
                            {"memcpy_gb_per_s", c.memcpy_gbps},
                            {"gather_ratio_vs_memcpy", c.gather_gbps / c.memcpy_gbps},
                            {"scatter_ratio_vs_memcpy", c.scatter_gbps / c.memcpy_gbps}});
    }
    j["gpu"] = gpu ? "present" : "none: CUDA gather/scatter not measured";
    j["data_plane"] = data_plane;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "kvtier-bench worker: %s per case through a kvtier-store on loopback "
      "(--data-plane %s)\n\n",
      FormatBytes(working_set).c_str(), data_plane.c_str());
  std::printf("%9s | %8s %8s %8s | %8s %8s %8s | %8s %8s %8s %6s %6s\n", "block", "offload", "put",
              "overhd", "onboard", "get", "overhd", "gather", "scatter", "memcpy", "g/m", "s/m");
  for (const auto& c : cases) {
    std::printf("%9s | %8.2f %8.2f %7.0f%% | %8.2f %8.2f %7.0f%% | %8.2f %8.2f %8.2f %6.2f %6.2f\n",
                FormatBytes(c.block_bytes).c_str(), c.offload_gbps, c.put_gbps,
                100 * (1 - c.offload_gbps / c.put_gbps), c.onboard_gbps, c.get_gbps,
                100 * (1 - c.onboard_gbps / c.get_gbps), c.gather_gbps, c.scatter_gbps,
                c.memcpy_gbps, c.gather_gbps / c.memcpy_gbps, c.scatter_gbps / c.memcpy_gbps);
  }
  std::printf(
      "\n(GB/s; overhead = 1 - worker / plain data plane; g/m, s/m = gather, scatter vs memcpy)\n");
  std::printf(
      "\nload latency (Begin -> WaitForLoad, %ld loads each; target = raw RMA + 1.5 round trips)\n",
      reps);
  std::printf("%9s %6s | %8s %8s | %8s %8s %8s %6s | %7s %7s %7s %7s\n", "block", "blocks",
              "p50 ms", "p99 ms", "raw RMA", "RTT", "target", "ratio", "pin", "lane", "RMA", "sum");
  for (const auto& c : latency) {
    std::printf("%9s %6lu | %8.3f %8.3f | %8.3f %8.3f %8.3f %6.2f | %7.3f %7.3f %7.3f %7.3f\n",
                FormatBytes(c.block_bytes).c_str(), c.blocks, c.p50_ms, c.p99_ms, c.raw_rma_p50_ms,
                c.rtt_p50_ms, c.target_ms(), c.p50_ms / c.target_ms(), c.mean.transfer.control_ms,
                c.mean.transfer.queue_ms, c.mean.transfer.rma_ms, c.mean.transfer.checksum_ms);
  }
  std::printf(
      "(ratio = p50 / target, <= 1 meets it; pin, lane, RMA, sum: mean ms per load in "
      "the pin round trip, waiting for a lane, RMA, checksums)\n");
  std::printf(
      "\nlayer-wise load, %u layers, %lu x %s: first layer in %.3f ms, all layers %.3f ms "
      "(%.3f of the whole; target <= 0.125)\n",
      layerwise->layers, layerwise->blocks, FormatBytes(layerwise->block_bytes).c_str(),
      layerwise->first_layer_p50_ms, layerwise->p50_ms,
      layerwise->first_layer_p50_ms / layerwise->p50_ms);
  std::printf("GPU: %s\n",
              gpu ? "present (see gpu_cuda_test for correctness)"
                  : "none on this machine: CUDA gather/scatter vs cudaMemcpy not measured");
  return 0;
}

}  // namespace kvtier::bench
