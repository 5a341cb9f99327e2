// Upstream connections to the engines: a fresh connection within the
// connect timeout, and each engine's idle keep-alive connections, kept per
// thread (a pooled connection is reused only by the thread whose reactor
// it is registered with).
#pragma once

#include <cstdint>
#include <memory>

#include "frontend/asio.h"
#include "frontend/fleet.h"

namespace kvtier::frontend {

// A new connection to `e` (resolved, connected, TCP_NODELAY), or nullptr
// with `ec` saying why.
Task<std::unique_ptr<Stream>> Connect(Engine& e, uint64_t connect_timeout_ms, ErrorCode& ec);

// An idle connection older than this is dropped, not reused: uvicorn
// (vLLM's server) closes keep-alive connections idle for 5 s, and a request
// sent on one it is closing fails and must be sent again.
inline constexpr auto kPoolIdle = std::chrono::seconds(4);

// This thread's newest idle connection to `e` younger than kPoolIdle (the
// older ones are dropped), or nullptr.
std::shared_ptr<Stream> TakeIdle(Engine& e, Clock::time_point now = Clock::now());

// `s` is idle now: kept for reuse while this thread holds fewer than
// `share` of `e`'s idle connections, else closed.
void ReturnIdle(Engine& e, std::shared_ptr<Stream> s, size_t share,
                Clock::time_point now = Clock::now());

}  // namespace kvtier::frontend
