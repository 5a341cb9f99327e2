#include "cachestore/router_sink.h"

namespace kvtier::store {

RouterSink::RouterSink(const std::vector<std::string>& routers, const ChannelSecurity& security,
                       const std::string& store_id, uint64_t heartbeat_ms) {
  for (const auto& r : routers) {
    PublisherOptions po;
    po.router = r;
    po.security = security;
    po.hello.set_source_id(store_id);
    po.hello.set_kind(v1::SOURCE_STORE);
    po.heartbeat_ms = heartbeat_ms;
    publishers_.push_back(std::make_unique<EventPublisher>(po));
  }
}

RouterSink::~RouterSink() {
  for (auto& p : publishers_) p->Stop();
}

void RouterSink::Stored(uint64_t ns, const std::vector<BlockHash>& hashes) {
  for (auto& p : publishers_) p->Stored(ns, hashes);
}

void RouterSink::Removed(uint64_t ns, const std::vector<BlockHash>& hashes) {
  for (auto& p : publishers_) p->Removed(ns, hashes);
}

}  // namespace kvtier::store
