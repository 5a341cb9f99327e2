// kvtier-frontend's server inside: the parts assembled (frontend/server.cc)
// and the client's side, each connection's requests read and answered
// (frontend/session.cc). Included by those two files only.
#pragma once

#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "common/rpc/metrics.h"
#include "frontend/asio.h"
#include "frontend/deletion_cost.h"
#include "frontend/fleet.h"
#include "frontend/gate.h"
#include "frontend/handoff.h"
#include "frontend/load.h"
#include "frontend/metrics.h"
#include "frontend/relay.h"
#include "frontend/server.h"
#include "frontend/sessions.h"
#include "router/embedded_router.h"

namespace kvtier::frontend {

struct Frontend::Impl {
  FrontendOptions options;
  // One io_context per thread; connections are dealt round-robin. Declared
  // first of what uses them: coroutines and pooled connections are
  // destroyed before their io_contexts.
  std::vector<std::unique_ptr<net::io_context>> loops;
  // Each loop runs until stopped, whether or not it has connections yet.
  std::vector<net::executor_work_guard<Executor>> keep_running;
  std::unique_ptr<TextModel> text;
  std::vector<std::unique_ptr<TextModel>> extra_texts;  // --extra-models'
  // Every model served: the first (--served-model-name, `text`), then
  // --extra-models, in their order.
  std::vector<ServedModel> models;
  // Prepares large requests (joined before `text` goes).
  std::optional<net::thread_pool> text_pool;
  static constexpr size_t kInlineBody = 16 << 10;
  std::unique_ptr<router::EmbeddedRouter> router;
  std::unique_ptr<DeletionCostUpdater> deletion_costs;  // --deletion-cost-selector
  std::unique_ptr<KeyFile> keys;                        // --api-keys-file
  TokenRates rates;
  std::shared_ptr<Admission> admission;  // --max-concurrent-requests
  Counters counters;
  std::optional<LoadBook> load;
  std::unique_ptr<Fleet> fleet;
  std::unique_ptr<Relay> relay;
  std::unique_ptr<Prefiller> prefiller;
  std::optional<SessionBook> sessions;            // --session-affinity-ttl
  std::unique_ptr<MetricsServer> metrics_server;  // --metrics-listen
  std::optional<Acceptor> acceptor;
  size_t next_loop = 0;
  std::vector<std::thread> threads;
  uint64_t started_unix = 0;
  int port = 0;
  // Client connections open, connections being refused, requests being
  // served (read, not yet answered whole).
  std::atomic<int64_t> refusing{0};
  std::atomic<int64_t>& connections = counters.connections;
  std::atomic<int64_t>& requests_in_flight = counters.requests_in_flight;
  std::atomic<uint64_t>& body_bytes_in_flight = counters.body_bytes_in_flight;
  std::atomic<bool> draining{false}, out_of_descriptors{false};

  static constexpr uint32_t kHeaderLimit = 64 << 10;

  // Counts one while it lives.
  struct Held {
    explicit Held(std::atomic<int64_t>* n) : n(n) { ++*n; }
    ~Held() { --*n; }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
    std::atomic<int64_t>* n;
  };

  // `n` bytes counted in `*total` while it lives; ok() when the total
  // with them is within a cap.
  struct Reserved {
    Reserved(std::atomic<uint64_t>* total, uint64_t n) : total(total), n(n), after(*total += n) {}
    ~Reserved() { *total -= n; }
    Reserved(const Reserved&) = delete;
    Reserved& operator=(const Reserved&) = delete;
    bool ok(uint64_t cap) const { return n == 0 || after <= cap; }
    std::atomic<uint64_t>* total;
    uint64_t n, after;
  };

  // Closes a connection whose client may still be sending (a request
  // refused unread): the answer's end is sent, then what comes is read and
  // dropped for up to kLinger, so that closing with unread bytes (a TCP
  // reset) does not destroy the answer before the client reads it.
  static constexpr auto kLinger = std::chrono::seconds(1);
  static constexpr size_t kLingerBytes = 16 << 20;
  // Refusals answered at once; past both caps a connection is closed
  // unanswered.
  static constexpr int64_t kMostRefusing = 64;

  template <typename Body>
  Task<bool> Reply(Stream& client, http::response<Body>& res, bool keep_alive) {
    res.set(http::field::server, "kvtier-frontend");
    res.keep_alive(keep_alive);
    res.prepare_payload();
    ErrorCode ec;
    // A client that does not read its answer is cut at the client timeout.
    client.expires_after(std::chrono::milliseconds(options.client_timeout_ms));
    co_await http::async_write(client, res, net::redirect_error(kAwait, ec));
    client.expires_never();
    co_return !ec && keep_alive;
  }

  // `retry_after_s` > 0: with that Retry-After.
  Task<bool> ReplyJson(Stream& client, unsigned status, std::string body, bool keep_alive,
                       uint64_t retry_after_s = 0);
  // `retry_after_s` > 0: with that Retry-After.
  Task<bool> ReplyError(Stream& client, std::string endpoint, ApiError e, bool keep_alive,
                        uint64_t retry_after_s = 0);
  // A request bound for an engine, as read.
  struct Incoming {
    Endpoint endpoint = Endpoint::kCompletions;
    std::string path;
    std::string name;                 // its endpoint in metrics
    std::string session_id;           // the client's x-session-id ("" for none)
    std::optional<ApiKeys::Key> key;  // the key it presented (--api-keys-file)
    Clock::time_point arrived;
    bool keep_alive = true;
  };
  // A completion, a chat or a pass-through: prepared, charged to its key's
  // token rate, given its turn (--max-concurrent-requests), then tried on
  // the engines the router chooses, in turn (server.cc).
  Task<bool> Proxy(Stream& client, const Incoming& in, const std::string& body);
  // Waits before the `round`th retry of every usable engine.
  Task<> Backoff(uint32_t round);
  // One client connection's requests (session.cc).
  Task<> Session(Socket socket);
  Task<> Linger(Stream& client);
  // A connection past --max-connections: answered 503 with Retry-After
  // (within the client timeout) and closed.
  Task<> Refuse(Socket socket);
  Task<> Accept();
};

}  // namespace kvtier::frontend
