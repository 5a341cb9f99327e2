#include "router/source_table.h"

#include "router/cost.h"

namespace kvtier::router {

void Source::NoteRoute(RouterClock::time_point now, uint64_t tokens) {
  std::lock_guard lk(routes_mu_);
  recent_routes_.emplace_back(now, tokens);
  if (recent_routes_.size() > 4096) recent_routes_.pop_front();
}

uint64_t Source::InflightSince(RouterClock::time_point cutoff) {
  std::lock_guard lk(routes_mu_);
  while (!recent_routes_.empty() && recent_routes_.front().first < cutoff) {
    recent_routes_.pop_front();
  }
  uint64_t tokens = 0;
  for (const auto& [when, n] : recent_routes_) tokens += n;
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
