// StoreService's life and its callers' identity (tenants by certificate or
// token, their namespaces, whom their leases count against). The RPCs are
// in service_data.cc (the data path), service_admin.cc (namespaces, stats,
// policy, eviction) and service_sessions.cc (the data plane's sessions).
#include "cachestore/service.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "cachestore/service_detail.h"
#include "common/rpc/tls.h"

namespace kvtier::store {

using service_detail::Clock;
using service_detail::kTenantTokenKey;
using service_detail::LeaseHolder;

StoreService::StoreService(Store* store, DataPlaneServer* dataplane, SocketDataPlane* sockets)
    : store_(store),
      instance_id_(((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) | 1),
      dataplane_(dataplane),
      sockets_(sockets),
      abandoned_(std::chrono::milliseconds(store->lease_ms()), kMaxAbandonTokens),
      started_(Clock::now()) {
  for (const char* rpc :
       {"RegisterNamespace", "ListNamespaces", "Lookup", "BeginPut", "CommitPut", "AbortPut",
        "BeginGet", "EndGet", "ReleaseGets", "VerifyBlocks", "PutBlocks", "GetBlocks", "Evict",
        "RemoveNamespace", "GetStats", "GetPolicy", "SetPolicy", "ConnectDataPlane"}) {
    histograms_[rpc] = std::make_unique<LatencyHistogram>();
  }
  // The same calls on the data plane, timed apart from their gRPC twins.
  for (const char* rpc :
       {"DataPlaneBeginGet", "DataPlaneReleaseGets", "DataPlaneBeginPut", "DataPlaneCommitPut"}) {
    histograms_[rpc] = std::make_unique<LatencyHistogram>();
  }
  if (dataplane_) {
    dataplane_->SetCallHandler(
        [this](uint16_t method, std::string_view session, std::string_view request) {
          return ServeCall(method, session, request);
        });
  }
  if (sockets_) {
    sockets_->SetHandlers(
        [this](uint16_t method, std::string_view session, std::string_view request) {
          auto r = ServeCall(method, session, request);
          return SocketDataPlane::CallReply{r.code, std::move(r.body)};
        },
        [this](std::string_view session, bool is_put, uint64_t lease, uint64_t addr,
               uint64_t length) { return GrantTransfer(session, is_put, lease, addr, length); },
        [this](std::string_view id, std::string_view nonce, std::string_view proof) {
          return AdmitConnection(id, nonce, proof);
        });
  }
}

void StoreService::DetachDataPlane() {
  if (dataplane_) dataplane_->SetCallHandler(nullptr);
  dataplane_ = nullptr;
  if (sockets_) sockets_->SetHandlers(nullptr, nullptr, nullptr);
  sockets_ = nullptr;
}

StoreService::~StoreService() { DetachDataPlane(); }

absl::Status StoreService::Identify(const grpc::ServerContext& ctx, Caller* caller) const {
  const Tenants* tenants = store_->tenants();
  if (tenants == nullptr) return absl::OkStatus();
  const Tenant* t = tenants->ByIdentity(PeerCertificateNames(ctx));
  if (t == nullptr) {
    const auto& md = ctx.client_metadata();
    if (auto it = md.find(kTenantTokenKey); it != md.end()) {
      t = tenants->ByToken(std::string_view(it->second.data(), it->second.size()));
    }
  }
  if (t == nullptr) {
    return absl::UnauthenticatedError(
        absl::StrCat("this store serves tenants (--tenants-file): present a client "
                     "certificate that a tenant's identities= names, or a "
                     "tenant's token in metadata ",
                     kTenantTokenKey, " (KVTIER_TENANT_TOKEN for kvtier clients)"));
  }
  caller->tenant = t;
  return absl::OkStatus();
}

absl::Status StoreService::Identify(const grpc::ServerContext& ctx, uint64_t ns, Caller* caller,
                                    uint64_t* store_ns) const {
  if (auto s = Identify(ctx, caller); !s.ok()) return s;
  return Resolve(*caller, ns, store_ns);
}

absl::Status StoreService::Resolve(const Caller& caller, uint64_t ns, uint64_t* store_ns) const {
  *store_ns = ns;
  if (caller.tenant == nullptr) return absl::OkStatus();
  auto info = store_->ResolveNamespace(*caller.tenant, ns);
  if (!info.ok()) return info.status();
  *store_ns = info->id;
  return absl::OkStatus();
}

LeaseOwner StoreService::OwnerOf(const grpc::ServerContext& ctx, const Caller& caller) const {
  if (caller.tenant == nullptr) return LeaseOwner(LeaseHolder(ctx));
  return LeaseOwner(TenantLeaseHolder(*caller.tenant), caller.tenant->max_leases,
                    caller.tenant->index);
}

}  // namespace kvtier::store
