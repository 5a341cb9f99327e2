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
    publishers_.push_back(std::make_unique<EventPublisher>(po, [this] { return Load(); }));
  }
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
