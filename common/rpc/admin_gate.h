// Who may call a server's admin RPCs (evict, policy changes): a caller that
// presents the admin token in `x-kvtier-admin-token` metadata, and/or a
// verified client certificate (mutual TLS) naming the admin identity. With
// neither configured, everyone may. Thread-safe once configured.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <string_view>
#include <vector>

namespace kvtier {

class AdminGate {
 public:
  void set_token(std::string token) { token_ = std::move(token); }
  void set_identity(std::string name) { identity_ = std::move(name); }

  // OK, or PERMISSION_DENIED naming the RPC and what it needs (and, for an
  // identity mismatch, whom the client's certificate names). The token is
  // compared in constant time.
  grpc::Status Check(const grpc::ServerContext& ctx, const char* rpc) const;
  // The same decision from what the call carries: the names of the
  // client's verified certificate and its x-kvtier-admin-token metadata
  // (nullptr: none).
  grpc::Status Check(const std::vector<std::string>& peer_names, const std::string_view* token,
                     const char* rpc) const;

 private:
  std::string token_;
  std::string identity_;
};

}  // namespace kvtier
