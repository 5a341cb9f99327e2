#include "common/data_hello.h"

#include "openssl/crypto.h"
#include "openssl/evp.h"
#include "openssl/hmac.h"
#include "openssl/rand.h"

namespace kvtier::wire {
namespace {
constexpr std::string_view kHelloLabel = "kvtier data-plane hello v1";
}  // namespace

std::string HelloProof(std::string_view key, std::string_view nonce, std::string_view id) {
  std::string msg;
  msg.reserve(kHelloLabel.size() + nonce.size() + id.size());
  msg.append(kHelloLabel).append(nonce).append(id);
  std::string out(kProofBytes, '\0');
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
           reinterpret_cast<unsigned char*>(out.data()), &len) == nullptr ||
      len != kProofBytes) {
    return {};
  }
  return out;
}

std::string HelloPayload(std::string_view session, std::string_view nonce) {
  if (session.size() != kSocketSessionBytes) return {};
  const std::string_view id = session.substr(0, kSessionIdBytes);
  std::string proof = HelloProof(session.substr(kSessionIdBytes), nonce, id);
  if (proof.empty()) return {};
  return std::string(id) + proof;
}

bool ProofHolds(std::string_view key, std::string_view nonce, std::string_view id,
                std::string_view proof) {
  const std::string want = HelloProof(key, nonce, id);
  return !want.empty() && proof.size() == want.size() &&
         CRYPTO_memcmp(want.data(), proof.data(), want.size()) == 0;
}

std::string FreshNonce() {
  std::string n(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    return {};
  }
  return n;
}

}  // namespace kvtier::wire
