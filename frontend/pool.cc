#include "frontend/pool.h"

namespace kvtier::frontend {

Task<std::unique_ptr<Stream>> Connect(Engine& e, uint64_t connect_timeout_ms, ErrorCode& ec) {
  auto exec = co_await net::this_coro::executor;
  Resolver resolver(exec);
  auto results = co_await resolver.async_resolve(e.host, e.port, net::redirect_error(kAwait, ec));
  if (ec) co_return nullptr;
  auto s = std::make_unique<Stream>(exec);
  s->expires_after(std::chrono::milliseconds(connect_timeout_ms));
  co_await s->async_connect(results, net::redirect_error(kAwait, ec));
  if (ec) co_return nullptr;
  s->socket().set_option(tcp::no_delay(true));
  co_return s;
}

std::shared_ptr<Stream> TakeIdle(Engine& e, Clock::time_point now) {
  std::lock_guard lk(e.mu);
  if (e.idle.size() <= t_loop) return nullptr;
  std::vector<Engine::Idle>& idle = e.idle[t_loop];
  // The newest are last; everything before an expired one is older still.
  for (size_t i = idle.size(); i > 0; --i) {
    if (now - idle[i - 1].since > kPoolIdle) {
      idle.erase(idle.begin(), idle.begin() + static_cast<long>(i));
      break;
    }
  }
  if (idle.empty()) return nullptr;
  auto s = std::move(idle.back().stream);
  idle.pop_back();
  return s;
}

void ReturnIdle(Engine& e, std::shared_ptr<Stream> s, size_t share, Clock::time_point now) {
  std::lock_guard lk(e.mu);
  if (e.removed) return;
  if (e.idle.size() <= t_loop) e.idle.resize(t_loop + 1);
  std::vector<Engine::Idle>& idle = e.idle[t_loop];
  if (idle.size() < std::max<size_t>(1, share)) idle.push_back({std::move(s), now});
}

}  // namespace kvtier::frontend
