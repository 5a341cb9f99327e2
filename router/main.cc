// kvtier-router: KV events in, routing decisions out. See --help.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <thread>

#include "common/config.h"
#include "common/log.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/metrics.h"
#include "common/rpc/tls.h"
#include "router/embedded_router.h"
#include "router/router_core.h"
#include "router/service.h"
#include "router/vllm_events.h"

namespace {

// Reads the file a flag names (none: *out stays empty) and parses it; false,
// after saying which flag and file and why, when it cannot.
template <typename T, typename Parse>
bool ParseFlagFile(const char* flag, const std::string& path, Parse parse, std::vector<T>* out) {
  if (path.empty()) return true;
  absl::StatusOr<std::string> text = kvtier::ReadTextFile(path);
  absl::StatusOr<std::vector<T>> parsed =
      text.ok() ? parse(*text) : absl::StatusOr<std::vector<T>>(text.status());
  if (!parsed.ok()) {
    std::fprintf(stderr, "kvtier-router: flag --%s: %s: %s\n", flag, path.c_str(),
                 std::string(parsed.status().message()).c_str());
    return false;
  }
  *out = std::move(*parsed);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // First, before gRPC (TLS credentials, channels) starts any thread.
  kvtier::BlockShutdownSignals();
  kvtier::PrepareGrpcProcess();
  std::string listen = "127.0.0.1:7500";
  std::string port_file, metrics_listen, vllm_sources_file, source_identities_file;
  bool check_config = false;
  uint64_t max_message = 64ull << 20;
  // The flags set the options in place, from their defaults
  // (router/router_core.h, router/cost.h); the balance guard's differs.
  kvtier::router::RouterOptions o;
  int64_t balance = 32768;
  kvtier::TlsFlags tls;
  kvtier::FlagSet flags(
      "kvtier-router",
      "Routes each request to the worker that can serve it with the least prefill work:\n"
      "indexes the KV blocks workers and store shards report (kvtier.v1.Router event\n"
      "streams) and scores every live worker of the request's namespace by\n"
      "  cost = tokens to compute + fetch_cost x tokens fetched from the store\n"
      "         + cpu_fetch_cost, disk_fetch_cost x tokens loaded from its own tiers\n"
      "         + load_weight x (queued prefill tokens + tokens routed since its heartbeat)\n"
      "         + occupancy_weight x fetch_cost x tokens placed in new pages\n"
      "           x its pages' use above its fleet's mean (only while store shards report).\n"
      "Example: kvtier-router --listen 0.0.0.0:7500 --heartbeat-deadline 5s --fetch-cost 0.1");
  flags.HostPort("listen", &listen, "gRPC address HOST:PORT (port 0 picks a free port)");
  flags.DurationMs("heartbeat-deadline", &o.heartbeat_deadline_ms,
                   "A source silent this long is dropped with all its blocks (e.g. 5s)");
  flags.Double("fetch-cost", &o.knobs.fetch_cost, 0, 10,
               "Cost of fetching one token's KV from the store, relative to computing it");
  flags.Double("cpu-fetch-cost", &o.knobs.cpu_fetch_cost, 0, 10,
               "Cost of loading one token's KV from a worker's own CPU tier (vLLM's "
               "offloading, seen in its KV events), relative to computing it");
  flags.Double("disk-fetch-cost", &o.knobs.disk_fetch_cost, 0, 10,
               "The same from a worker's own slower tier (disk, storage)");
  flags.Double("load-weight", &o.knobs.load_weight, 0, 1000,
               "Cost per queued prefill token of a worker");
  flags.Double(
      "occupancy-weight", &o.knobs.occupancy_weight, 0, 1000,
      "Cost, in fetches, per token a request places in new pages of a worker, times how far "
      "the share of its pages in use exceeds its fleet's mean (0: off): new sessions go "
      "to workers with room instead of onto the holder of a short shared prefix");
  flags.Int("balance-threshold-tokens", &balance, 0, int64_t{1} << 40,
            "Route by load alone when the load spread among candidates exceeds this many "
            "tokens (0: never)");
  flags.DurationMs(
      "inflight", &o.inflight_ms,
      "How long a route may take to reach its worker: tokens routed this recently "
      "stay in the worker's load past its next heartbeat (0: a heartbeat resets them)");
  flags.DurationMs("pending", &o.pending_ms,
                   "How long a routed prompt's blocks count as its worker's before the worker's "
                   "events show them, so a burst sharing a prefix is costed as the worker will "
                   "run it (0: off; at most 1m)");
  flags.Double("temperature", &o.knobs.temperature, 0, 100,
               "0: always the cheapest; above 0: sample by cost (relative to the prompt length)");
  flags.Bytes("max-message-bytes", &max_message, "Largest gRPC message accepted");
  flags.String("port-file", &port_file, "Write the bound gRPC port to this file once serving");
  flags.HostPort("metrics-listen", &metrics_listen,
                 "Serve Prometheus metrics on HOST:PORT/metrics (empty: off)");
  flags.String("vllm-sources", &vllm_sources_file,
               "File of vLLM engines whose ZeroMQ KV events to index, one per line:\n"
               "id=ID,endpoint=HOST:PORT,events=tcp://HOST:5557[,replay=tcp://HOST:5558]\n"
               "[,topic=T],namespace=16 hex digits,block-tokens=N (docs/router.md)");
  flags.String("source-identities", &source_identities_file,
               "With mutual TLS: file of the client certificates that may publish, one per line:\n"
               "IDENTITY worker|store [SOURCE-ID ...] (ids default to the identity; a trailing *\n"
               "matches a prefix). Without it a certificate must name the source id it claims\n"
               "(docs/security.md)");
  flags.Bool("check-config", &check_config,
             "Validate the flags, print the effective configuration and exit 0");
  kvtier::AddTlsFlags(flags, &tls, /*serves=*/true, /*dials=*/false);
  kvtier::ParseFlagsOrExit(flags, argc, argv);
  auto credentials = kvtier::ServerCredentials(tls);  // checks the TLS flags and files
  if (!credentials.ok()) {
    std::fprintf(stderr, "kvtier-router: %s\n",
                 std::string(credentials.status().message()).c_str());
    return 2;
  }
  o.knobs.balance_threshold_tokens = static_cast<uint64_t>(balance);
  if (auto s = o.Validate(); !s.ok()) {
    std::fprintf(stderr, "kvtier-router: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  std::vector<kvtier::router::VllmSourceSpec> vllm_specs;
  if (!ParseFlagFile("vllm-sources", vllm_sources_file, kvtier::router::ParseVllmSources,
                     &vllm_specs)) {
    return 2;
  }
  std::vector<kvtier::router::SourceIdentity> identities;
  if (!ParseFlagFile("source-identities", source_identities_file,
                     kvtier::router::ParseSourceIdentities, &identities)) {
    return 2;
  }
  const size_t listed_identities = identities.size();
  auto auth = kvtier::router::SourceAuth::Make(tls.require_client_cert, std::move(identities));
  if (!auth.ok()) {
    std::fprintf(stderr, "kvtier-router: %s\n", std::string(auth.status().message()).c_str());
    return 2;
  }
  if (check_config) {
    std::printf(
        "kvtier-router configuration OK: listen=%s metrics-listen=%s heartbeat-deadline=%lums "
        "fetch-cost=%g cpu-fetch-cost=%g disk-fetch-cost=%g load-weight=%g "
        "occupancy-weight=%g balance-threshold-tokens=%ld temperature=%g\n",
        listen.c_str(), metrics_listen.c_str(), o.heartbeat_deadline_ms, o.knobs.fetch_cost,
        o.knobs.cpu_fetch_cost, o.knobs.disk_fetch_cost, o.knobs.load_weight,
        o.knobs.occupancy_weight, balance, o.knobs.temperature);
    return 0;
  }

  kvtier::router::RouterCore core(o);
  kvtier::router::RouterService service(&core);
  service.SetSourceAuth(*auth);
  if (auth->authenticates()) {
    kvtier::Log("router", "sources are bound to their client certificates",
                listed_identities > 0
                    ? absl::StrCat(" (", listed_identities, " identities in --source-identities)")
                    : std::string(" (each must name its source id)"));
  } else {
    kvtier::Log("router", "sources are not authenticated (no mutual TLS): any client that reaches ",
                listen, " may publish as any source (docs/security.md)");
  }

  // vLLM engines' own KV events, beside the gRPC streams (set up before
  // serving: GetRouterStats reads them).
  std::vector<std::unique_ptr<kvtier::router::VllmEventSource>> vllm;
  for (const auto& spec : vllm_specs) {
    vllm.push_back(std::make_unique<kvtier::router::VllmEventSource>(spec, &core));
    kvtier::Log("router", "subscribed to vLLM KV events of ", spec.id, " at ", spec.events,
                spec.replay.empty() ? "" : " (replay " + spec.replay + ")");
  }
  service.SetExtraStats([&vllm](kvtier::v1::GetRouterStatsResponse* r) {
    if (vllm.empty()) return;
    auto& m = *r->mutable_vllm_events();
    for (const auto& v : vllm) {
      v->stats().ForEach([&m](const char* name, uint64_t n) { m[name] += n; });
    }
  });
  auto started =
      kvtier::StartGrpcServer({"kvtier-router", listen, *credentials, {&service}, max_message});
  if (!started.ok()) {
    std::fprintf(stderr, "kvtier-router: %s\n", std::string(started.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<kvtier::MetricsServer> metrics;
  if (!metrics_listen.empty()) {
    auto ms = kvtier::MetricsServer::Start(metrics_listen,
                                           [&service] { return service.CollectMetrics(); });
    if (!ms.ok()) {
      std::fprintf(stderr, "kvtier-router: %s\n", std::string(ms.status().message()).c_str());
      return 1;
    }
    metrics = std::move(*ms);
  }
  const std::string tls_mode =
      kvtier::TlsModeSuffix(!tls.cert_file.empty(), tls.require_client_cert);
  kvtier::Log("router", "listening on ", started->address(),
              tls.cert_file.empty()     ? ""
              : tls.require_client_cert ? ", mutual TLS"
                                        : ", TLS",
              " (heartbeat deadline ", o.heartbeat_deadline_ms, " ms, fetch_cost ",
              o.knobs.fetch_cost, ", load_weight ", o.knobs.load_weight, ", balance ", balance,
              " tokens, temperature ", o.knobs.temperature, ")");
  kvtier::AnnounceListening("kvtier-router", *started, tls_mode, port_file);

  {
    kvtier::router::ExpiryTimer expiry(&core, o.heartbeat_deadline_ms);
    kvtier::ServeUntilSignalled(started->server.get(), "router");
  }
  kvtier::Log("router", "stopped");
  return 0;
}
