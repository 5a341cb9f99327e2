// The Asio and Beast types every part of kvtier-frontend shares. Every
// socket, timer and coroutine runs on one thread's io_context, named by its
// concrete executor type: no strands and no type-erased executor on the
// request path (they were a fifth of the frontend's CPU per request).
#pragma once

// <utility> before Asio: Boost 1.74's awaitable.hpp uses std::exchange
// without including it.
#include <utility>
// clang-format off
#include <boost/asio.hpp>
#include <boost/beast.hpp>
// clang-format on

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace kvtier::frontend {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using ErrorCode = boost::system::error_code;
using Executor = net::io_context::executor_type;
template <typename T = void>
using Task = net::awaitable<T, Executor>;
using Stream = beast::basic_stream<tcp, Executor>;
using Socket = net::basic_stream_socket<tcp, Executor>;
using Timer = net::basic_waitable_timer<Clock, net::wait_traits<Clock>, Executor>;
using Resolver = net::ip::basic_resolver<tcp, Executor>;
using Acceptor = net::basic_socket_acceptor<tcp, Executor>;
inline constexpr net::use_awaitable_t<Executor> kAwait;

// The io_context (by index) this thread runs: a pooled upstream connection
// is reused only by the thread whose reactor it is registered with.
inline thread_local size_t t_loop = 0;

inline int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace kvtier::frontend
