// The engines kvtier-frontend serves: each engine's state (where it
// answers, what was sent there, whether it is up, its idle connections and
// its KV event source), the fleet as a snapshot replaced whole when an
// engine joins or leaves, the engines' health checks and the DNS pools
// that engines join and leave by.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "frontend/asio.h"
#include "frontend/openai.h"
#include "frontend/server.h"
#include "router/router_core.h"
#include "router/vllm_events.h"
#include "router/vllm_source_spec.h"

namespace kvtier::frontend {

class LoadBook;
struct Counters;

// One engine of the fleet: where it answers, what the frontend sends it,
// whether it is up, and its idle keep-alive connections.
struct Engine {
  router::VllmSourceSpec spec;
  std::string host, port;
  int dns_pool = -1;  // index in options.dns; -1: a static engine
  std::atomic<int64_t> in_flight{0};
  // Requests sent there and not answered yet (for a stream: no first event
  // yet), and the prompt tokens the router expected it to compute for
  // them (its prefill queue, as this frontend sees it).
  std::atomic<int64_t> waiting_tokens{0}, waiting_requests{0};
  // The prompt tokens of the requests it answered and is still decoding.
  std::atomic<int64_t> decoding_tokens{0};
  std::atomic<bool> healthy{true};
  int health_failures = 0;           // in a row; only its health loop touches it
  std::atomic<bool> removed{false};  // left the fleet (DNS): its loops end
  std::atomic<int64_t> down_until_ms{0};
  std::atomic<uint64_t> requests{0}, failures{0};
  // Its answers that failed (5xx) since its last whole answer.
  std::atomic<uint32_t> failed_in_a_row{0};
  std::atomic<uint64_t> health_checks{0};  // ended, answered or not
  std::mutex mu;
  struct Idle {
    std::shared_ptr<Stream> stream;
    Clock::time_point since;
  };
  // Per thread (t_loop), newest last; guarded by mu.
  std::vector<std::vector<Idle>> idle;
  std::unique_ptr<router::VllmEventSource> events;  // guarded by mu
  VllmLoad vllm;                                    // guarded by mu: its /metrics, last scraped
  // Requests vLLM said wait there beyond this frontend's own, when scraped:
  // other frontends' (guarded by mu).
  double foreign_waiting = 0;
  int64_t last_push_us = 0;  // guarded by mu: when the router was last told its load

  // Its tokenizer was compared with the frontend's (frontend/token_check.h):
  // once it answered; refused when its ids differ (it never serves).
  bool tokens_checked = false;  // only its health loop touches it
  std::atomic<bool> refused{false};

  bool Usable(int64_t now) const {
    return healthy.load() && !refused.load() && down_until_ms.load() <= now;
  }
};

// Which engines a choice is among: those that decode (every request's
// answer comes from one) or the prefill engines.
enum class Want { kDecode, kPrefill };
bool Serves(const router::VllmSourceSpec& spec, Want want);

// The engines serving now; a request holds the engines it uses.
struct FleetView {
  std::vector<std::shared_ptr<Engine>> engines;
};

class Fleet {
 public:
  // `health` runs the health and DNS loops. Nothing starts before Start().
  // The tokenizer of each engine's model (`models`, by namespace; none:
  // no check) is compared with the engine's /tokenize once it answers.
  Fleet(const FrontendOptions& options, router::RouterCore* core, LoadBook* load,
        Counters* counters, Executor health, const std::vector<ServedModel>* models = nullptr);

  // The static engines join; each DNS pool is resolved now and every
  // dns_interval_ms.
  void Start();
  // Every engine's event source ends (no event reaches the router after
  // this); the loops end with their io_context.
  void Close();

  std::shared_ptr<const FleetView> Snapshot() const;
  bool HasPrefillEngines() const;

  // The engine failed as a server (refused, reset, timed out, cut an
  // answer short): it is skipped for --down.
  void MarkDown(Engine& e, const std::string& why) const;
  // It answered a request with a 5xx: the request's failure, unless its
  // answers fail --breaker-errors times in a row (then it is skipped for
  // --down, as a circuit breaker opens; half-open after it, one more
  // failure opens it again). An engine's whole answer (Answered) closes it.
  void AnswerFailed(Engine& e, const std::string& why) const;
  static void Answered(Engine& e) { e.failed_in_a_row = 0; }

  // GET `path` on a connection of its own: the body of a 200, or nothing.
  Task<std::optional<std::string>> Get(Engine& e, std::string path) const;
  // `verb` `path` with a JSON `body` on a connection of its own: the
  // answer's status and body, or nothing when it did not answer.
  Task<std::optional<std::pair<unsigned, std::string>>> Fetch(Engine& e, http::verb verb,
                                                              std::string path,
                                                              std::string body) const;

 private:
  void Add(const router::VllmSourceSpec& spec, int dns_pool);
  void Remove(const std::shared_ptr<Engine>& e, const std::string& why);
  void SyncDns(size_t index, const std::set<std::string>& addresses, const std::string& port);
  Task<> DnsLoop(size_t index);
  Task<> HealthLoop(std::shared_ptr<Engine> e);
  Task<> CheckTokens(Engine& e);

  const FrontendOptions& options_;
  router::RouterCore* core_;
  LoadBook* load_;
  Counters* counters_;
  Executor health_;
  const std::vector<ServedModel>* models_;
  mutable std::mutex mu_;
  std::shared_ptr<const FleetView> view_ = std::make_shared<FleetView>();  // guarded by mu_
};

}  // namespace kvtier::frontend
