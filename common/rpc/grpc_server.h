// Server-side gRPC glue shared by kvtier's services.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

// Interceptors every kvtier server installs. Today: a request that does not
// parse (malformed or truncated protobuf) reaches no handler, and gRPC
// answers INTERNAL with an empty message; this turns that into
// INVALID_ARGUMENT with a message naming the method.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
ServerInterceptors();

// Orders what a service's handlers did before its owner's teardown once the
// server has stopped: each handler releases (Release, or a Scope), and the
// owner acquires (Quiesce) after ServeUntilSignalled. gRPC's own join of its
// threads happens in uninstrumented code, out of ThreadSanitizer's sight.
class HandlerFence {
 public:
  struct Scope {
    HandlerFence* fence;
    ~Scope() { fence->Release(); }
  };
  Scope Enter() { return Scope{this}; }
  void Release() { done_.fetch_add(1, std::memory_order_release); }
  void Quiesce() const { (void)done_.load(std::memory_order_acquire); }

 private:
  std::atomic<uint64_t> done_{0};
};

// Blocks SIGINT and SIGTERM in this thread and every thread it starts later;
// call first in main(), before any thread exists. ServeUntilSignalled takes them.
void BlockShutdownSignals();

// Writes the bound port to path atomically (tests and scripts wait for it);
// nothing when path is empty.
void WritePortFile(const std::string& path, int port);

// What every kvtier server binary starts the same way.
struct GrpcServerOptions {
  std::string binary;  // "kvtier-store": names the server in messages
  std::string listen;  // host:port (port 0: any free one)
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::vector<grpc::Service*> services;
  uint64_t max_message_bytes = 0;  // receive and send limit; 0: gRPC's defaults
};

struct StartedServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string host;  // the host part of listen
  std::string address() const { return host + ":" + std::to_string(port); }
};

// Starts a gRPC server with the standard health service, kvtier's
// interceptors and the given services. UNAVAILABLE naming the address if it
// cannot listen there (in use, or not a local address).
absl::StatusOr<StartedServer> StartGrpcServer(const GrpcServerOptions& options);

// Prints "<binary> listening on HOST:PORT<suffix>" on stdout (scripts and
// tests wait for it) and writes the port file.
void AnnounceListening(const std::string& binary, const StartedServer& server,
                       const std::string& suffix, const std::string& port_file);

// " (TLS)", " (mutual TLS)" or "" for a server's TLS flags.
std::string TlsModeSuffix(bool tls, bool mutual);

// Returns once SIGINT or SIGTERM arrived and the server has shut down (2 s
// grace for calls in flight). `before_shutdown`, if set, runs first, on the
// signal's thread, while the server still serves (a worker's drain); a
// second signal meanwhile is not waited for. REQUIRES: BlockShutdownSignals()
// was called.
void ServeUntilSignalled(grpc::Server* server, const std::string& component,
                         const std::function<void(int signal)>& before_shutdown = nullptr);

}  // namespace kvtier
