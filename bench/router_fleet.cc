// kvtier-bench router --fleet: the router in front of a fleet. N simulated
// workers and S store shards are fed the block events of a replay of the
// shipped trace, scaled up: the trace is copied (each copy salted, so
// copies share no block) until the index holds --blocks blocks, every
// 512-token trace block becomes 32 router blocks of 16 tokens, a request's
// blocks are stored on the worker its conversation lands on (its second
// trace block picks it; the first is the trace's shared system prompt), and
// every block is written through to the store shard its hash picks; each
// worker reports a queue of 0-32k prefill tokens in a heartbeat. Then
// routes for the trace's prompts are issued open-loop at target rates from
// one client thread per core; latency counts from each route's scheduled
// time, so a router that falls behind pays for its queue. In process and
// over loopback gRPC, beside a router matching by the linear walk (the
// reference) in the same run.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "bench/trace.h"
#include "common/config.h"
#include "common/log.h"
#include "router/router_core.h"
#include "router/service.h"
#include "router/wire.h"

namespace kvtier::bench {
namespace {

constexpr uint64_t kNs = 0x5eed;
constexpr uint32_t kBlockTokens = 16;
constexpr uint32_t kSubBlocks = kTraceBlockTokens / kBlockTokens;  // router blocks per trace block

uint64_t Mix(uint64_t x) { return Mix64(x); }

// The router block `sub` of trace block `id` in trace copy `copy`.
BlockHash FleetHash(uint64_t copy, uint64_t id, uint32_t sub) {
  return BlockHash{Mix(copy * 0x9E3779B97F4A7C15ull + id + 1), (id << 8) | sub};
}

struct RatePoint {
  double target = 0, achieved = 0;
  double p50_us = 0, p99_us = 0, p999_us = 0;
  uint64_t errors = 0;
  uint64_t unsent = 0;  // scheduled routes not sent by the hard stop
};

struct FleetCase {
  int workers = 0, stores = 0;
  uint64_t blocks = 0, replicas = 0, copies = 0;
  double events_per_s = 0, rss_per_block = 0;
  double mean_prompt_blocks = 0;
  std::vector<RatePoint> inproc, linear, grpc;
};

v1::Hello SourceHello(const std::string& id, bool store) {
  v1::Hello h;
  h.set_source_id(id);
  h.set_kind(store ? v1::SOURCE_STORE : v1::SOURCE_WORKER);
  h.set_endpoint(absl::StrCat(id, ":8000"));
  h.set_namespace_id(kNs);
  h.set_block_tokens(kBlockTokens);
  h.set_epoch(1);
  return h;
}

// Runs route(thread, prompt) open-loop at `rate` per second for `seconds`
// from `threads` threads (each at rate / threads, on its own schedule).
template <class RouteFn>
RatePoint OpenLoop(double rate, double seconds, int threads, size_t prompts, RouteFn route) {
  std::vector<std::vector<double>> lat(threads);
  std::atomic<uint64_t> errors{0};
  const auto start = Clock::now() + std::chrono::milliseconds(5);
  const auto stop =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  // A router slower than the rate is not waited for past twice the time:
  // the routes not sent by then count against the achieved rate.
  const auto hard_stop = stop + (stop - start);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      const auto gap = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(threads / rate));
      auto due = start + gap * t / threads;
      uint64_t i = t * 7919;
      auto& mine = lat[t];
      mine.reserve(static_cast<size_t>(rate * seconds / threads) + 16);
      while (due < stop && Clock::now() < hard_stop) {
        // Sleep through long gaps (16 callers spinning would starve the
        // server on 2 cores), spin the last 50 us.
        if (due - Clock::now() > std::chrono::microseconds(200)) {
          std::this_thread::sleep_until(due - std::chrono::microseconds(50));
        }
        while (Clock::now() < due) {
        }
        if (!route(t, i++ % prompts)) errors++;
        mine.push_back(std::chrono::duration<double, std::micro>(Clock::now() - due).count());
        due += gap;
      }
    });
  }
  for (auto& t : ts) t.join();
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  RatePoint p;
  p.target = rate;
  p.achieved = all.size() / std::max(took, seconds);
  p.unsent = static_cast<uint64_t>(std::max(0.0, rate * seconds - all.size()));
  p.p50_us = Percentile(all, 0.5);
  p.p99_us = Percentile(all, 0.99);
  p.p999_us = Percentile(all, 0.999);
  p.errors = errors;
  return p;
}

absl::StatusOr<FleetCase> RunFleet(const std::vector<TraceRequest>& trace, int workers, int stores,
                                   uint64_t target_blocks, const std::vector<double>& inproc_rates,
                                   const std::vector<double>& grpc_rates, double seconds,
                                   int threads) {
  FleetCase c;
  c.workers = workers;
  c.stores = stores;
  // Distinct trace blocks per copy -> copies for the target index size.
  absl::flat_hash_set<uint64_t> ids;
  for (const auto& r : trace) ids.insert(r.hash_ids.begin(), r.hash_ids.end());
  c.copies = std::max<uint64_t>(1, target_blocks / (ids.size() * kSubBlocks));

  std::vector<std::string> worker_ids, store_ids;
  for (int w = 0; w < workers; ++w) worker_ids.push_back(absl::StrCat("worker-", w));
  for (int s = 0; s < stores; ++s) store_ids.push_back(absl::StrCat("store-", s));
  auto feed = [&](router::RouterCore& core) -> absl::StatusOr<uint64_t> {
    std::vector<router::RouterCommand> cmds;
    router::SnapshotChunk snap;
    snap.last = true;
    // Each worker's queue at its last heartbeat: a busy fleet's spread of
    // 0-32k prefill tokens (the same for the reference router).
    std::mt19937_64 load_rng(5);
    for (const auto& id : worker_ids) {
      if (auto s = core.Hello(router::FromWire(SourceHello(id, false)), &cmds); !s.ok()) return s;
      if (auto s = core.Handle(id, snap, &cmds); !s.ok()) return s;
      router::SourceLoad hb;
      hb.queued_prefill_tokens = load_rng() % 32768;
      if (auto s = core.Handle(id, hb, &cmds); !s.ok()) return s;
    }
    for (const auto& id : store_ids) {
      if (auto s = core.Hello(router::FromWire(SourceHello(id, true)), &cmds); !s.ok()) return s;
      if (auto s = core.Handle(id, snap, &cmds); !s.ok()) return s;
    }
    std::vector<uint64_t> wseq(workers, 0), sseq(stores, 0);
    std::vector<router::BlockEvent> to_store(stores);
    uint64_t events = 0;
    for (uint64_t copy = 0; copy < c.copies; ++copy) {
      for (const auto& r : trace) {
        if (r.hash_ids.empty()) continue;
        const uint64_t conv = r.hash_ids[std::min<size_t>(1, r.hash_ids.size() - 1)];
        const int w = static_cast<int>(Mix(copy * 131 + conv) % workers);
        router::BlockEvent m;
        m.seq = ++wseq[w];
        m.kind = router::BlockEvent::Kind::kStored;
        m.namespace_id = kNs;
        for (auto& e : to_store) e.hashes.clear();
        for (uint64_t id : r.hash_ids) {
          for (uint32_t sub = 0; sub < kSubBlocks; ++sub) {
            const BlockHash h = FleetHash(copy, id, sub);
            m.hashes.push_back(h);
            if (stores > 0) to_store[Mix(h.hi ^ h.lo) % stores].hashes.push_back(h);
          }
        }
        events += m.hashes.size();
        if (auto s = core.Handle(worker_ids[w], std::move(m), &cmds); !s.ok()) return s;
        for (int s = 0; s < stores; ++s) {
          router::BlockEvent& e = to_store[s];
          if (e.hashes.empty()) continue;
          e.seq = ++sseq[s];
          e.kind = router::BlockEvent::Kind::kStored;
          e.namespace_id = kNs;
          events += e.hashes.size();
          if (auto st2 = core.Handle(store_ids[s], e, &cmds); !st2.ok()) return st2;
        }
      }
    }
    return events;
  };
  router::RouterOptions o;
  router::RouterCore core(o);
  const uint64_t rss0 = RssBytes();
  auto t0 = Clock::now();
  auto fed = feed(core);
  if (!fed.ok()) return fed.status();
  c.events_per_s = *fed / Seconds(t0);
  auto stats = core.Stats();
  c.blocks = stats.indexed_blocks;
  c.replicas = stats.indexed_replicas;
  c.rss_per_block = static_cast<double>(RssBytes() - rss0) / c.blocks;

  // Prompts: the trace's requests from random copies, as hash chains. A
  // pool small enough to stay in cache, as a request just parsed would be.
  std::mt19937_64 rng(11);
  std::vector<v1::RouteRequest> prompts;
  uint64_t prompt_blocks = 0;
  for (int i = 0; i < 256; ++i) {
    const auto& r = trace[rng() % trace.size()];
    const uint64_t copy = rng() % c.copies;
    v1::RouteRequest q;
    q.set_namespace_id(kNs);
    q.set_max_candidates(4);
    for (uint64_t id : r.hash_ids) {
      for (uint32_t sub = 0; sub < kSubBlocks; ++sub) {
        const BlockHash h = FleetHash(copy, id, sub);
        auto* p = q.mutable_hashes()->add_hashes();
        p->set_hi(h.hi);
        p->set_lo(h.lo);
      }
    }
    if (q.hashes().hashes_size() == 0) continue;
    prompt_blocks += q.hashes().hashes_size();
    prompts.push_back(std::move(q));
  }
  c.mean_prompt_blocks = static_cast<double>(prompt_blocks) / prompts.size();
  auto sweep = [&](router::RouterCore& r, const std::vector<double>& rates,
                   std::vector<RatePoint>* out) {
    // Warm up (page faults, caches) at the first rate, unmeasured.
    OpenLoop(rates.front(), std::min(seconds, 0.2), threads, prompts.size(),
             [&](int, size_t i) { return r.Route(router::FromWire(prompts[i])).ok(); });
    for (double rate : rates) {
      out->push_back(OpenLoop(rate, seconds, threads, prompts.size(), [&](int, size_t i) {
        return r.Route(router::FromWire(prompts[i])).ok();
      }));
    }
  };
  sweep(core, inproc_rates, &c.inproc);
  {
    router::RouterOptions lo = o;
    lo.linear_match = true;
    router::RouterCore linear(lo);
    if (auto f = feed(linear); !f.ok()) return f.status();
    sweep(linear, inproc_rates, &c.linear);
  }
  // Over loopback gRPC: the real service, called from 16 threads with a
  // channel each (a synchronous call holds its thread for a round trip).
  router::RouterService service(&core);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  auto server = b.BuildAndStart();
  if (!server) return absl::UnavailableError("cannot start an in-process gRPC server");
  const int callers = 16;
  std::vector<std::unique_ptr<v1::Router::Stub>> stubs;
  for (int i = 0; i < callers; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("kvtier-channel", i);  // a channel (connection) each
    stubs.push_back(v1::Router::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args)));
  }
  for (double rate : grpc_rates) {
    c.grpc.push_back(OpenLoop(rate, seconds, callers, prompts.size(), [&](int t, size_t i) {
      grpc::ClientContext ctx;
      v1::RouteResponse resp;
      return stubs[t]->Route(&ctx, prompts[i], &resp).ok();
    }));
  }
  server->Shutdown();
  return c;
}

std::vector<double> Rates(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

// Flags are parsed by RunRouterBench; this runs the fleet cases.
int RunRouterFleetCases(const std::vector<int64_t>& fleet, int64_t stores, int64_t blocks,
                        const std::string& trace_path, const std::string& inproc_rates,
                        const std::string& grpc_rates, double seconds, int64_t threads, bool json) {
  auto trace = ReadTrace(trace_path);
  if (!trace.ok()) {
    std::fprintf(stderr, "kvtier-bench router: %s\n",
                 std::string(trace.status().message()).c_str());
    return 2;
  }
  auto in_rates = ParseIntList("inproc-rates", inproc_rates, 1, 100'000'000);
  auto g_rates = ParseIntList("grpc-rates", grpc_rates, 1, 100'000'000);
  for (const auto* r : {&in_rates, &g_rates}) {
    if (!r->ok()) {
      std::fprintf(stderr, "kvtier-bench router: %s\n", std::string(r->status().message()).c_str());
      return 2;
    }
  }
  std::vector<FleetCase> cases;
  for (int64_t w : fleet) {
    auto c = RunFleet(*trace, static_cast<int>(w), static_cast<int>(stores),
                      static_cast<uint64_t>(blocks), Rates(*in_rates), Rates(*g_rates), seconds,
                      static_cast<int>(threads));
    if (!c.ok()) {
      std::fprintf(stderr, "kvtier-bench router: %s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    cases.push_back(*c);
    if (!json) std::fprintf(stderr, "  fleet of %ld workers done\n", w);
  }
  auto point_json = [](const RatePoint& p) {
    return nlohmann::json{{"target_per_s", p.target}, {"achieved_per_s", p.achieved},
                          {"p50_us", p.p50_us},       {"p99_us", p.p99_us},
                          {"p999_us", p.p999_us},     {"errors", p.errors},
                          {"unsent", p.unsent}};
  };
  // The highest target rate met (achieved >= 95 %) with p99 within `bound_us`.
  auto best = [](const std::vector<RatePoint>& pts, double bound_us) {
    double r = 0;
    for (const auto& p : pts) {
      if (p.achieved >= 0.95 * p.target && p.p99_us <= bound_us && p.errors == 0 && p.unsent == 0) {
        r = std::max(r, p.achieved);
      }
    }
    return r;
  };
  if (json) {
    nlohmann::json j;
    for (const auto& c : cases) {
      nlohmann::json cj = {{"workers", c.workers},
                           {"stores", c.stores},
                           {"indexed_blocks", c.blocks},
                           {"indexed_replicas", c.replicas},
                           {"trace_copies", c.copies},
                           {"mean_prompt_blocks", c.mean_prompt_blocks},
                           {"block_events_per_s", c.events_per_s},
                           {"rss_bytes_per_block", c.rss_per_block},
                           {"client_threads", threads},
                           {"best_inproc_per_s_p99_1ms", best(c.inproc, 1000)},
                           {"best_linear_walk_per_s_p99_1ms", best(c.linear, 1000)},
                           {"best_grpc_per_s_p99_5ms", best(c.grpc, 5000)}};
      for (const auto& p : c.inproc) cj["inproc"].push_back(point_json(p));
      for (const auto& p : c.linear) cj["linear_walk"].push_back(point_json(p));
      for (const auto& p : c.grpc) cj["grpc"].push_back(point_json(p));
      j["fleet"].push_back(cj);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  for (const auto& c : cases) {
    std::printf(
        "fleet: %d workers, %d store shards, %lu blocks (%lu replicas) from %lu trace copies, "
        "prompts of %.0f blocks; %.0f block events/s; RSS %.0f B/block; %ld client thread(s)\n",
        c.workers, c.stores, c.blocks, c.replicas, c.copies, c.mean_prompt_blocks, c.events_per_s,
        c.rss_per_block, threads);
    std::printf("  %-12s %10s %12s %9s %9s %9s | %12s %9s %9s %6s\n", "path", "target/s",
                "achieved/s", "p50 us", "p99 us", "p999 us", "linear ach/s", "p99 us", "p999 us",
                "ratio");
    for (size_t i = 0; i < c.inproc.size(); ++i) {
      const auto& p = c.inproc[i];
      const auto& l = c.linear[i];
      std::printf("  %-12s %10.0f %12.0f %9.1f %9.1f %9.1f | %12.0f %9.1f %9.1f %6.3f\n",
                  "in-process", p.target, p.achieved, p.p50_us, p.p99_us, p.p999_us, l.achieved,
                  l.p99_us, l.p999_us, p.p99_us / l.p99_us);
    }
    for (const auto& p : c.grpc) {
      std::printf("  %-12s %10.0f %12.0f %9.1f %9.1f %9.1f |\n", "gRPC", p.target, p.achieved,
                  p.p50_us, p.p99_us, p.p999_us);
    }
    std::printf(
        "  best in-process rate with p99 <= 1 ms: %.0f/s (linear walk: %.0f/s); over gRPC with "
        "p99 <= 5 ms: %.0f/s\n\n",
        best(c.inproc, 1000), best(c.linear, 1000), best(c.grpc, 5000));
  }
  std::printf(
      "(open loop: latency counts from each route's scheduled time; ratio = p99 / the "
      "linear walk's p99 at the same target)\n");
  return 0;
}

}  // namespace kvtier::bench
