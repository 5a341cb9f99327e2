// kvctl workers and kvctl route: the router's view of its sources, and one
// routing decision explained with every candidate's cost.
#include <algorithm>
#include <cstdio>
#include <string>

#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"

namespace kvtier::cli {
namespace {

// Why the router picked its worker, indexed by v1::RouteReason; an unknown
// (newer) reason prints as the nearest known one rather than out of bounds.
const char* const kReasons[] = {
    "?", "lowest cost", "tie break (stable hash of the deepest matched block)",
    "balance guard (load spread over threshold)", "sampled (temperature)"};

const char* Reason(int reason) { return kReasons[std::clamp<int>(reason, 0, 4)]; }

void PrintRouteJson(const v1::RouteResponse& r) {
  nlohmann::json cands = nlohmann::json::array();
  for (const auto& x : r.candidates()) {
    cands.push_back({{"worker", x.worker_id()},
                     {"gpu_blocks", x.gpu_blocks()},
                     {"cpu_blocks", x.cpu_blocks()},
                     {"disk_blocks", x.disk_blocks()},
                     {"store_blocks", x.store_blocks()},
                     {"prefill_tokens", x.prefill_tokens()},
                     {"load_tokens", x.load_tokens()},
                     {"cost", x.cost()}});
  }
  const auto& b = r.fetch_basis();
  nlohmann::json basis = {{"fetch_cost", b.fetch_cost()}, {"measured", b.measured()}};
  if (b.measured()) {
    basis["store"] = b.store_id();
    basis["store_us_per_block"] = b.store_us_per_block();
    basis["store_queue_depth"] = b.store_queue_depth();
    basis["prefill_tokens_per_s"] = b.prefill_tokens_per_s();
  }
  nlohmann::json out = {{"worker", r.worker_id()},
                        {"endpoint", r.endpoint()},
                        {"fetch", basis},
                        {"gpu_hit_blocks", r.gpu_hit_blocks()},
                        {"cpu_hit_blocks", r.cpu_hit_blocks()},
                        {"disk_hit_blocks", r.disk_hit_blocks()},
                        {"store_hit_blocks", r.store_hit_blocks()},
                        {"prefill_tokens", r.prefill_tokens()},
                        {"reason", Reason(r.reason())},
                        {"candidates", cands}};
  // Unknown (no store, or one's snapshot still to come): null.
  out["store_end_blocks"] =
      r.has_store_end_blocks() ? nlohmann::json(r.store_end_blocks()) : nlohmann::json(nullptr);
  PrintJson(out);
}

void PrintRouteTable(const v1::RouteResponse& r) {
  std::printf("-> %s (%s): %u blocks on GPU, ", r.worker_id().c_str(), r.endpoint().c_str(),
              r.gpu_hit_blocks());
  if (r.cpu_hit_blocks() + r.disk_hit_blocks() > 0) {
    std::printf("%u on its CPU tier, %u on its disk tier, ", r.cpu_hit_blocks(),
                r.disk_hit_blocks());
  }
  std::printf("%u from the store, %lu tokens to prefill; %s\n\n", r.store_hit_blocks(),
              r.prefill_tokens(), Reason(r.reason()));
  if (r.has_store_end_blocks()) {
    std::printf("the stores hold the prompt's blocks up to block %u\n\n", r.store_end_blocks());
  } else {
    std::printf("what the stores hold is not known yet\n\n");
  }
  const auto& b = r.fetch_basis();
  if (b.measured()) {
    std::printf(
        "fetch cost %.4f per store token: %s serves a block in %.0f us (%u fetches in "
        "flight), workers prefill %.0f tokens/s\n\n",
        b.fetch_cost(), b.store_id().c_str(), b.store_us_per_block(), b.store_queue_depth(),
        b.prefill_tokens_per_s());
  } else {
    std::printf(
        "fetch cost %.4f per store token (--fetch-cost: no store or worker figures yet)\n\n",
        b.fetch_cost());
  }
  std::printf("%-24s %10s %12s %14s %12s %12s\n", "candidate", "GPU blocks", "store blocks",
              "prefill tokens", "load tokens", "cost");
  for (const auto& x : r.candidates()) {
    std::printf("%-24s %10u %12u %14lu %12lu %12.1f\n", x.worker_id().c_str(), x.gpu_blocks(),
                x.store_blocks(), x.prefill_tokens(), x.load_tokens(), x.cost());
  }
}

}  // namespace

int RunWorkers(const CommandLine& line) {
  SharedFlags c;
  FlagSet f("kvctl workers", "The router's view of its sources: workers and store shards.");
  c.Register(f, SharedFlags::Dials::kRouter);
  ParseCommandFlags(f, line);
  auto stub = c.RouterStub();
  grpc::ClientContext ctx;
  ctx.set_deadline(c.Deadline());
  v1::ListWorkersResponse resp;
  auto s = stub->ListWorkers(&ctx, {}, &resp);
  if (!s.ok()) return Report(FromGrpc(s), "router " + c.router);
  if (c.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& w : resp.sources()) {
      j.push_back({{"id", w.source_id()},
                   {"kind", w.kind() == v1::SOURCE_STORE ? "store" : "worker"},
                   {"endpoint", w.endpoint()},
                   {"namespace", NamespaceName(w.namespace_id())},
                   {"indexed_blocks", w.indexed_blocks()},
                   {"running_requests", w.load().running_requests()},
                   {"queued_prefill_tokens", w.load().queued_prefill_tokens()},
                   {"routed_tokens_since_heartbeat", w.routed_tokens_since_heartbeat()},
                   {"free_gpu_pages", w.load().free_gpu_pages()},
                   {"last_heartbeat_ms", w.last_seen_ms()},
                   {"connected", w.connected()},
                   {"resyncing", w.resyncing()},
                   {"draining", w.load().draining()},
                   {"sole_blocks", w.sole_blocks()},
                   {"sole_recompute_seconds", w.sole_recompute_seconds()}});
    }
    PrintJson({{"sources", j}});
    return kOk;
  }
  // "only here": blocks no other source holds (what losing it costs).
  std::printf("%-24s %-6s %-22s %-16s %8s %9s %7s %8s %9s %8s\n", "id", "kind", "endpoint",
              "namespace", "blocks", "only here", "running", "queued", "free pages", "last hb");
  for (const auto& w : resp.sources()) {
    std::printf("%-24s %-6s %-22s %016lx %8lu %9lu %7u %8lu %9lu %6lums%s%s\n",
                w.source_id().c_str(), w.kind() == v1::SOURCE_STORE ? "store" : "worker",
                w.endpoint().c_str(), w.namespace_id(), w.indexed_blocks(), w.sole_blocks(),
                w.load().running_requests(), w.load().queued_prefill_tokens(),
                w.load().free_gpu_pages(), w.last_seen_ms(), w.connected() ? "" : " (disconnected)",
                w.load().draining() ? " (draining)" : "");
  }
  return kOk;
}

int RunRoute(const CommandLine& line) {
  SharedFlags c;
  PromptFlags prompt_flags;
  int64_t prompt_tokens = 0;
  FlagSet f("kvctl route", "Ask the router where a prompt would go, with every candidate's cost.");
  c.Register(f, SharedFlags::Dials::kRouter);
  prompt_flags.Register(f, "File of token ids");
  f.Int("prompt-tokens", &prompt_tokens, 0, int64_t{1} << 32, "Prompt length with --hashes");
  bool count = false;
  f.Bool("count", &count,
         "Count the decision as an assignment (adds the prompt to the chosen worker's load, as a "
         "real request's route does); without it the router only explains");
  ParseCommandFlags(f, line);
  if (!prompt_flags.Check().ok()) {
    std::fprintf(stderr,
                 "kvctl route: give --namespace (hex) and exactly one of --tokens, --hashes\n");
    return kUsage;
  }
  auto prompt = prompt_flags.Read();
  if (!prompt.ok()) {
    std::fprintf(stderr, "kvctl route: %s\n", std::string(prompt.status().message()).c_str());
    return kUsage;
  }
  // Token ids go as they are (the router hashes them with the namespace's
  // block size and so knows the length); hashes need --prompt-tokens for it.
  v1::RouteRequest req;
  req.set_namespace_id(prompt->ns);
  req.set_dry_run(!count);
  if (prompt->from_tokens) {
    for (uint32_t x : prompt->tokens) req.mutable_tokens()->add_ids(x);
  } else {
    for (const auto& x : prompt->hashes) ToProto(x, req.mutable_hashes()->add_hashes());
    req.set_prompt_tokens(static_cast<uint64_t>(prompt_tokens));
  }
  auto stub = c.RouterStub();
  grpc::ClientContext ctx;
  ctx.set_deadline(c.Deadline());
  v1::RouteResponse r;
  auto s = stub->Route(&ctx, req, &r);
  if (!s.ok()) return ReportCall(s, ctx, "router " + c.router);
  if (c.json) {
    PrintRouteJson(r);
  } else {
    PrintRouteTable(r);
  }
  return kOk;
}

}  // namespace kvtier::cli
