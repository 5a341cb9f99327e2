#include "common/rpc/admin_gate.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc/tls.h"

namespace kvtier {

grpc::Status AdminGate::Check(const grpc::ServerContext& ctx, const char* rpc) const {
  if (!identity_.empty()) {
    std::vector<std::string> names = PeerCertificateNames(ctx);
    if (std::find(names.begin(), names.end(), identity_) == names.end()) {
      return grpc::Status(
          grpc::PERMISSION_DENIED,
          absl::StrCat(rpc, " is an admin RPC: it needs a client certificate for \"", identity_,
                       "\" (mutual TLS); this client presented ",
                       names.empty()
                           ? std::string("none")
                           : absl::StrCat("one for \"", absl::StrJoin(names, "\", \""), "\"")));
    }
  }
  if (token_.empty()) return grpc::Status::OK;
  auto it = ctx.client_metadata().find("x-kvtier-admin-token");
  bool ok = it != ctx.client_metadata().end() && it->second.size() == token_.size();
  // Compare every byte (no early exit on the first difference).
  unsigned diff = ok ? 0 : 1;
  if (ok) {
    for (size_t i = 0; i < token_.size(); ++i) diff |= it->second.data()[i] ^ token_[i];
  }
  if (diff != 0) {
    return grpc::Status(grpc::PERMISSION_DENIED,
                        absl::StrCat(rpc,
                                     " is an admin RPC: it needs the store's admin token in "
                                     "x-kvtier-admin-token metadata (kvctl --admin-token-file)"));
  }
  return grpc::Status::OK;
}

}  // namespace kvtier
