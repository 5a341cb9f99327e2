#include "common/rpc/grpc_server.h"

#include <grpcpp/support/server_interceptor.h>

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier {
namespace {

// Whether another process holds HOST:PORT already (a bind to it fails with
// EADDRINUSE), asked before gRPC is, so the operator reads one line that
// says so instead of gRPC's own multi-line log. Port 0 and addresses that do
// not resolve are left to gRPC.
bool AddressInUse(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = listen.substr(0, colon), port = listen.substr(colon + 1);
  if (port.empty() || port == "0") return false;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), port.c_str(), &hints,
                  &res) != 0) {
    return false;
  }
  bool in_use = false;
  for (addrinfo* a = res; a != nullptr && !in_use; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC does
    in_use = bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE;
    close(fd);
  }
  freeaddrinfo(res);
  return in_use;
}

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
        m->ModifySendStatus(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "request to " + method_ +
                             " is not a valid protobuf message of the expected type "
                             "(malformed or truncated)"));
      }
    }
    m->Proceed();
  }

 private:
  std::string method_;
};

class MalformedRequestFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
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

void ServeUntilSignalled(grpc::Server* server, const std::string& component,
                         const std::function<void(int signal)>& before_shutdown) {
  std::thread signals([&] {
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    int sig = 0;
    sigwait(&sigs, &sig);
    if (before_shutdown) before_shutdown(sig);
    Log(component, "signal ", sig, ": shutting down");
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  });
  server->Wait();
  signals.join();
}

absl::StatusOr<StartedServer> StartGrpcServer(const GrpcServerOptions& o) {
  if (AddressInUse(o.listen)) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", o.listen,
                     ": the address is in use (another process serves on it; "
                     "stop it or choose another port)"));
  }
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
