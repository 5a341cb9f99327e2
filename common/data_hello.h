// The socket data plane's hello (common/data_wire.h): the store proves
// nothing, the client proves it holds the session's key without sending it.
//
// ConnectDataPlane (gRPC, under TLS where the deployment has it) hands a
// client its session as id || key. On a new data-plane connection the store
// first sends a challenge: a Reply with kChallengeMagic and kNonceBytes of
// fresh randomness. The client answers with the hello frame, whose payload
// is the id and HMAC-SHA256(key, kHelloLabel || nonce || id). The key never
// crosses the data plane, and a proof is good for one nonce only, so a
// hello read off the wire opens no other connection (docs/security.md).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvtier::wire {

constexpr size_t kSessionIdBytes = 16;
constexpr size_t kSessionKeyBytes = 32;
// ConnectDataPlaneResponse.session on the socket data plane: id || key.
constexpr size_t kSocketSessionBytes = kSessionIdBytes + kSessionKeyBytes;
constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;  // HMAC-SHA256
// The hello frame's payload: id || proof.
constexpr size_t kHelloBytes = kSessionIdBytes + kProofBytes;

// HMAC-SHA256(key, label || nonce || id). Empty if OpenSSL fails.
std::string HelloProof(std::string_view key, std::string_view nonce, std::string_view id);

// The hello payload for `session` (id || key, as ConnectDataPlane gave it)
// and the store's `nonce`. Empty if the session is not kSocketSessionBytes.
std::string HelloPayload(std::string_view session, std::string_view nonce);

// Whether `proof` is HelloProof(key, nonce, id), compared in constant time.
bool ProofHolds(std::string_view key, std::string_view nonce, std::string_view id,
                std::string_view proof);

// kNonceBytes of randomness from OpenSSL's generator; empty if it fails.
std::string FreshNonce();

}  // namespace kvtier::wire
