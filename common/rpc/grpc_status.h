// absl::Status <-> grpc::Status, keeping the code and the message; a
// status's message prefixed once.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Trailing metadata a kvtier server adds to an error it answered itself
// where the code could also mean "not reached" (UNAVAILABLE), so a client
// can tell the two apart (kvctl's exit codes).
inline constexpr char kAnsweredByServer[] = "kvtier-answered-by";

// The status with `prefix` in front of its message, once (a status that
// already names the operation keeps its message).
inline absl::Status Prefixed(const absl::Status& s, const std::string& prefix) {
  if (absl::StartsWith(s.message(), prefix)) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace kvtier
