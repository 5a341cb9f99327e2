// Milliseconds since a steady-clock point, as a double: the one helper the
// data client, the connector and the benchmarks time their steps with.
#pragma once

#include <chrono>

namespace kvtier {

inline double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace kvtier
