// Server-side gRPC glue shared by kvtier's services.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// Returns once SIGINT or SIGTERM arrived and the server has shut down (2 s
// grace for calls in flight). REQUIRES: BlockShutdownSignals() was called.
void ServeUntilSignalled(grpc::Server* server, const std::string& component);

}  // namespace kvtier
