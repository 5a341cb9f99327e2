// ParallelFor: a loop over independent items spread over a few threads
// started for it (the caller's among them), for work measured in bytes,
// such as hashing many blocks, where a thread's start is only worth it
// past a few MiB. Header-only; no pool.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace kvtier {

// Runs fn(i) for every i in [0, n), interleaved over up to `threads`
// threads and no more than one per `bytes_per_thread` of the loop's
// `bytes`; returns once all ran. A thread that cannot be started leaves
// its share to the caller. fn must be safe to call from several threads
// for different i.
template <typename Fn>
void ParallelFor(size_t n, uint64_t bytes, uint64_t bytes_per_thread, int threads, Fn fn) {
  const uint64_t by_size = std::max<uint64_t>(1, bytes / std::max<uint64_t>(1, bytes_per_thread));
  const size_t parts = static_cast<size_t>(std::min<uint64_t>(
      {by_size, static_cast<uint64_t>(std::max(threads, 1)), std::max<uint64_t>(1, n)}));
  auto run = [&](size_t part) {
    for (size_t i = part; i < n; i += parts) fn(i);
  };
  std::vector<std::thread> helpers;
  for (size_t p = 1; p < parts; ++p) {
    try {
      helpers.emplace_back(run, p);
    } catch (const std::system_error&) {
      run(p);
    }
  }
  run(0);
  for (auto& t : helpers) t.join();
}

}  // namespace kvtier
