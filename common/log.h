// One line per significant event, to stderr: "2026-11-21T12:00:00.123Z store: message".
// Thread-safe (a single write per line).
#pragma once

#include "absl/strings/string_view.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

void LogLine(absl::string_view component, absl::string_view message);

// Turns event logging off (benchmarks that drive thousands of events).
void SetLogQuiet(bool quiet);

template <typename... Args>
void Log(absl::string_view component, const Args&... args) {
  LogLine(component, absl::StrCat(args...));
}

}  // namespace kvtier
