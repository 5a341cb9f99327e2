// absl::Status <-> grpc::Status, keeping the code and the message.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace kvtier {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Trailing metadata a kvtier server adds to an error it answered itself
// where the code could also mean "not reached" (UNAVAILABLE), so a client
// can tell the two apart (kvctl's exit codes).
inline constexpr char kAnsweredByServer[] = "kvtier-answered-by";

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace kvtier
