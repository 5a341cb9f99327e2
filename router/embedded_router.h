// A router inside the caller's own process, the way Dynamo's KV router
// lives in its frontend: the routing core, the kvtier.v1.Router service its
// sources (workers, store shards) publish to, and the timer that drops
// silent sources. Route() asks the core directly, so a request's route
// costs the decision (microseconds) and no round trip. kvtier-router is the
// same parts as a process of its own (router/main.cc).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/rpc/grpc_server.h"
#include "router/router_core.h"
#include "router/service.h"

namespace kvtier::router {

// Calls RouterCore::ExpireSources every quarter of the heartbeat deadline
// (10..100 ms) on a thread of its own, from construction to destruction.
class ExpiryTimer {
 public:
  ExpiryTimer(RouterCore* core, uint64_t heartbeat_deadline_ms);
  ~ExpiryTimer();
  ExpiryTimer(const ExpiryTimer&) = delete;
  ExpiryTimer& operator=(const ExpiryTimer&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

class EmbeddedRouter {
 public:
  // Validates `options` (INVALID_ARGUMENT naming the field) and listens for
  // sources on `listen` (host:port, port 0: any free one; UNAVAILABLE if it
  // cannot), without TLS: for a frontend and its sources on one host or a
  // trusted network (docs/security.md).
  static absl::StatusOr<std::unique_ptr<EmbeddedRouter>> Start(const RouterOptions& options,
                                                               const std::string& listen);
  // Stops the listener (1 s grace for calls in flight) and the timer.
  ~EmbeddedRouter();
  EmbeddedRouter(const EmbeddedRouter&) = delete;
  EmbeddedRouter& operator=(const EmbeddedRouter&) = delete;

  // Where sources publish (host:port).
  std::string address() const { return server_.address(); }
  // Thread-safe (RouterCore is): route from any thread.
  absl::StatusOr<RouteResult> Route(const RouteQuery& query) { return core_.Route(query); }
  RouterCore& core() { return core_; }

 private:
  explicit EmbeddedRouter(const RouterOptions& options);
  RouterCore core_;
  RouterService service_;
  StartedServer server_;
  std::unique_ptr<ExpiryTimer> expiry_;
};

}  // namespace kvtier::router
