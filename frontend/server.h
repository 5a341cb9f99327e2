// kvtier-frontend's server: an OpenAI-compatible HTTP front door (Boost.Beast
// over Asio, C++20 coroutines) in front of vLLM servers. Each request is
// checked and tokenized (frontend/openai.h), routed by the router core in
// process (router/embedded_router.h, fed by every engine's own ZeroMQ KV
// events and by the store shards that publish to it), and proxied to the
// chosen engine over a pooled keep-alive connection, its response passed
// through chunk by chunk (SSE unbuffered). docs/frontend.md.
//
// Failover: an engine that refuses the connection, fails before answering or
// answers 5xx is skipped for `down_ms` and the request goes to the next
// candidate (never after the first byte reached the client); an engine
// whose /health fails stops feeding the router (its blocks leave the index
// at the router's heartbeat deadline) until it answers again. A client that
// disconnects closes its upstream connection, which vLLM takes as an abort.
//
// Load: the router sees what this frontend sent each engine (the prompt
// tokens of requests not yet answered, requests in flight) and what the
// engine's own /metrics says (running, waiting, KV cache use), scraped with
// each health check.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "frontend/deletion_cost.h"
#include "frontend/openai.h"
#include "frontend/text_model.h"
#include "router/router_core.h"
#include "router/vllm_source_spec.h"

namespace kvtier::frontend {

struct FrontendOptions {
  std::string listen = "127.0.0.1:8000";  // host:port; port 0: any free one
  int threads = 2;                        // Asio threads
  int text_threads = 2;      // threads preparing large requests (tokenizing, templates)
  std::string served_model;  // the name clients use
  // The LoRA adapters every engine serves (vLLM's --lora-modules names): a
  // request naming one is routed on that adapter's blocks.
  std::vector<std::string> lora_adapters;
  uint64_t max_model_len = 0;  // what /v1/models reports
  // More models behind the same frontend, each routed by the `model` a
  // request sends to the engines whose namespace is the model's (the
  // first model, above, has the engines no other model claims).
  struct ExtraModel {
    std::string name;
    std::string dir;  // its tokenizer.json and tokenizer_config.json
    std::vector<std::string> adapters;
    uint64_t max_model_len = 0;
    uint64_t namespace_id = 0;
  };
  std::vector<ExtraModel> extra_models;
  RequestLimits limits;
  // API keys (frontend/gate.h): the file of their SHA-256 digests ("":
  // no key is asked for). /health and /metrics need none.
  std::string api_keys_file;
  // Each key's tokens per minute where its line sets none (0: no limit).
  uint64_t key_tokens_per_minute = 0;
  // How often the file is read again (a rotated Secret); 0: at start only.
  uint64_t api_keys_reload_ms = 10000;
  // Requests served at once (0: no cap); past it up to queue_size more
  // wait up to queue_timeout_ms for a turn, then are answered 429.
  uint64_t max_concurrent_requests = 0;
  uint64_t queue_size = 256;
  uint64_t queue_timeout_ms = 30000;
  // With no untried engine left and attempts left (max_attempts), a
  // request waits retry_backoff_ms (doubling up to retry_backoff_max_ms,
  // with ±20 % jitter) and tries the usable engines again (0: no retry
  // beyond each engine once).
  uint64_t retry_backoff_ms = 0;
  uint64_t retry_backoff_max_ms = 2000;
  // A circuit breaker per engine: its answers failing (5xx) this many
  // times in a row skip it for `down_ms`; a failure after that skips it
  // again at once (half-open), a whole answer closes it.
  uint32_t breaker_errors = 3;
  uint64_t max_body_bytes = 8 << 20;
  // Request bodies held at once (read, or being served): one that would
  // pass it is answered 503 with Retry-After before it is read.
  uint64_t max_body_bytes_in_flight = 512 << 20;
  // Client connections held at once; one past it is answered 503 with
  // Retry-After and closed.
  uint64_t max_connections = 4096;
  // SO_REUSEPORT on the listener: a second frontend may listen on the same
  // address while this one drains (a rolling restart in place). Where they
  // share it, net.ipv4.tcp_migrate_req=1 hands a closing listener's queued
  // connections to the other instead of resetting them.
  bool reuse_port = false;
  // A request with an x-session-id header goes to the engine that answered
  // its session last, while that engine is usable and the session was used
  // within this long (0: no affinity; routing alone decides).
  uint64_t session_ttl_ms = 0;
  uint64_t client_timeout_ms = 30000;     // to read a request
  uint64_t connect_timeout_ms = 2000;     // to reach an engine
  uint64_t upstream_timeout_ms = 600000;  // an engine's silence, between bytes
  uint64_t health_interval_ms = 2000;
  uint64_t down_ms = 5000;        // an engine that failed a request is skipped this long
  uint32_t max_attempts = 3;      // engines tried for one request
  uint32_t idle_per_engine = 64;  // pooled keep-alive connections kept per engine
  // A request an engine is decoding (answered, not finished) weighs on the
  // next one's time to first token there: its prompt tokens count in the
  // engine's load at this weight (prefill tokens a token held). Small by
  // default: a decoding stream adds about a token a step to the next
  // prefill's steps, so it breaks ties among engines with nothing waiting
  // (fewer streams win, as least-connections would choose) without
  // outweighing a prefix hit. 0: only prompts waiting for prefill are load.
  double decode_weight = 0.05;
  // Where GET /metrics is served: "" on `listen` with the API; else on
  // this operator port only (HOST:PORT), off the port clients reach.
  std::string metrics_listen;
  // Each answer's x-kvtier-route header (its engine, matched blocks, load
  // and cost): for operators and tests; it names engine addresses.
  bool route_header = false;
  // One log line per request sent to an engine: its explanation header
  // (engine, matched blocks, load, cost, reason) and prompt tokens.
  bool log_routes = false;
  // Prefill/decode (docs/disaggregation.md): with engines of role prefill,
  // a request whose prompt tokens the chosen decode engine would compute
  // (neither on its GPU nor in the store) number more than this goes to a
  // prefill engine first (max_tokens 1), then to the decode engine with
  // the prefill's kv_transfer_params.
  uint64_t pd_threshold = 512;
  // The engines: their API (endpoint), their KV events; one namespace and
  // block size for all.
  std::vector<router::VllmSourceSpec> engines;
  // Engines by DNS name as well (Kubernetes headless Services, one per
  // pool): every IPv4 address a name's host resolves to is an engine at
  // that address and port, its events at tcp://ADDRESS:events_port (and its
  // replay socket at replay_port, 0: none), with the name's namespace,
  // block size and role. Each name is resolved again every dns_interval_ms:
  // an address that appears joins the fleet, one that is gone leaves it and
  // the index at once; a failed resolution keeps that pool as it was.
  struct DnsPool {
    router::VllmSourceSpec spec;  // endpoint: the name, HOST:PORT
    uint32_t events_port = 0;
    uint32_t replay_port = 0;
  };
  std::vector<DnsPool> dns;
  uint64_t dns_interval_ms = 5000;
  // The router in process. Its load weight here is 0.5, not the router's
  // 1: vLLM batches the prefills waiting on an engine into the same steps,
  // so a prefix hit queued behind another prompt waits for less than that
  // prompt's whole prefill, while computing it elsewhere costs the fleet
  // its whole prompt again (docs/frontend.md, "Load"). No route counts as
  // "on its way" past a load update (inflight_ms 0): the load this frontend
  // tells holds every request it sent from the moment it sent it, so a
  // route the router kept counting after an update would count twice
  // (seen: a cold prompt's tokens twice on its engine for a whole prefill).
  router::RouterOptions router = [] {
    router::RouterOptions r;
    r.knobs.load_weight = 0.5;
    r.inflight_ms = 0;
    return r;
  }();
  std::string router_listen = "127.0.0.1:0";  // where store shards publish
  // The engine pods' deletion costs (frontend/deletion_cost.h); off
  // without a selector.
  DeletionCostOptions deletion_cost;

  // INVALID_ARGUMENT naming the first field out of range.
  absl::Status Validate() const;
  // The namespace of served_model's engines: the one no extra model
  // claims (0: none; Validate refuses that).
  uint64_t FirstNamespace() const;
};

// --extra-models: models separated by ';', each "name=NAME,model=DIR,
// namespace=16 hex digits[,lora-adapters=A|B][,max-model-len=N]",
// appended to options->extra_models. INVALID_ARGUMENT naming the key.
absl::Status ParseExtraModels(absl::string_view text, FrontendOptions* options);

// --engines-dns: pools separated by ';', each "name=HOST:PORT,
// events-port=N[,replay-port=N],namespace=16 hex digits,block-tokens=N
// [,role=prefill|decode|both]", appended to options->dns.
// INVALID_ARGUMENT naming the key that is wrong or missing.
absl::Status ParseEnginesDns(absl::string_view text, FrontendOptions* options);

class Frontend {
 public:
  static absl::StatusOr<std::unique_ptr<Frontend>> Start(FrontendOptions options,
                                                         std::unique_ptr<TextModel> text);
  ~Frontend();  // stops serving; requests in flight are cut

  // Stops accepting connections (new ones are refused), fails /health,
  // closes each client connection once its request is answered, and waits
  // up to `grace_ms` for the requests in flight to end. True when they all
  // did. What SIGTERM does before the process exits.
  bool Drain(uint64_t grace_ms);
  Frontend(const Frontend&) = delete;
  Frontend& operator=(const Frontend&) = delete;

  int port() const;
  int metrics_port() const;            // --metrics-listen's port; 0: /metrics is on port()
  std::string router_address() const;  // where store shards publish their events

  struct Impl;

 private:
  explicit Frontend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::frontend
