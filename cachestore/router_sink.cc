#include "cachestore/router_sink.h"

namespace kvtier::store {

RouterSink::RouterSink(const std::vector<std::string>& routers, const ChannelSecurity& security,
                       const std::string& store_id, const std::string& endpoint,
                       uint64_t heartbeat_ms, uint64_t refresh_ms) {
  PublisherOptions po;
  po.security = security;
  po.hello.set_source_id(store_id);
  po.hello.set_endpoint(endpoint);
  po.hello.set_kind(v1::SOURCE_STORE);
  po.heartbeat_ms = heartbeat_ms;
  fanout_ = std::make_unique<RouterFanout>(
      routers, po, [this] { return Load(); }, refresh_ms);
}

void RouterSink::SetFetchFigures(FiguresFn figures) {
  std::lock_guard lk(mu_);
  figures_ = std::move(figures);
}

v1::Heartbeat RouterSink::Load() {
  v1::Heartbeat h;
  std::lock_guard lk(mu_);
  if (!figures_) return h;
  for (const auto& f : figures_()) {
    auto* t = h.add_fetch();
    t->set_tier(f.tier);
    t->set_blocks(f.blocks);
    t->set_bytes_per_s(f.bytes_per_s());
    t->set_us_per_block(f.us_per_block());
    t->set_queue_depth(f.queue_depth);
  }
  return h;
}

RouterSink::~RouterSink() { fanout_->Stop(); }

void RouterSink::Stored(uint64_t ns, const std::vector<BlockHash>& hashes) {
  fanout_->Stored(ns, hashes);
}

void RouterSink::Removed(uint64_t ns, const std::vector<BlockHash>& hashes) {
  fanout_->Removed(ns, hashes);
}

}  // namespace kvtier::store
