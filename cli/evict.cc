// kvctl evict: drop blocks (all, one namespace's, or listed keys) from every
// tier of every store shard, after the operator confirms.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/proto_convert.h"

namespace kvtier::cli {
namespace {

// Adds --key's NS:HASH list to req; false (after saying why) on a bad one.
bool AddKeys(const std::string& keys, v1::EvictRequest* req) {
  for (absl::string_view k : absl::StrSplit(keys, ',', absl::SkipEmpty())) {
    std::vector<std::string> p = absl::StrSplit(k, ':');
    auto id = p.size() == 2 ? ParseNamespace(p[0])
                            : absl::StatusOr<uint64_t>(absl::InvalidArgumentError("x"));
    auto h = p.size() == 2 ? BlockHashFromHex(p[1])
                           : absl::StatusOr<BlockHash>(absl::InvalidArgumentError("x"));
    if (!id.ok() || !h.ok()) {
      std::fprintf(stderr,
                   "kvctl evict: --key \"%s\" is not NS:HASH (hex namespace id, 32 hex digits)\n",
                   std::string(k).c_str());
      return false;
    }
    auto* key = req->mutable_keys()->add_keys();
    key->set_namespace_id(*id);
    ToProto(*h, key->mutable_hash());
  }
  return true;
}

}  // namespace

int RunEvict(const CommandLine& line) {
  SharedFlags c;
  bool all = false, yes = false;
  std::string ns, keys;
  FlagSet f("kvctl evict",
            "Drop blocks from every tier of every shard: --all, --namespace NS, or --key NS:HASH "
            "(repeatable as a comma list). Asks for confirmation unless --yes.");
  c.Register(f, SharedFlags::Dials::kStores);
  f.Bool("all", &all, "Every block of every namespace");
  f.String("namespace", &ns, "Every block of this namespace (hex id)");
  f.String("key", &keys, "Blocks NS:HASH (hex), comma-separated");
  f.Bool("yes", &yes, "Do not ask");
  ParseCommandFlags(f, line);
  int targets = all + !ns.empty() + !keys.empty();
  if (targets != 1) {
    std::fprintf(stderr, "kvctl evict: give exactly one of --all, --namespace, --key\n");
    return kUsage;
  }
  v1::EvictRequest req;
  std::string what;
  if (all) {
    req.set_all(true);
    what = "EVERY block";
  } else if (!ns.empty()) {
    auto id = ParseNamespace(ns);
    if (!id.ok()) {
      std::fprintf(stderr, "kvctl evict: %s\n", std::string(id.status().message()).c_str());
      return kUsage;
    }
    req.set_namespace_id(*id);
    what = "every block of namespace " + ns;
  } else {
    if (!AddKeys(keys, &req)) return kUsage;
    what = absl::StrCat(req.keys().keys_size(), " block(s)");
  }
  if (!yes) {
    if (int code = Confirm("kvctl evict", "drop " + what, c.stores); code != kOk) return code;
  }
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    auto r = client.Evict(req);
    if (!r.ok() && !ns.empty() && r.status().code() == absl::StatusCode::kNotFound) {
      // A namespace only some shards have seen: nothing to drop on this one.
      if (!c.json)
        std::printf("%s: namespace %s is not registered here; nothing to drop\n", addr.c_str(),
                    ns.c_str());
      j[addr] = {{"ram_blocks", 0}, {"disk_blocks", 0}, {"pinned_blocks", 0}};
      continue;
    }
    if (!r.ok()) return Report(r.status(), "store " + addr);
    if (!c.json) {
      std::printf(
          "%s: dropped %lu RAM and %lu NVMe blocks; %lu pinned (freed when their leases end)\n",
          addr.c_str(), r->ram_blocks(), r->disk_blocks(), r->pinned_blocks());
    }
    j[addr] = {{"ram_blocks", r->ram_blocks()},
               {"disk_blocks", r->disk_blocks()},
               {"pinned_blocks", r->pinned_blocks()}};
  }
  if (c.json) PrintJson(j);
  return kOk;
}

}  // namespace kvtier::cli
