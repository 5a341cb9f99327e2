// kvctl namespaces: the namespaces each store shard has registered.
#include <cstdio>
#include <string>

#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/grpc_status.h"

namespace kvtier::cli {

int RunNamespaces(const CommandLine& line) {
  SharedFlags c;
  FlagSet f("kvctl namespaces", "The namespaces each store shard knows.");
  c.Register(f, SharedFlags::Dials::kStores);
  ParseCommandFlags(f, line);
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    v1::ListNamespacesResponse resp;
    auto ctx = client.Context();
    auto s = client.stub().ListNamespaces(ctx.get(), {}, &resp);
    if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
    for (const auto& n : resp.namespaces()) {
      std::string id = NamespaceName(n.namespace_id());
      j[addr].push_back({{"id", id}, {"model", n.spec().model()}, {"dtype", n.spec().dtype()},
                         {"block_tokens", n.spec().block_tokens()}, {"block_bytes", n.block_bytes()}});
      if (!c.json) {
        std::printf("%-22s %s %s %s %u tokens/block, %s/block\n", addr.c_str(), id.c_str(),
                    n.spec().model().c_str(), n.spec().dtype().c_str(), n.spec().block_tokens(),
                    FormatBytes(n.block_bytes()).c_str());
      }
    }
  }
  if (c.json) PrintJson(j);
  return kOk;
}

}  // namespace kvtier::cli
