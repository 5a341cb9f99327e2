// The block hash of a key an engine names a block by (vLLM's offload keys,
// SGLang's page keys): the one engine-key->hash function, which every
// integration takes from here (Python: kvtier.dtypes.engine_key_hashes).
// Pure; thread-safe.
#pragma once

#include <string_view>

#include "common/block_key.h"

namespace kvtier {

// XXH3-128 of the key's bytes.
BlockHash EngineKeyHash(std::string_view key);

}  // namespace kvtier
