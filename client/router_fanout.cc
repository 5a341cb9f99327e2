#include "client/router_fanout.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier {

absl::StatusOr<std::vector<std::string>> RouterFanout::Resolve(const std::string& target) {
  const size_t colon = target.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(target.substr(colon + 1), &port) ||
      port == 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("router address \"", target, "\" is not HOST:PORT"));
  }
  std::string host = target.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_ADDRCONFIG;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res); rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("router host \"", host, "\" does not resolve: ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof buf);
      out.push_back(absl::StrCat(buf, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf, sizeof buf);
      out.push_back(absl::StrCat("[", buf, "]:", port));
    }
  }
  freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty())
    return absl::NotFoundError(absl::StrCat("router host \"", host, "\" has no address"));
  return out;
}

RouterFanout::RouterFanout(std::vector<std::string> targets, PublisherOptions base,
                           EventPublisher::LoadFn load, uint64_t refresh_ms)
    : targets_(std::move(targets)),
      base_(std::move(base)),
      load_(std::move(load)),
      refresh_ms_(refresh_ms) {
  Refresh();
  if (refresh_ms_ > 0) refresher_ = std::thread([this] { Loop(); });
}

RouterFanout::~RouterFanout() { Stop(); }

void RouterFanout::Stop() {
  std::map<std::string, std::unique_ptr<EventPublisher>> gone;
  {
    std::lock_guard lk(mu_);
    if (stop_) return;
    stop_ = true;
    gone.swap(publishers_);
  }
  cv_.notify_all();
  if (refresher_.joinable()) refresher_.join();
  for (auto& [addr, p] : gone) p->Stop();
}

void RouterFanout::Loop() {
  std::unique_lock lk(mu_);
  while (!cv_.wait_for(lk, std::chrono::milliseconds(refresh_ms_), [this] { return stop_; })) {
    lk.unlock();
    Refresh();
    lk.lock();
  }
}

void RouterFanout::Refresh() {
  // Resolve without the lock (a slow DNS must not hold up events).
  std::map<std::string, absl::StatusOr<std::vector<std::string>>> now;
  for (const auto& t : targets_) now.emplace(t, Resolve(t));
  std::vector<std::unique_ptr<EventPublisher>> stopped;
  {
    std::lock_guard lk(mu_);
    if (stop_) return;
    for (auto& [t, r] : now) {
      if (r.ok()) {
        resolved_[t] = std::set<std::string>(r->begin(), r->end());
      } else if (!resolved_.count(t)) {
        Log("router-fanout", r.status().message(), "; trying again in ", refresh_ms_, " ms");
      }
    }
    std::set<std::string> wanted;
    for (const auto& [t, addrs] : resolved_) wanted.insert(addrs.begin(), addrs.end());
    for (auto it = publishers_.begin(); it != publishers_.end();) {
      if (wanted.count(it->first)) {
        ++it;
        continue;
      }
      Log("router-fanout", "router ", it->first,
          " is gone from the names: stopped publishing to it");
      stopped.push_back(std::move(it->second));
      it = publishers_.erase(it);
    }
    for (const auto& addr : wanted) {
      if (publishers_.count(addr)) continue;
      PublisherOptions po = base_;
      po.router = addr;
      auto p = std::make_unique<EventPublisher>(po, load_);
      // Seeded with everything held, per namespace, in bounded events.
      std::map<uint64_t, std::vector<BlockHash>> by_ns;
      for (const BlockKey& k : held_) by_ns[k.ns].push_back(k.hash);
      for (auto& [ns, hashes] : by_ns) {
        for (size_t i = 0; i < hashes.size(); i += 4096) {
          p->Stored(ns, std::vector<BlockHash>(hashes.begin() + i,
                                               hashes.begin() + std::min(hashes.size(), i + 4096)));
        }
      }
      if (!publishers_.empty() || !held_.empty()) {
        Log("router-fanout", "router ", addr, " appeared: publishing to it (", held_.size(),
            " blocks)");
      }
      publishers_.emplace(addr, std::move(p));
    }
  }
  for (auto& p : stopped) p->Stop();
}

void RouterFanout::Stored(uint64_t ns, const std::vector<BlockHash>& hashes) {
  std::lock_guard lk(mu_);
  for (const auto& h : hashes) held_.insert(BlockKey{ns, h});
  for (auto& [addr, p] : publishers_) p->Stored(ns, hashes);
}

void RouterFanout::Removed(uint64_t ns, const std::vector<BlockHash>& hashes) {
  std::lock_guard lk(mu_);
  for (const auto& h : hashes) held_.erase(BlockKey{ns, h});
  for (auto& [addr, p] : publishers_) p->Removed(ns, hashes);
}

void RouterFanout::Cleared() {
  std::lock_guard lk(mu_);
  held_.clear();
  for (auto& [addr, p] : publishers_) p->Cleared();
}

std::vector<std::string> RouterFanout::Addresses() const {
  std::lock_guard lk(mu_);
  std::vector<std::string> out;
  for (const auto& [addr, p] : publishers_) out.push_back(addr);
  return out;
}

}  // namespace kvtier
