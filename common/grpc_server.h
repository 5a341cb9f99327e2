// Server-side gRPC glue shared by kvtier's services.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

namespace kvtier {

// Interceptors every kvtier server installs. Today: a request that does not
// parse (malformed or truncated protobuf) reaches no handler, and gRPC
// answers INTERNAL with an empty message; this turns that into
// INVALID_ARGUMENT with a message naming the method.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
ServerInterceptors();

}  // namespace kvtier
