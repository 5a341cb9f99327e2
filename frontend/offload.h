// Work too long for an I/O thread (tokenizing a large prompt, rendering a
// long chat through its template) runs on a pool of its own, and the
// coroutine that asked resumes on its own thread: streams served by that
// thread go on meanwhile.
#pragma once

#include <type_traits>
#include <utility>

#include "frontend/asio.h"

namespace kvtier::frontend {

template <class F>
Task<std::invoke_result_t<F&>> OffThread(net::thread_pool& pool, F f) {
  using R = std::invoke_result_t<F&>;
  const Executor home = co_await net::this_coro::executor;
  auto initiate = [&pool, home, f = std::move(f)](auto handler) mutable {
    net::post(pool, [home, f = std::move(f), handler = std::move(handler)]() mutable {
      R result = f();
      net::post(home, [result = std::move(result), handler = std::move(handler)]() mutable {
        std::move(handler)(std::move(result));
      });
    });
  };
  R result = co_await net::async_initiate<const net::use_awaitable_t<Executor>&, void(R)>(
      std::move(initiate), kAwait);
  co_return result;
}

}  // namespace kvtier::frontend
