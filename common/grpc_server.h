// Server-side gRPC glue shared by kvtier's services.
#pragma once

#include <grpcpp/grpcpp.h>

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
