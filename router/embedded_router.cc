#include "router/embedded_router.h"

#include <algorithm>
#include <chrono>

namespace kvtier::router {

ExpiryTimer::ExpiryTimer(RouterCore* core, uint64_t heartbeat_deadline_ms) {
  const auto period =
      std::chrono::milliseconds(std::clamp<uint64_t>(heartbeat_deadline_ms / 4, 10, 100));
  thread_ = std::thread([this, core, period] {
    std::unique_lock lk(mu_);
    while (!cv_.wait_for(lk, period, [this] { return stop_; })) {
      core->ExpireSources(std::chrono::steady_clock::now());
    }
  });
}

ExpiryTimer::~ExpiryTimer() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

EmbeddedRouter::EmbeddedRouter(const RouterOptions& options) : core_(options), service_(&core_) {}

absl::StatusOr<std::unique_ptr<EmbeddedRouter>> EmbeddedRouter::Start(const RouterOptions& options,
                                                                      const std::string& listen) {
  if (auto s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<EmbeddedRouter> r(new EmbeddedRouter(options));
  auto started = StartGrpcServer({"kvtier embedded router",
                                  listen,
                                  grpc::InsecureServerCredentials(),
                                  {&r->service_},
                                  64ull << 20});
  if (!started.ok()) return started.status();
  r->server_ = std::move(*started);
  r->expiry_ = std::make_unique<ExpiryTimer>(&r->core_, options.heartbeat_deadline_ms);
  return r;
}

EmbeddedRouter::~EmbeddedRouter() {
  if (server_.server) {
    server_.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.server->Wait();
  }
  expiry_.reset();
}

}  // namespace kvtier::router
