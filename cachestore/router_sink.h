// A ChangeSink that publishes a store shard's blocks to routers as an event
// source of kind STORE (router.proto): one EventPublisher per router, each
// with its own stream, heartbeats and reconnects. kvtier-store's main wires
// it to the Store, so the store itself knows nothing of the router protocol.
// Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cachestore/change_feed.h"
#include "client/router_client.h"

namespace kvtier::store {

class RouterSink : public ChangeSink {
 public:
  RouterSink(const std::vector<std::string>& routers, const ChannelSecurity& security,
             const std::string& store_id, uint64_t heartbeat_ms);
  // Stops every publisher.
  ~RouterSink() override;

  void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) override;
  void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) override;

 private:
  std::vector<std::unique_ptr<EventPublisher>> publishers_;
};

}  // namespace kvtier::store
