// kvctl health ADDR: the grpc.health.v1 status of any kvtier server (store,
// router or worker); the Helm probes run it, over TLS when enabled.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "common/rpc/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvtier::cli {

int RunHealth(const CommandLine& line) {
  SharedFlags c;
  std::string service;
  FlagSet f("kvctl health",
            "grpc.health.v1 status of one kvtier server (store, router or worker) at ADDR:\n"
            "exit 0 SERVING, 1 not serving, 3 unreachable. For probes: works over TLS.\n"
            "Usage: kvctl health ADDR [--service kvtier.v1.Store/disk]");
  c.Register(f, SharedFlags::Dials::kAnyServer);
  f.String("service", &service, "Service to ask about (empty: the whole server)");
  std::vector<std::string> pos;
  ParseCommandFlags(f, line, &pos);
  if (pos.size() != 1) {
    std::fprintf(stderr, "kvctl health: give exactly one ADDR (HOST:PORT)\n");
    return kUsage;
  }
  auto stub = grpc::health::v1::Health::NewStub(OpenChannel(pos[0], c.Security()));
  grpc::ClientContext ctx;
  ctx.set_deadline(c.Deadline());
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (auto s = stub->Check(&ctx, req, &resp); !s.ok()) return Report(FromGrpc(s), pos[0]);
  bool serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  if (c.json) {
    PrintJson(nlohmann::json{{"address", pos[0]}, {"service", service}, {"status", name}});
  } else {
    std::printf("%s%s%s: %s\n", pos[0].c_str(), service.empty() ? "" : " ", service.c_str(),
                name.c_str());
  }
  return serving ? kOk : kRefused;
}

}  // namespace kvtier::cli
