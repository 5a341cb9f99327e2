// The router core's plain types (router/source_messages.h) to and from the
// kvtier.v1 wire messages (router.proto): the one place they meet, used by
// the gRPC service and the in-process benchmarks.
#pragma once

#include "kvtier/v1/router.pb.h"
#include "router/router_core.h"
#include "router/source_messages.h"

namespace kvtier::router {

SourceKind FromWire(v1::SourceKind kind);
v1::SourceKind ToWire(SourceKind kind);
SourceHello FromWire(const v1::Hello& hello);
SourceLoad FromWire(const v1::Heartbeat& heartbeat);
void ToWire(const SourceLoad& load, v1::Heartbeat* out);
// A message whose oneof is unset becomes std::monostate.
SourceMessage FromWire(const v1::SourceMessage& message);
void ToWire(const RouterCommand& command, v1::RouterCommand* out);
// Reads the request's hashes in place: `request` must outlive the query.
RouteQuery FromWire(const v1::RouteRequest& request);
void ToWire(const RouteResult& result, v1::RouteResponse* out);
void ToWire(const SourceInfo& info, v1::SourceInfo* out);
void ToWire(const RouterStats& stats, v1::GetRouterStatsResponse* out);

}  // namespace kvtier::router
