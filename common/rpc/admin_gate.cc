#include "common/rpc/admin_gate.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc/tls.h"

namespace kvtier {

grpc::Status AdminGate::Check(const grpc::ServerContext& ctx, const char* rpc) const {
  std::vector<std::string> names;
  if (!identity_.empty()) names = PeerCertificateNames(ctx);
  auto it = ctx.client_metadata().find("x-kvtier-admin-token");
  std::string_view token;
  if (it != ctx.client_metadata().end())
    token = std::string_view(it->second.data(), it->second.size());
  return Check(names, it != ctx.client_metadata().end() ? &token : nullptr, rpc);
}

grpc::Status AdminGate::Check(const std::vector<std::string>& names, const std::string_view* token,
                              const char* rpc) const {
  if (!identity_.empty()) {
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
  bool ok = token != nullptr && token->size() == token_.size();
  // Compare every byte (no early exit on the first difference).
  unsigned diff = ok ? 0 : 1;
  if (ok) {
    for (size_t i = 0; i < token_.size(); ++i) diff |= (*token)[i] ^ token_[i];
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
