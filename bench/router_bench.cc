// kvtier-bench router: Route latency in-process and over loopback gRPC for
// 32k-token prompts (2,000 blocks of 16 tokens) against an index of >= 10 M
// blocks spread over 8, 64 and 1,000 workers; event ingestion rate; memory
// per indexed block. References in the same run: a round-robin pick over the
// same gRPC path (the transport floor) and a bare hash-map walk of the same
// chain (the in-process floor). Single-threaded figures are per core.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/config.h"
#include "common/limits.h"
#include "common/log.h"
#include "router/router_core.h"
#include "router/service.h"
#include "router/wire.h"

namespace kvtier::bench {
namespace {

constexpr uint64_t kNs = 0x1234;
constexpr uint32_t kBlockTokens = 16;

BlockHash ChainHash(uint64_t chain, uint64_t i) {
  return BlockHash{(chain + 1) * 0x9E3779B97F4A7C15ull, i};
}

v1::Hello WorkerHello(int w) {
  v1::Hello h;
  h.set_source_id(absl::StrCat("worker-", w));
  h.set_kind(v1::SOURCE_WORKER);
  h.set_endpoint(absl::StrCat("10.0.", w / 256, ".", w % 256, ":8000"));
  h.set_namespace_id(kNs);
  h.set_block_tokens(kBlockTokens);
  h.set_epoch(1);
  return h;
}

struct Percentiles {
  double p50_us = 0, p99_us = 0, mean_us = 0;
};

Percentiles Summarize(std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  Percentiles p;
  p.p50_us = us[us.size() / 2];
  p.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  double sum = 0;
  for (double x : us) sum += x;
  p.mean_us = sum / us.size();
  return p;
}

struct Case {
  int workers;
  uint64_t blocks;
  double build_s = 0;
  double events_per_s = 0;  // block events applied per second, one core
  double bytes_per_block = 0, rss_per_block = 0;
  Percentiles inproc, grpc, floor_inproc, floor_grpc;
  Percentiles linear_inproc;  // the same routes, matching by walking every block
};

v1::RouteRequest Request(uint64_t chain, uint32_t matched, uint32_t blocks, uint64_t salt) {
  v1::RouteRequest r;
  r.set_namespace_id(kNs);
  auto* hs = r.mutable_hashes();
  for (uint32_t i = 0; i < blocks; ++i) {
    BlockHash h = i < matched ? ChainHash(chain, i) : BlockHash{salt, 0xdead0000ull + i};
    auto* p = hs->add_hashes();
    p->set_hi(h.hi);
    p->set_lo(h.lo);
  }
  return r;
}

// A router that picks round-robin: the same gRPC path with no index work.
class RoundRobinService final : public v1::Router::Service {
 public:
  grpc::Status Route(grpc::ServerContext*, const v1::RouteRequest*,
                     v1::RouteResponse* resp) override {
    resp->set_worker_id(absl::StrCat("worker-", next_++ % 8));
    return grpc::Status::OK;
  }

 private:
  std::atomic<uint64_t> next_{0};
};

absl::StatusOr<Case> Run(int workers, uint64_t target_blocks, int requests, uint32_t blocks_per_req,
                         uint64_t queued_tokens, uint64_t pending_ms, double offloaded) {
  Case c;
  c.workers = workers;
  router::RouterOptions o;
  o.pending_ms = pending_ms;
  std::vector<router::RouterCommand> cmds;
  // Chains of blocks_per_req blocks, one worker each (chain % workers),
  // published as BlockStored events of `batch` blocks; returns the events.
  const uint64_t chains = std::max<uint64_t>(1, target_blocks / blocks_per_req);
  auto feed = [&](router::RouterCore& core, uint32_t batch) -> absl::StatusOr<uint64_t> {
    std::mt19937_64 load_rng(5);  // the same queues for the reference router
    for (int w = 0; w < workers; ++w) {
      const router::SourceHello hello = router::FromWire(WorkerHello(w));
      if (auto s = core.Hello(hello, &cmds); !s.ok()) return s;
      router::SnapshotChunk snap;
      snap.last = true;
      if (auto s = core.Handle(hello.source_id, snap, &cmds); !s.ok()) return s;
      if (queued_tokens > 0) {
        router::SourceLoad hb;
        hb.queued_prefill_tokens = load_rng() % queued_tokens;
        if (auto s = core.Handle(hello.source_id, hb, &cmds); !s.ok()) return s;
      }
    }
    std::vector<uint64_t> seq(workers, 0);
    uint64_t events = 0;
    for (uint64_t ch = 0; ch < chains; ++ch) {
      int w = static_cast<int>(ch % workers);
      std::string id = WorkerHello(w).source_id();
      for (uint32_t off = 0; off < blocks_per_req; off += batch) {
        router::BlockEvent e;
        e.seq = ++seq[w];
        e.kind = router::BlockEvent::Kind::kStored;
        e.namespace_id = kNs;
        for (uint32_t i = off; i < std::min(blocks_per_req, off + batch); ++i) {
          e.hashes.push_back(ChainHash(ch, i));
        }
        events += e.hashes.size();
        if (auto s = core.Handle(id, std::move(e), &cmds); !s.ok()) return s;
      }
      // The chain's tail evicted from the GPU to the worker's CPU tier.
      const auto off = static_cast<uint32_t>(offloaded * blocks_per_req);
      for (uint32_t from = blocks_per_req - off; from < blocks_per_req; from += batch) {
        router::BlockEvent e;
        e.seq = ++seq[w];
        e.kind = router::BlockEvent::Kind::kMedium;
        e.medium = router::Medium::kCpu;
        e.namespace_id = kNs;
        for (uint32_t i = from; i < std::min(blocks_per_req, from + batch); ++i) {
          e.hashes.push_back(ChainHash(ch, i));
        }
        if (auto s = core.Handle(id, std::move(e), &cmds); !s.ok()) return s;
      }
    }
    return events;
  };
  router::RouterCore core(o);
  const uint64_t rss0 = RssBytes();
  auto start = Clock::now();
  auto fed = feed(core, 16);  // 16 blocks: one engine block batch
  if (!fed.ok()) return fed.status();
  const uint64_t events = *fed;
  c.build_s = Seconds(start);
  c.events_per_s = events / c.build_s;
  c.blocks = core.Stats().indexed_blocks;
  c.bytes_per_block = static_cast<double>(core.IndexMemoryBytes()) / c.blocks;
  c.rss_per_block = static_cast<double>(RssBytes() - rss0) / c.blocks;

  std::mt19937_64 rng(7);
  std::vector<v1::RouteRequest> reqs;
  for (int i = 0; i < requests; ++i) {
    uint64_t ch = rng() % chains;
    reqs.push_back(
        Request(ch, static_cast<uint32_t>(rng() % blocks_per_req), blocks_per_req, rng()));
  }
  // In-process Route.
  std::vector<double> us;
  for (const auto& r : reqs) {
    auto t = Clock::now();
    auto res = core.Route(router::FromWire(r));
    us.push_back(Seconds(t) * 1e6);
    if (!res.ok()) return res.status();
  }
  c.inproc = Summarize(us);
  // The reference: the same routes on a router matching by the linear walk
  // (the same index, fed the same events).
  {
    router::RouterOptions lo = o;
    lo.linear_match = true;
    router::RouterCore linear(lo);
    if (auto fed_linear = feed(linear, 1024); !fed_linear.ok()) return fed_linear.status();
    if (linear.Stats().indexed_blocks != c.blocks) {
      return absl::InternalError("the reference router indexed other blocks than the measured one");
    }
    us.clear();
    for (const auto& r : reqs) {
      auto t = Clock::now();
      auto res = linear.Route(router::FromWire(r));
      us.push_back(Seconds(t) * 1e6);
      if (!res.ok()) return res.status();
    }
    c.linear_inproc = Summarize(us);
  }
  // In-process floor: the same chain walked in a bare hash set of all blocks.
  {
    absl::flat_hash_set<BlockKey, BlockKeyHasher> plain;
    plain.reserve(c.blocks);
    for (uint64_t ch = 0; ch < chains; ++ch) {
      for (uint32_t i = 0; i < blocks_per_req; ++i) plain.insert(BlockKey{kNs, ChainHash(ch, i)});
    }
    us.clear();
    uint64_t sink = 0;
    for (const auto& r : reqs) {
      auto t = Clock::now();
      for (const auto& h : r.hashes().hashes()) {
        if (!plain.contains(BlockKey{kNs, BlockHash{h.hi(), h.lo()}})) break;
        ++sink;
      }
      us.push_back(Seconds(t) * 1e6);
    }
    c.floor_inproc = Summarize(us);
    if (sink == 42) std::fprintf(stderr, " ");
  }
  // Over loopback gRPC: the real service, then round-robin on the same path.
  auto over_grpc = [&](grpc::Service* svc) -> absl::StatusOr<Percentiles> {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(svc);
    auto server = b.BuildAndStart();
    if (!server) return absl::UnavailableError("cannot start an in-process gRPC server");
    auto stub = v1::Router::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    std::vector<double> lat;
    for (int i = 0; i < requests + 50; ++i) {
      grpc::ClientContext ctx;
      v1::RouteResponse resp;
      auto t = Clock::now();
      auto s = stub->Route(&ctx, reqs[i % reqs.size()], &resp);
      if (i >= 50) lat.push_back(Seconds(t) * 1e6);  // the first calls warm the channel
      if (!s.ok()) return absl::InternalError(s.error_message());
    }
    server->Shutdown();
    return Summarize(lat);
  };
  router::RouterService service(&core);
  auto g = over_grpc(&service);
  if (!g.ok()) return g.status();
  c.grpc = *g;
  RoundRobinService rr;
  auto f = over_grpc(&rr);
  if (!f.ok()) return f.status();
  c.floor_grpc = *f;
  return c;
}

}  // namespace

int RunRouterFleetCases(const std::vector<int64_t>& fleet, int64_t stores, int64_t blocks,
                        const std::string& trace_path, const std::string& inproc_rates,
                        const std::string& grpc_rates, double seconds, int64_t threads, bool json);

int RunRouterBench(int argc, const char* const* argv) {
  int64_t blocks = 10'000'000;
  int64_t requests = 2000;
  int64_t prompt_blocks = 2000;
  std::string workers_list = "8,64,1000";
  bool quick = false, json = false;
  double offloaded = 0;
  std::string fleet_list, trace = KVTIER_SOURCE_DIR "/bench/traces/conversation_trace.jsonl";
  std::string inproc_rates = "50000,100000,150000,200000", grpc_rates = "1000,2000,4000,8000";
  int64_t stores = 4, threads = 1, fleet_ms = 1000, queued_tokens = 0;
  int64_t pending_ms = static_cast<int64_t>(router::RouterOptions{}.pending_ms);
  FlagSet flags("kvtier-bench router",
                "Route latency (in-process and over gRPC), event ingestion rate and memory per\n"
                "indexed block of the router's index, beside a bare hash walk and a round-robin\n"
                "router on the same gRPC path. With --fleet: a fleet of simulated workers and\n"
                "store shards fed from the trace, routes issued open-loop at target rates.");
  flags.Int("queued-tokens", &queued_tokens, 0, int64_t{1} << 32,
            "Workers report queues of 0..N-1 prefill tokens in a heartbeat (0: idle workers)");
  flags.String("fleet", &fleet_list,
               "Comma-separated fleet sizes (workers) for the open-loop fleet run");
  flags.Int("stores", &stores, 0, 1024, "Store shards in the fleet run");
  flags.String("trace", &trace, "Trace the fleet run replays (Mooncake JSONL)");
  flags.String("inproc-rates", &inproc_rates, "Target routes/s in process (fleet run)");
  flags.String("grpc-rates", &grpc_rates, "Target routes/s over loopback gRPC (fleet run)");
  flags.Int("threads", &threads, 1, 256, "Client threads in process, one per core (fleet run)");
  flags.Int("fleet-ms", &fleet_ms, 50, 600000, "Milliseconds per rate (fleet run)");
  flags.Int("blocks", &blocks, 1000, int64_t{1} << 32, "Indexed blocks");
  flags.Int("requests", &requests, 10, 1 << 24, "Route calls per case");
  flags.Int("prompt-blocks", &prompt_blocks, 1, static_cast<int64_t>(limits::kMaxPromptBlocks),
            "Blocks per prompt (16 tokens each)");
  flags.String("workers", &workers_list, "Comma-separated worker counts");
  flags.Int("pending", &pending_ms, 0, 60000,
            "Milliseconds a routed prompt's blocks count as pending on its worker (0: off)");
  flags.Double("offloaded", &offloaded, 0, 1,
               "Share of each chain's blocks (its tail) its worker holds on its CPU tier only");
  flags.Bool("quick", &quick, "A reduced run (200k blocks, 200 requests)");
  flags.Bool("json", &json, "Print JSON");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  if (quick) {
    blocks = std::min<int64_t>(blocks, 200000);
    requests = std::min<int64_t>(requests, 200);
  }
  if (!fleet_list.empty()) {
    auto fleet = ParseIntList("fleet", fleet_list, 1, 100000);
    if (!fleet.ok()) {
      std::fprintf(stderr, "kvtier-bench router: %s\n",
                   std::string(fleet.status().message()).c_str());
      return 2;
    }
    return RunRouterFleetCases(*fleet, stores, blocks, trace, inproc_rates, grpc_rates,
                               fleet_ms / 1000.0, threads, json);
  }
  std::vector<Case> cases;
  auto workers = ParseIntList("workers", workers_list, 1, 100000);
  if (!workers.ok()) {
    std::fprintf(stderr, "kvtier-bench router: %s\n",
                 std::string(workers.status().message()).c_str());
    return 2;
  }
  for (int64_t w : *workers) {
    int n = static_cast<int>(w);
    auto c =
        Run(n, blocks, static_cast<int>(requests), static_cast<uint32_t>(prompt_blocks),
            static_cast<uint64_t>(queued_tokens), static_cast<uint64_t>(pending_ms), offloaded);
    if (!c.ok()) {
      std::fprintf(stderr, "kvtier-bench router: %s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    cases.push_back(*c);
    if (!json) std::fprintf(stderr, "  %d workers done\n", n);
  }
  if (json) {
    nlohmann::json j;
    for (const auto& c : cases) {
      j["cases"].push_back(
          {{"workers", c.workers},
           {"indexed_blocks", c.blocks},
           {"route_inproc_p50_us", c.inproc.p50_us},
           {"route_inproc_p99_us", c.inproc.p99_us},
           {"linear_walk_inproc_p50_us", c.linear_inproc.p50_us},
           {"linear_walk_inproc_p99_us", c.linear_inproc.p99_us},
           {"ratio_inproc_p99_vs_linear_walk", c.inproc.p99_us / c.linear_inproc.p99_us},
           {"walk_floor_p99_us", c.floor_inproc.p99_us},
           {"route_grpc_p50_us", c.grpc.p50_us},
           {"route_grpc_p99_us", c.grpc.p99_us},
           {"round_robin_grpc_p99_us", c.floor_grpc.p99_us},
           {"ratio_grpc_p99_vs_round_robin", c.grpc.p99_us / c.floor_grpc.p99_us},
           {"block_events_per_s", c.events_per_s},
           {"index_bytes_per_block", c.bytes_per_block},
           {"rss_bytes_per_block", c.rss_per_block}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("kvtier-bench router: prompts of %ld blocks x %u tokens, %ld requests per case\n\n",
              prompt_blocks, kBlockTokens, requests);
  std::printf("%8s %11s | %21s %21s %6s %14s | %21s %19s %6s | %12s | %8s %8s\n", "workers",
              "blocks", "Route in-proc p50/p99", "linear walk p50/p99", "ratio", "bare walk p99",
              "Route gRPC p50/p99", "round-robin p99", "ratio", "events/s", "B/block", "RSS B/b");
  for (const auto& c : cases) {
    std::printf(
        "%8d %11lu | %9.1f / %7.1f us %9.1f / %7.1f us %6.2f %11.1f us | %9.1f / %7.1f us %16.1f "
        "us %6.2f | %12.0f | %8.0f %8.0f\n",
        c.workers, c.blocks, c.inproc.p50_us, c.inproc.p99_us, c.linear_inproc.p50_us,
        c.linear_inproc.p99_us, c.inproc.p99_us / c.linear_inproc.p99_us, c.floor_inproc.p99_us,
        c.grpc.p50_us, c.grpc.p99_us, c.floor_grpc.p99_us, c.grpc.p99_us / c.floor_grpc.p99_us,
        c.events_per_s, c.bytes_per_block, c.rss_per_block);
  }
  std::printf(
      "\n(single-threaded: figures are per core; ratios = Route in-proc p99 / the same routes "
      "matched by the linear walk, Route gRPC p99 / round-robin gRPC p99)\n");
  return 0;
}

}  // namespace kvtier::bench
