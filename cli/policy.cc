// kvctl policy get|set: show or switch each tier's eviction policy on every
// store shard.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/grpc_status.h"

namespace kvtier::cli {
namespace {

// A tier's policy as --json prints it: its name and every parameter.
nlohmann::json PolicyJson(const v1::TierPolicy& p) {
  nlohmann::json params = nlohmann::json::object();
  for (const auto& [k, v] : p.params()) params[k] = v;
  return {{"policy", p.policy()}, {"params", params}};
}

// Sets --tier's policy to the one positional argument on every shard;
// returns an exit code.
int Set(const SharedFlags& c, const std::string& tier, const std::vector<std::string>& pos,
        const std::string& params, nlohmann::json* j) {
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    if (pos.size() != 1) {
      std::fprintf(stderr, "kvctl policy set: name one policy: lru, s3fifo or sieve\n");
      return kUsage;
    }
    v1::SetPolicyRequest req;
    req.mutable_policy()->set_tier(tier == "ram" ? v1::TIER_RAM : v1::TIER_DISK);
    req.mutable_policy()->set_policy(pos[0]);
    for (absl::string_view kv : absl::StrSplit(params, ',', absl::SkipEmpty())) {
      std::vector<std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      double v;
      if (p.size() != 2 || !absl::SimpleAtod(p[1], &v)) {
        std::fprintf(stderr, "kvctl policy set: --param \"%s\" is not name=number\n",
                     std::string(kv).c_str());
        return kUsage;
      }
      (*req.mutable_policy()->mutable_params())[p[0]] = v;
    }
    v1::SetPolicyResponse resp;
    auto ctx = client.Context();
    auto s = client.stub().SetPolicy(ctx.get(), req, &resp);
    if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
    if (!c.json)
      std::printf("%s: %s tier now uses %s\n", addr.c_str(), tier.c_str(),
                  resp.policy().policy().c_str());
    (*j)[addr][tier] = PolicyJson(resp.policy());
  }
  return kOk;
}

// Prints every shard's policies; returns an exit code.
int Get(const SharedFlags& c, nlohmann::json* j) {
  for (const auto& addr : c.StoreList()) {
    StoreClient client = c.StoreAt(addr);
    v1::GetPolicyResponse resp;
    auto ctx = client.Context();
    auto s = client.stub().GetPolicy(ctx.get(), {}, &resp);
    if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
    for (const auto& p : resp.policies()) {
      std::string t = TierName(p.tier());
      std::string ps;
      for (const auto& [k, v] : p.params()) absl::StrAppend(&ps, " ", k, "=", v);
      if (!c.json)
        std::printf("%-22s %-5s %s%s\n", addr.c_str(), t.c_str(), p.policy().c_str(), ps.c_str());
      (*j)[addr][t] = PolicyJson(p);
    }
  }
  return kOk;
}

}  // namespace

int RunPolicy(const CommandLine& line) {
  if (line.words.size() < 2 || (line.words[1] != "get" && line.words[1] != "set")) {
    std::fprintf(stderr, "kvctl policy: say get or set (kvctl policy set --tier ram sieve)\n");
    return kUsage;
  }
  bool set = line.words[1] == "set";
  SharedFlags c;
  std::string tier = "ram", params;
  FlagSet f(set ? "kvctl policy set" : "kvctl policy get",
            set ? "Switch a tier's eviction policy on every shard (no block is dropped).\n"
                  "Usage: kvctl policy set --tier ram|disk lru|s3fifo|sieve [--param "
                  "small_fraction=0.2 | max_scan=4096]"
                : "Show each tier's eviction policy on every shard.");
  c.Register(f, SharedFlags::Dials::kStores);
  if (set) {
    f.Choice("tier", &tier, {"ram", "disk"}, "Tier to change");
    f.String("param", &params, "Policy parameters, name=value[,name=value]");
  }
  std::vector<std::string> pos;
  ParseCommandFlags(f, line, &pos, /*name_at=*/1);
  nlohmann::json j;
  int code = set ? Set(c, tier, pos, params, &j) : Get(c, &j);
  if (code != kOk) return code;
  if (c.json) PrintJson(j);
  return kOk;
}

}  // namespace kvtier::cli
