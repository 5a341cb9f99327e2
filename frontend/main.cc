// kvtier-frontend: the OpenAI-compatible front door of a vLLM fleet
// (frontend/server.h, docs/frontend.md).
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/config.h"
#include "common/file_limit.h"
#include "common/log.h"
#include "frontend/server.h"

int main(int argc, char** argv) {
  kvtier::frontend::FrontendOptions o;
  std::string model_dir, engines, engines_file, engines_dns, port_file;
  int64_t threads = 2, max_attempts = 3, max_prompts = 64, max_model_len = 0;
  uint64_t max_prompt_tokens = 131072, heartbeat_ms = 5000, drain_timeout_ms = 25000;
  int64_t max_connections = static_cast<int64_t>(o.max_connections);
  kvtier::FlagSet flags("kvtier-frontend",
                        "An OpenAI-compatible HTTP front door that routes every request by "
                        "prefix, load and the store's holdings to vLLM servers.");
  flags.HostPort("listen", &o.listen, "where clients connect (host:port; port 0: any)");
  flags.String("model", &model_dir,
               "the model's directory: its tokenizer.json and tokenizer_config.json");
  flags.String("served-model-name", &o.served_model, "the model name clients send");
  std::string adapters;
  flags.String("lora-adapters", &adapters,
               "the LoRA adapters every engine serves (the names of vLLM's --lora-modules), "
               "','-separated: a request naming one is routed on that adapter's blocks");
  flags.String("engines", &engines, "the engines, ';'-separated, each as a line of --engines-file");
  flags.String("engines-file", &engines_file,
               "one engine a line: id=ID,endpoint=HOST:PORT,events=tcp://HOST:PORT,"
               "[replay=tcp://...],namespace=16 hex digits,block-tokens=N,"
               "[role=prefill|decode|both] (docs/router.md, docs/disaggregation.md)");
  flags.String("engines-dns", &engines_dns,
               "engines by DNS name (a headless Service per pool), re-resolved; pools "
               "';'-separated, each name=HOST:PORT,events-port=N,[replay-port=N],"
               "namespace=16 hex digits,block-tokens=N,[role=prefill|decode|both]");
  flags.DurationMs("dns-interval", &o.dns_interval_ms, "between resolutions of --engines-dns");
  flags.String("deletion-cost-selector", &o.deletion_cost.selector,
               "keep each engine pod's controller.kubernetes.io/pod-deletion-cost at the prompt "
               "tokens only it holds, for the pods this label selector lists, so a scale-down "
               "removes the cheapest (in a pod; needs a Role to list and patch pods; empty: off)");
  flags.String("deletion-cost-namespace", &o.deletion_cost.k8s_namespace,
               "the engine pods' Kubernetes namespace [default: the service account's]");
  flags.DurationMs("deletion-cost-interval", &o.deletion_cost.interval_ms,
                   "between updates of the pods' deletion costs");
  flags.HostPort("router-listen", &o.router_listen,
                 "where store shards publish their events to the router in this process");
  flags.Int("threads", &threads, 1, 256, "threads serving requests");
  int64_t text_threads = o.text_threads;
  flags.Int("text-threads", &text_threads, 1, 256,
            "threads tokenizing large prompts and rendering long chats (off the serving threads)");
  flags.Int("max-attempts", &max_attempts, 1, 16, "engines tried for one request");
  flags.Bytes("max-body-bytes", &o.max_body_bytes, "largest request body taken");
  flags.Bytes("max-body-bytes-in-flight", &o.max_body_bytes_in_flight,
              "request bodies held at once (one more is answered 503 with Retry-After)");
  flags.Bytes("max-prompt-tokens", &max_prompt_tokens, "largest prompt taken, in tokens");
  flags.Int("max-prompts", &max_prompts, 1, 4096, "prompts in one completions request");
  flags.Int("max-model-len", &max_model_len, 0, int64_t{1} << 30, "what /v1/models reports");
  flags.HostPort("metrics-listen", &o.metrics_listen,
                 "serve GET /metrics here only, off the clients' port (HOST:PORT; empty: on "
                 "--listen)");
  flags.Bool("route-header", &o.route_header,
             "answer each request's x-kvtier-route header (engine, matches, load, cost; it "
             "names engine addresses: for operators and tests)");
  flags.DurationMs("client-timeout", &o.client_timeout_ms,
                   "time to read a client's request, and to write it each piece of its answer");
  flags.Int("max-connections", &max_connections, 1, int64_t{1} << 20,
            "client connections held at once (one more is answered 503 with Retry-After)");
  flags.DurationMs("drain-timeout", &drain_timeout_ms,
                   "on SIGTERM, how long the requests in flight may take to end (keep it under "
                   "the pod's terminationGracePeriodSeconds less its preStop sleep)");
  flags.DurationMs("connect-timeout", &o.connect_timeout_ms, "time to connect to an engine");
  flags.DurationMs("upstream-timeout", &o.upstream_timeout_ms,
                   "an engine's longest silence within a response");
  flags.DurationMs("health-interval", &o.health_interval_ms, "between engine health checks");
  flags.Double("decode-weight", &o.decode_weight, 0, 16,
               "load of a request being decoded, per prompt token, against a prompt "
               "token waiting for prefill (0: only waiting prompts are load)");
  flags.Double("load-weight", &o.router.knobs.load_weight, 0, 1000,
               "cost per token an engine has waiting for prefill, against a token the "
               "request itself would compute there (docs/frontend.md, \"Load\")");
  flags.Double("cpu-fetch-cost", &o.router.knobs.cpu_fetch_cost, 0, 10,
               "cost per token an engine loads from its own CPU tier (vLLM's offloading, "
               "seen in its KV events), against computing it (docs/router.md, \"Media\")");
  flags.Double("disk-fetch-cost", &o.router.knobs.disk_fetch_cost, 0, 10,
               "the same from an engine's own slower tier (disk, storage)");
  flags.Bool("log-routes", &o.log_routes,
             "log every request's route (its x-kvtier-route header) to stderr");
  int64_t pd_threshold = static_cast<int64_t>(o.pd_threshold);
  flags.Int("pd-threshold", &pd_threshold, 0, int64_t{1} << 30,
            "with prefill engines: prompt tokens the decode engine would compute past "
            "which a request is prefilled on a prefill engine first");
  flags.DurationMs("down", &o.down_ms, "how long an engine that failed a request is skipped");
  flags.DurationMs("heartbeat-deadline", &heartbeat_ms,
                   "an engine silent this long (its health check failing) leaves the index");
  flags.String("port-file", &port_file, "write the port served to this file once listening");
  flags.DurationMs("session-affinity-ttl", &o.session_ttl_ms,
                   "send a request with an x-session-id header to the engine that answered its "
                   "session last, while that engine is usable and the session was used within "
                   "this long (0: off)");
  flags.Bool("reuse-port", &o.reuse_port,
             "let another frontend listen on the same address while this one drains (a "
             "rolling restart in place; set net.ipv4.tcp_migrate_req=1 so a closing "
             "listener's queued connections move to the other)");
  std::string extra_models;
  flags.String("extra-models", &extra_models,
               "more models behind this frontend, ';'-separated, each name=NAME,model=DIR,"
               "namespace=16 hex digits[,lora-adapters=A|B][,max-model-len=N]: a request's "
               "`model` picks the engines of that namespace and that tokenizer");
  flags.String("api-keys-file", &o.api_keys_file,
               "ask every API request for a key (Authorization: Bearer KEY): one a line, "
               "SHA256 NAME [TOKENS_PER_MINUTE] (a Kubernetes Secret mounted as a file; "
               "empty: no key asked)");
  flags.DurationMs("api-keys-reload-interval", &o.api_keys_reload_ms,
                   "read --api-keys-file again this often (a Kubernetes Secret changes in "
                   "place); a file that no longer parses keeps the last keys, logged (0: never)");
  int64_t key_tpm = 0, max_concurrent = 0, queue_size = static_cast<int64_t>(o.queue_size),
          breaker_errors = static_cast<int64_t>(o.breaker_errors);
  flags.Int("key-tokens-per-minute", &key_tpm, 0, int64_t{1} << 40,
            "each key's prompt and max_tokens per minute where its line sets none (0: no limit; "
            "past it 429 with Retry-After)");
  flags.Int("max-concurrent-requests", &max_concurrent, 0, int64_t{1} << 30,
            "requests served at once; more wait in a queue (0: no cap)");
  flags.Int("queue-size", &queue_size, 0, int64_t{1} << 30,
            "requests that may wait for a turn; one more is answered 429 with Retry-After");
  flags.DurationMs("queue-timeout", &o.queue_timeout_ms,
                   "how long a request waits for a turn before it is answered 429");
  flags.DurationMs("retry-backoff", &o.retry_backoff_ms,
                   "once every engine failed a request, wait this long (doubling, with jitter) "
                   "and try the usable ones again, within --max-attempts (0: off)");
  flags.DurationMs("retry-backoff-max", &o.retry_backoff_max_ms, "the longest back-off");
  flags.Int("breaker-errors", &breaker_errors, 1, 1000,
            "an engine whose answers fail (5xx) this many times in a row is skipped for --down");
  bool check_config = false;
  flags.Bool("check-config", &check_config,
             "validate the flags and exit 0 (the model is not read, no port is opened)");
  kvtier::ParseFlagsOrExit(flags, argc, argv);
  o.threads = static_cast<int>(threads);
  o.max_attempts = static_cast<uint32_t>(max_attempts);
  o.pd_threshold = static_cast<uint64_t>(pd_threshold);
  o.limits.max_prompt_tokens = max_prompt_tokens;
  o.limits.max_prompts = static_cast<uint32_t>(max_prompts);
  o.max_model_len = static_cast<uint64_t>(max_model_len);
  o.max_connections = static_cast<uint64_t>(max_connections);
  o.text_threads = static_cast<int>(text_threads);
  o.router.heartbeat_deadline_ms = heartbeat_ms;
  o.key_tokens_per_minute = static_cast<uint64_t>(key_tpm);
  o.max_concurrent_requests = static_cast<uint64_t>(max_concurrent);
  o.queue_size = static_cast<uint64_t>(queue_size);
  o.breaker_errors = static_cast<uint32_t>(breaker_errors);
  if (auto s = kvtier::frontend::ParseExtraModels(extra_models, &o); !s.ok()) {
    std::fprintf(stderr, "kvtier-frontend: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  for (absl::string_view a : absl::StrSplit(adapters, ',', absl::SkipWhitespace())) {
    o.lora_adapters.emplace_back(absl::StripAsciiWhitespace(a));
  }

  std::string spec_text = absl::StrReplaceAll(engines, {{";", "\n"}});
  if (!engines_file.empty()) {
    auto text = kvtier::ReadTextFile(engines_file);
    if (!text.ok()) {
      std::fprintf(stderr, "kvtier-frontend: --engines-file: %s\n",
                   std::string(text.status().message()).c_str());
      return 2;
    }
    spec_text += "\n" + *text;
  }
  auto specs = kvtier::router::ParseVllmSources(spec_text);
  if (!specs.ok()) {
    std::fprintf(stderr, "kvtier-frontend: --engines: %s\n",
                 std::string(specs.status().message()).c_str());
    return 2;
  }
  o.engines = std::move(*specs);
  if (!engines_dns.empty()) {
    if (auto s = kvtier::frontend::ParseEnginesDns(engines_dns, &o); !s.ok()) {
      std::fprintf(stderr, "kvtier-frontend: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  if (model_dir.empty()) {
    std::fprintf(stderr, "kvtier-frontend: --model is required\n");
    return 2;
  }
  if (check_config) {
    if (auto s = o.Validate(); !s.ok()) {
      std::fprintf(stderr, "kvtier-frontend: %s\n", std::string(s.message()).c_str());
      return 2;
    }
    std::printf("kvtier-frontend: the flags are valid (%zu engines and %zu DNS pools)\n",
                o.engines.size(), o.dns.size());
    return 0;
  }
  auto text = kvtier::frontend::TextModel::Open(model_dir);
  if (!text.ok()) {
    std::fprintf(stderr, "kvtier-frontend: %s\n", std::string(text.status().message()).c_str());
    return 2;
  }
  if (auto s = o.Validate(); !s.ok()) {
    std::fprintf(stderr, "kvtier-frontend: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // Block SIGINT and SIGTERM before any thread starts: sigwait takes them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  kvtier::RaiseFileLimit();  // a descriptor per client and upstream connection
  auto fe = kvtier::frontend::Frontend::Start(o, std::move(*text));
  if (!fe.ok()) {
    std::fprintf(stderr, "kvtier-frontend: %s\n", std::string(fe.status().message()).c_str());
    return 1;
  }
  if ((*fe)->metrics_port() != 0) {
    kvtier::Log("frontend", "metrics on port ", (*fe)->metrics_port());
  }
  kvtier::Log("frontend", "serving ", o.served_model, " on port ", (*fe)->port(), " in front of ",
              o.engines.size(), " engines and ", o.dns.size(), " DNS pools",
              "; store shards publish to ", (*fe)->router_address());
  if (!port_file.empty()) std::ofstream(port_file) << (*fe)->port() << "\n";
  int sig = 0;
  sigwait(&set, &sig);
  if (sig == SIGTERM) {
    // A rollout or a scale-in: the streams in flight end whole.
    kvtier::Log("frontend", "draining on SIGTERM");
    (*fe)->Drain(drain_timeout_ms);
  }
  kvtier::Log("frontend", "stopping on signal ", sig);
  fe->reset();
  return 0;
}
