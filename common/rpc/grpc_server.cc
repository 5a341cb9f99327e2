#include "common/rpc/grpc_server.h"

#include <grpcpp/support/server_interceptor.h>

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier {
namespace {

class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit MalformedRequestInterceptor(grpc::experimental::ServerRpcInfo* info)
      : method_(info->method() ? info->method() : "?") {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using grpc::experimental::InterceptionHookPoints;
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status s = m->GetSendStatus();
      // Handlers never answer INTERNAL without a message; gRPC does so when
      // the request bytes do not deserialize.
      if (s.error_code() == grpc::StatusCode::INTERNAL && s.error_message().empty()) {
        m->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "request to " + method_ + " is not a valid protobuf message of the expected type "
            "(malformed or truncated)"));
      }
    }
    m->Proceed();
  }

 private:
  std::string method_;
};

class MalformedRequestFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MalformedRequestInterceptor(info);
  }
};

}  // namespace

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
ServerInterceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<MalformedRequestFactory>());
  return v;
}

void BlockShutdownSignals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
}

void WritePortFile(const std::string& path, int port) {
  if (path.empty()) return;
  std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::rename(tmp.c_str(), path.c_str());
}

void ServeUntilSignalled(grpc::Server* server, const std::string& component) {
  std::thread signals([&] {
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    int sig = 0;
    sigwait(&sigs, &sig);
    Log(component, "signal ", sig, ": shutting down");
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  });
  server->Wait();
  signals.join();
}

absl::StatusOr<StartedServer> StartGrpcServer(const GrpcServerOptions& o) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  StartedServer started;
  builder.AddListeningPort(o.listen, o.credentials, &started.port);
  if (o.max_message_bytes != 0) {
    const int limit = static_cast<int>(std::min<uint64_t>(o.max_message_bytes, INT32_MAX));
    builder.SetMaxReceiveMessageSize(limit);
    builder.SetMaxSendMessageSize(limit);
  }
  // The sync server hands each call to a polling thread and starts another
  // when none is left, ending threads beyond MAX_POLLERS once idle. On a
  // busy machine that churn (a thread start costs up to milliseconds) sat
  // inside every control round trip: keep enough pollers that bursts of
  // calls find one waiting.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 4);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 64);
  // No SO_REUSEPORT (gRPC's default on Linux): with it a second server on a
  // port in use binds it too and the kernel splits connections between the
  // two, and binding port 0 can hand out a port another process already
  // serves on (seen: parallel test stores answering for each other). A
  // server owns its port or fails to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  for (grpc::Service* s : o.services) builder.RegisterService(s);
  builder.experimental().SetInterceptorCreators(ServerInterceptors());
  started.server = builder.BuildAndStart();
  if (!started.server || started.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", o.listen, " (in use or not a local address)"));
  }
  started.host = o.listen.substr(0, o.listen.rfind(':'));
  return started;
}

void AnnounceListening(const std::string& binary, const StartedServer& server,
                       const std::string& suffix, const std::string& port_file) {
  std::printf("%s listening on %s%s\n", binary.c_str(), server.address().c_str(), suffix.c_str());
  std::fflush(stdout);
  WritePortFile(port_file, server.port);
}

std::string TlsModeSuffix(bool tls, bool mutual) {
  if (!tls) return "";
  return mutual ? " (mutual TLS)" : " (TLS)";
}

}  // namespace kvtier
