// A ChangeSink that publishes a store shard's blocks to routers as an event
// source of kind STORE (router.proto): to every address each --router name
// resolves to (client/router_fanout.h), each with its own stream,
// heartbeats and reconnects. kvtier-store's main wires
// it to the Store, so the store itself knows nothing of the router protocol.
// Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <functional>
#include <mutex>

#include "cachestore/change_feed.h"
#include "cachestore/fetch_meter.h"
#include "client/router_client.h"
#include "client/router_fanout.h"

namespace kvtier::store {

class RouterSink : public ChangeSink {
 public:
  // `endpoint`: the shard's gRPC address as routers show it ("" : none).
  RouterSink(const std::vector<std::string>& routers, const ChannelSecurity& security,
             const std::string& store_id, const std::string& endpoint, uint64_t heartbeat_ms,
             uint64_t refresh_ms = 5000);
  // Stops every publisher.
  ~RouterSink() override;

  void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) override;
  void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) override;

  // Where heartbeats read the shard's fetch figures from (nullptr: none).
  // The caller unsets it before the function's owner goes away.
  using FiguresFn = std::function<std::vector<TierFetchFigures>()>;
  void SetFetchFigures(FiguresFn figures);

 private:
  v1::Heartbeat Load();

  std::mutex mu_;
  FiguresFn figures_;
  std::unique_ptr<RouterFanout> fanout_;
};

}  // namespace kvtier::store
