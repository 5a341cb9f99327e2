// The kvtier.v1.Router gRPC service over a RouterCore. Thread-safe.
#pragma once

#include <atomic>
#include <functional>

#include "common/histogram.h"
#include "common/rpc/metrics.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "router/router_core.h"
#include "router/source_auth.h"

namespace kvtier::router {

class RouterService final : public v1::Router::Service {
 public:
  explicit RouterService(RouterCore* core) : core_(core) {}

  grpc::Status StreamEvents(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::RouterCommand, v1::SourceMessage>* stream) override;
  grpc::Status Publish(grpc::ServerContext*, const v1::PublishRequest*,
                       v1::PublishResponse*) override;
  grpc::Status Route(grpc::ServerContext*, const v1::RouteRequest*, v1::RouteResponse*) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse*) override;
  grpc::Status GetRouterStats(grpc::ServerContext*, const v1::GetRouterStatsRequest*,
                              v1::GetRouterStatsResponse*) override;

  // Prometheus families for a scrape (docs/operations.md lists them).
  std::vector<prometheus::MetricFamily> CollectMetrics();

  // Adds to GetRouterStats what lives outside the core (vLLM subscribers).
  // Set before serving.
  void SetExtraStats(std::function<void(v1::GetRouterStatsResponse*)> extra) {
    extra_stats_ = std::move(extra);
  }
  // Who may speak for which source (router/source_auth.h). Set before serving.
  void SetSourceAuth(SourceAuth auth) { auth_ = std::move(auth); }

 private:
  RouterCore* core_;
  std::function<void(v1::GetRouterStatsResponse*)> extra_stats_;
  SourceAuth auth_;
  std::atomic<uint64_t> hellos_refused_{0};
  // PERMISSION_DENIED (counted) unless the caller's certificate may speak for hello's source.
  grpc::Status Authorize(const grpc::ServerContext& ctx, const v1::Hello& hello);
  LatencyHistogram route_latency_;
};

}  // namespace kvtier::router
