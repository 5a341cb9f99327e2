#include "common/rendezvous.h"

#include <xxhash.h>

namespace kvtier {

uint64_t RendezvousScore(uint64_t key, std::string_view member) {
  return XXH3_64bits_withSeed(member.data(), member.size(), key);
}

size_t RendezvousPick(uint64_t key, const std::vector<std::string>& members) {
  size_t best = 0;
  uint64_t best_score = RendezvousScore(key, members[0]);
  for (size_t i = 1; i < members.size(); ++i) {
    uint64_t s = RendezvousScore(key, members[i]);
    if (s > best_score) {
      best = i;
      best_score = s;
    }
  }
  return best;
}

uint64_t RendezvousKey(const BlockKey& key) {
  const uint64_t k[3] = {key.ns, key.hash.hi, key.hash.lo};
  return XXH3_64bits(k, sizeof(k));
}

}  // namespace kvtier
