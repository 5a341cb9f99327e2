// kvctl version: kvctl's own version and the version every store shard and
// the router report (GetStats / GetRouterStats). A server that cannot be
// reached is listed as such; the exit code is then 3.
#include <cstdio>
#include <string>

#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/grpc_status.h"
#include "common/version.h"

namespace kvtier::cli {

int RunVersion(const CommandLine& line) {
  SharedFlags c;
  FlagSet f("kvctl version",
            "kvctl's version, and each store shard's and the router's (exit 3 if one of them\n"
            "cannot be reached; the others are still listed).");
  c.Register(f, SharedFlags::Dials::kStoresAndRouter);
  ParseCommandFlags(f, line);
  nlohmann::json servers = nlohmann::json::object();
  int rc = kOk;
  auto note = [&](const std::string& what, const absl::StatusOr<std::string>& v) {
    if (v.ok()) {
      servers[what] = *v;
    } else {
      servers[what] = nullptr;
      rc = Report(v.status(), what);
    }
  };
  for (const auto& addr : c.StoreList()) {
    auto s = c.StoreAt(addr).GetStats();
    note("store " + addr, s.ok() ? absl::StatusOr<std::string>(s->version())
                                 : absl::StatusOr<std::string>(s.status()));
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(c.Deadline());
    v1::GetRouterStatsResponse r;
    auto st = c.RouterStub()->GetRouterStats(&ctx, v1::GetRouterStatsRequest(), &r);
    note("router " + c.router, st.ok() ? absl::StatusOr<std::string>(r.version())
                                       : absl::StatusOr<std::string>(FromGrpc(st)));
  }
  if (c.json) {
    PrintJson({{"kvctl", Version()}, {"servers", servers}});
  } else {
    std::printf("kvctl %s\n", Version());
    for (const auto& [what, v] : servers.items()) {
      std::printf("%-30s %s\n", what.c_str(),
                  v.is_null() ? "unreachable" : v.get<std::string>().c_str());
    }
  }
  return rc;
}

}  // namespace kvtier::cli
