// kvctl lookup: which blocks of a prompt each store shard holds, and in
// which tier.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "common/limits.h"

namespace kvtier::cli {

int RunLookup(const CommandLine& line) {
  SharedFlags c;
  PromptFlags prompt_flags;
  int64_t block_tokens = 16;
  FlagSet f("kvctl lookup", "Which blocks of a prompt each store shard holds, and in which tier.");
  c.Register(f, SharedFlags::Dials::kStores);
  prompt_flags.Register(f, "File of token ids (hashed with --block-tokens)");
  f.Int("block-tokens", &block_tokens, limits::kMinBlockTokens, limits::kMaxBlockTokens,
        "Tokens per block for --tokens");
  ParseCommandFlags(f, line);
  auto prompt = prompt_flags.Read();
  if (!prompt.ok()) {
    std::fprintf(stderr, "kvctl lookup: %s\n", std::string(prompt.status().message()).c_str());
    return kUsage;
  }
  // The store is asked by block hash, so token ids are hashed here.
  std::vector<BlockHash> chain =
      prompt->from_tokens
          ? ChainHashes(prompt->ns, prompt->tokens, static_cast<uint32_t>(block_tokens))
          : prompt->hashes;
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    auto tiers = client.Lookup(prompt->ns, chain);
    if (!tiers.ok()) return Report(tiers.status(), "store " + addr);
    nlohmann::json blocks = nlohmann::json::array();
    for (size_t i = 0; i < chain.size(); ++i) {
      std::string where = i < tiers->size() ? TierName((*tiers)[i]) : "absent";
      blocks.push_back({{"index", i}, {"hash", ToHex(chain[i])}, {"tier", where}});
      if (!c.json)
        std::printf("%-22s %5zu %s %s\n", addr.c_str(), i, ToHex(chain[i]).c_str(), where.c_str());
    }
    j[addr] = {{"present_prefix", tiers->size()}, {"blocks", blocks}};
    if (!c.json)
      std::printf("%s: leading %zu of %zu blocks present\n", addr.c_str(), tiers->size(),
                  chain.size());
  }
  if (c.json) PrintJson(j);
  return kOk;
}

}  // namespace kvtier::cli
