#include "common/log.h"

#include <unistd.h>

#include <atomic>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtier {

namespace {
std::atomic<bool> quiet{false};
}  // namespace

void SetLogQuiet(bool q) { quiet = q; }

void LogLine(absl::string_view component, absl::string_view message) {
  if (quiet) return;
  std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                   component, ": ", message, "\n");
  // One write() so concurrent lines do not interleave.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace kvtier
