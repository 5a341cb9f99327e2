#include "router/source_table.h"

#include "absl/container/flat_hash_set.h"
#include "router/cost.h"

namespace kvtier::router {

void Source::NoteRoute(RouterClock::time_point now, uint64_t tokens, uint64_t request_id) {
  std::lock_guard lk(routes_mu_);
  recent_routes_.push_back({now, tokens, request_id});
  if (recent_routes_.size() > 4096) recent_routes_.pop_front();
}

uint64_t Source::InflightAfter(RouterClock::time_point cutoff, RouterClock::time_point id_cutoff,
                               const std::vector<uint64_t>& arrived) {
  const absl::flat_hash_set<uint64_t> listed(arrived.begin(), arrived.end());
  std::lock_guard lk(routes_mu_);
  uint64_t tokens = 0;
  std::deque<RecentRoute> kept;
  for (const RecentRoute& r : recent_routes_) {
    const bool on_way = r.request_id == 0 ? r.when >= cutoff
                                          : r.when >= id_cutoff && !listed.contains(r.request_id);
    if (!on_way) continue;
    tokens += r.tokens;
    kept.push_back(r);
  }
  recent_routes_.swap(kept);
  return tokens;
}

Source* SourceTable::Find(const std::string& id) const {
  auto it = sources_.find(id);
  return it == sources_.end() ? nullptr : it->second.get();
}

Source& SourceTable::Add(const SourceHello& hello, RouterClock::time_point now) {
  auto s = std::make_unique<Source>();
  if (free_nums_.empty()) {
    s->num = static_cast<SourceNum>(by_num_.size());
    by_num_.push_back(nullptr);
  } else {
    s->num = free_nums_.back();
    free_nums_.pop_back();
  }
  s->hello = hello;
  s->id_hash = WorkerIdHash(hello.source_id);
  s->last_seen = now;
  by_num_[s->num] = s.get();
  Source& ref = *s;
  sources_.emplace(hello.source_id, std::move(s));
  return ref;
}

void SourceTable::Remove(const std::string& id) {
  auto it = sources_.find(id);
  if (it == sources_.end()) return;
  by_num_[it->second->num] = nullptr;
  free_nums_.push_back(it->second->num);
  sources_.erase(it);
}

std::vector<std::string> SourceTable::Silent(RouterClock::time_point now,
                                             std::chrono::milliseconds deadline) const {
  std::vector<std::string> out;
  for (const auto& [id, s] : sources_) {
    if (now - s->last_seen > deadline) out.push_back(id);
  }
  return out;
}

}  // namespace kvtier::router
