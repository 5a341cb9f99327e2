#include "router/vllm_chain_map.h"

#include <span>

namespace kvtier::router {

uint8_t VllmChainMap::MediumBit(const std::string& medium) {
  if (medium == "GPU") return 1;
  if (medium == "CPU") return 2;
  return 4;  // disk, or any other tier of the engine's
}

void VllmChainMap::Place(Held& held, uint8_t media, Moved* moved) {
  const Medium was = held.media == 0 ? Medium::kGpu : Fastest(held.media);
  held.media = media;
  if (media != 0 && Fastest(media) != was && moved != nullptr) {
    moved->emplace_back(held.hash, Fastest(media));
  }
}

bool VllmChainMap::OtherGroup(const VllmEvent& e) {
  if (!group_ && e.kind == VllmEvent::kStored && !e.by_hash) group_ = e.group;
  return !group_ || e.group != *group_;
}

std::vector<BlockHash> VllmChainMap::Stored(const VllmEvent& e, VllmSourceStats* stats,
                                            Moved* moved) {
  std::vector<BlockHash> out;
  if (!e.skip_reason.empty() || OtherGroup(e)) {
    stats->skipped += e.hashes.size();
    return out;
  }
  const uint8_t bit = MediumBit(e.medium);
  if (e.by_hash) {
    // Only a block mapped already (from its GPU event) can be placed.
    for (uint64_t h : e.hashes) {
      auto it = map_.find(h);
      if (it == map_.end()) {
        stats->unknown_parents++;
        continue;
      }
      Place(it->second, it->second.media | bit, moved);
    }
    return out;
  }
  // An event built by hand without a block's worth of tokens per hash maps
  // nothing (its tokens are not there to hash).
  if (e.block_size != block_tokens_ ||
      e.token_ids.size() != size_t{block_tokens_} * e.hashes.size()) {
    stats->skipped += e.hashes.size();
    return out;
  }
  BlockHash prev{ns_, e.variant};  // the root of a chain (common/block_key.h)
  if (e.parent) {
    auto it = map_.find(*e.parent);
    if (it == map_.end()) {
      stats->unknown_parents += e.hashes.size();
      return out;
    }
    prev = it->second.hash;
  }
  std::span<const uint32_t> tokens(e.token_ids);
  for (size_t i = 0; i < e.hashes.size(); ++i) {
    prev = NextBlockHash(prev, tokens.subspan(i * block_tokens_, block_tokens_));
    Held& held = map_[e.hashes[i]];
    if (held.media == 0) {
      out.push_back(prev);
      held.hash = prev;  // (a block held already keeps the hash indexed)
    }
    Place(held, held.media | bit, moved);
  }
  return out;
}

std::vector<BlockHash> VllmChainMap::Removed(const VllmEvent& e, VllmSourceStats* stats,
                                             Moved* moved) {
  std::vector<BlockHash> out;
  if (!e.skip_reason.empty() || OtherGroup(e)) {
    stats->skipped += e.hashes.size();
    return out;
  }
  const uint8_t bit = MediumBit(e.medium);
  for (uint64_t h : e.hashes) {
    auto it = map_.find(h);
    if (it == map_.end()) continue;  // never mapped (skipped or before a resync)
    Place(it->second, it->second.media & static_cast<uint8_t>(~bit), moved);
    if (it->second.media != 0) continue;  // another medium of the engine's still holds it
    out.push_back(it->second.hash);
    map_.erase(it);
  }
  return out;
}

}  // namespace kvtier::router
