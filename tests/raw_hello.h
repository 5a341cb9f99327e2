// The socket data plane's hello for tests that write the wire format
// themselves (common/data_wire.h, common/data_hello.h).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/data_hello.h"
#include "common/data_wire.h"
#include "common/socket_io.h"

namespace kvtier::testing {

// The nonce of the challenge the store sends first on a new connection.
inline absl::StatusOr<std::string> ReadChallenge(int fd, net::Clock::time_point deadline) {
  wire::Reply r;
  if (auto s = net::ReadAll(fd, &r, sizeof(r), deadline); !s.ok()) return s;
  if (r.magic != wire::kChallengeMagic || r.message_bytes != 0 ||
      r.data_bytes != wire::kNonceBytes) {
    return absl::InternalError("the store's first message is not a challenge");
  }
  std::string nonce(wire::kNonceBytes, '\0');
  if (auto s = net::ReadAll(fd, nonce.data(), nonce.size(), deadline); !s.ok()) return s;
  return nonce;
}

// The hello payload a client sends for `session` and `nonce`: the real one
// for a session ConnectDataPlane handed out (id and key); for anything else
// (a forged session) its first bytes as the id and a proof of zeros.
inline std::string HelloFor(const std::string& session, const std::string& nonce) {
  std::string p = wire::HelloPayload(session, nonce);
  if (!p.empty()) return p;
  std::string id = session.substr(0, wire::kSessionIdBytes);
  id.resize(wire::kSessionIdBytes, '\0');
  return id + std::string(wire::kProofBytes, '\0');
}

}  // namespace kvtier::testing
