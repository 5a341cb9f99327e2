#include "router/vllm_chain_map.h"

#include <span>

namespace kvtier::router {

std::vector<BlockHash> VllmChainMap::Stored(const VllmEvent& e, VllmSourceStats* stats) {
  std::vector<BlockHash> out;
  // An event the decoder marked skipped, or one built by hand without a
  // block's worth of tokens per hash, maps nothing (its tokens are not there
  // to hash).
  if (!e.skip_reason.empty() || e.block_size != block_tokens_ ||
      e.token_ids.size() != size_t{block_tokens_} * e.hashes.size()) {
    stats->skipped += e.hashes.size();
    return out;
  }
  BlockHash prev{ns_, 0};  // the root of a chain (common/block_key.h)
  if (e.parent) {
    auto it = map_.find(*e.parent);
    if (it == map_.end()) {
      stats->unknown_parents += e.hashes.size();
      return out;
    }
    prev = it->second;
  }
  std::span<const uint32_t> tokens(e.token_ids);
  for (size_t i = 0; i < e.hashes.size(); ++i) {
    prev = NextBlockHash(prev, tokens.subspan(i * block_tokens_, block_tokens_));
    map_[e.hashes[i]] = prev;
    out.push_back(prev);
  }
  return out;
}

std::vector<BlockHash> VllmChainMap::Removed(const VllmEvent& e, VllmSourceStats* stats) {
  std::vector<BlockHash> out;
  for (uint64_t h : e.hashes) {
    auto it = map_.find(h);
    if (it == map_.end()) continue;  // never mapped (skipped or before a resync)
    out.push_back(it->second);
    map_.erase(it);
  }
  (void)stats;
  return out;
}

}  // namespace kvtier::router
