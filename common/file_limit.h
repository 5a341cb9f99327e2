// A server's open-file limit: a descriptor per connection, and the usual
// soft limit (1,024) is reached long before memory or the hard limit.
#pragma once

#include <sys/resource.h>

#include <cstdint>

namespace kvtier {

// Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the
// soft limit in force after (unchanged where it cannot be raised).
inline uint64_t RaiseFileLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur < r.rlim_max) {
    rlimit raised = r;
    raised.rlim_cur = r.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  return static_cast<uint64_t>(r.rlim_cur);
}

}  // namespace kvtier
