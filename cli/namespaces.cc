// kvctl namespaces: the namespaces each store shard has registered.
#include <cstdio>
#include <string>

#include "absl/strings/str_format.h"
#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/grpc_status.h"

namespace kvtier::cli {

namespace {

// kvctl namespaces rm ID: forget a namespace on every shard and drop its
// blocks, after the operator confirms.
int RunRemove(const CommandLine& line) {
  SharedFlags c;
  bool yes = false;
  FlagSet f("kvctl namespaces rm",
            "Forget namespace ID (hex, as kvctl namespaces prints it) on every shard and drop its "
            "blocks from every tier; workers may register it again. An admin RPC. Asks for "
            "confirmation unless --yes.");
  c.Register(f, SharedFlags::Dials::kStores);
  f.Bool("yes", &yes, "Do not ask");
  std::vector<std::string> positional;
  ParseCommandFlags(f, line, &positional, 1);
  if (positional.size() != 1) {
    std::fprintf(
        stderr,
        "kvctl namespaces rm: name one namespace id (kvctl namespaces rm 00c0ffee00c0ffee)\n");
    return kUsage;
  }
  auto id = ParseNamespace(positional[0]);
  if (!id.ok()) {
    std::fprintf(stderr, "kvctl namespaces rm: %s\n", std::string(id.status().message()).c_str());
    return kUsage;
  }
  if (!yes) {
    const std::string what = "remove namespace " + positional[0] + " and drop its blocks";
    if (int code = Confirm("kvctl namespaces rm", what, c.stores); code != kOk) return code;
  }
  nlohmann::json j;
  int shards_with_it = 0;
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    v1::RemoveNamespaceRequest req;
    req.set_namespace_id(*id);
    v1::RemoveNamespaceResponse resp;
    auto ctx = client.Context();
    grpc::Status s = client.stub().RemoveNamespace(ctx.get(), req, &resp);
    if (s.error_code() == grpc::NOT_FOUND) {
      if (!c.json)
        std::printf("%s: namespace %s is not registered here\n", addr.c_str(),
                    positional[0].c_str());
      j[addr] = {{"removed", false}};
      continue;
    }
    if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
    ++shards_with_it;
    if (!c.json) {
      std::printf(
          "%s: removed namespace %s; dropped %lu RAM and %lu NVMe blocks, %lu pinned "
          "(freed when their leases end)\n",
          addr.c_str(), positional[0].c_str(), resp.ram_blocks(), resp.disk_blocks(),
          resp.pinned_blocks());
    }
    j[addr] = {{"removed", true},
               {"ram_blocks", resp.ram_blocks()},
               {"disk_blocks", resp.disk_blocks()},
               {"pinned_blocks", resp.pinned_blocks()}};
  }
  if (c.json) PrintJson(j);
  if (shards_with_it == 0) {
    std::fprintf(stderr, "kvctl namespaces rm: no shard has namespace %s\n", positional[0].c_str());
    return kRefused;
  }
  return kOk;
}

}  // namespace

int RunNamespaces(const CommandLine& line) {
  if (line.words.size() >= 2 && line.words[1] == "rm") return RunRemove(line);
  SharedFlags c;
  FlagSet f("kvctl namespaces",
            "The namespaces each store shard knows: blocks and bytes in RAM and on NVMe, and\n"
            "the share of blocks asked for by gets that were served (HIT%).");
  c.Register(f, SharedFlags::Dials::kStores);
  ParseCommandFlags(f, line);
  // Keyed by shard address; a shard with none has an empty list.
  nlohmann::json j = nlohmann::json::object();
  size_t total = 0;
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    v1::ListNamespacesResponse resp;
    auto ctx = client.Context();
    auto s = client.stub().ListNamespaces(ctx.get(), {}, &resp);
    if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
    j[addr] = nlohmann::json::array();
    for (const auto& n : resp.namespaces()) {
      j[addr].push_back({{"id", NamespaceName(n.namespace_id())},
                         {"model", n.spec().model()},
                         {"dtype", n.spec().dtype()},
                         {"block_tokens", n.spec().block_tokens()},
                         {"block_bytes", n.block_bytes()},
                         {"ram_blocks", n.ram_blocks()},
                         {"nvme_blocks", n.nvme_blocks()},
                         {"ram_bytes", n.ram_blocks() * n.block_bytes()},
                         {"nvme_bytes", n.nvme_blocks() * n.block_bytes()},
                         {"blocks_asked", n.blocks_asked()},
                         {"blocks_served", n.blocks_served()},
                         {"hit_rate", n.blocks_asked() ? static_cast<double>(n.blocks_served()) /
                                                             static_cast<double>(n.blocks_asked())
                                                       : 0.0}});
    }
    total += resp.namespaces_size();
  }
  if (c.json) {
    PrintJson(j);
    return kOk;
  }
  if (total == 0) {
    std::printf("no namespaces on %zu shard%s (an engine registers its namespace when it starts)\n",
                j.size(), j.size() == 1 ? "" : "s");
    return kOk;
  }
  std::printf("%-22s %-16s %-24s %-6s %12s %12s %10s %10s %10s %10s %6s\n", "SHARD", "NAMESPACE",
              "MODEL", "DTYPE", "TOKENS/BLOCK", "BYTES/BLOCK", "RAM BLOCKS", "RAM", "NVME BLOCKS",
              "NVME", "HIT%");
  for (const auto& [addr, list] : j.items()) {
    for (const auto& n : list) {
      const uint64_t asked = n["blocks_asked"].get<uint64_t>();
      std::string hit = asked ? absl::StrFormat("%.1f", 100 * n["hit_rate"].get<double>()) : "-";
      std::printf(
          "%-22s %-16s %-24s %-6s %12u %12s %10lu %10s %10lu %10s %6s\n", addr.c_str(),
          n["id"].get<std::string>().c_str(), n["model"].get<std::string>().c_str(),
          n["dtype"].get<std::string>().c_str(), n["block_tokens"].get<uint32_t>(),
          FormatBytes(n["block_bytes"].get<uint64_t>()).c_str(), n["ram_blocks"].get<uint64_t>(),
          FormatBytes(n["ram_bytes"].get<uint64_t>()).c_str(), n["nvme_blocks"].get<uint64_t>(),
          FormatBytes(n["nvme_bytes"].get<uint64_t>()).c_str(), hit.c_str());
    }
  }
  return kOk;
}

}  // namespace kvtier::cli
