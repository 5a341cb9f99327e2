#include "cachestore/service.h"

#include <optional>
#include <random>

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"
#include "common/rpc/tls.h"
#include "common/ucx/calls.h"
#include "common/version.h"
#include "openssl/rand.h"

namespace kvtier::store {

namespace {

// Whom a lease counts against (--max-leases-per-client): the identity of a
// verified client certificate, else the connection. Never the request's
// client_id: a client filling in a new one per request would have no limit.
// (client_id stays in the protocol as a label for logs; it keys nothing.)
std::string LeaseHolder(const grpc::ServerContext& ctx) {
  std::vector<std::string> names = PeerCertificateNames(ctx);
  return names.empty() ? absl::StrCat("connection ", ctx.peer())
                       : absl::StrCat("identity ", names[0]);
}

using Clock = std::chrono::steady_clock;

// The metadata key a tenant's bearer token travels in.
constexpr char kTenantTokenKey[] = "x-kvtier-tenant-token";

// Why a tenant's put found no room: its region is full of pinned or
// half-written blocks (evictable ones would have made room).
absl::Status TenantRamFull(const Tenant& t) {
  return absl::ResourceExhaustedError(
      absl::StrCat("tenant ", t.name, "'s RAM region (", t.ram_bytes,
                   " bytes, ram= in the tenants file) has no slot to free: every block in it is "
                   "pinned or being written under open leases; end or commit some, or raise its "
                   "ram="));
}

// Times one RPC into its histogram, counting non-OK results as errors.
class RpcTimer {
 public:
  RpcTimer(HandlerFence& fence, LatencyHistogram& h) : fence_(fence), h_(h), start_(Clock::now()) {}
  grpc::Status Done(grpc::Status s) {
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start_);
    h_.Record(static_cast<uint64_t>(us.count()), s.ok());
    fence_.Release();
    return s;
  }

 private:
  HandlerFence& fence_;
  LatencyHistogram& h_;
  Clock::time_point start_;
};

std::vector<BlockHash> Hashes(const google::protobuf::RepeatedPtrField<v1::BlockHash>& in) {
  std::vector<BlockHash> out;
  out.reserve(in.size());
  for (const auto& h : in) out.push_back(FromProto(h));
  return out;
}

v1::Tier ToProto(TierKind t) { return t == TierKind::kRam ? v1::TIER_RAM : v1::TIER_DISK; }

absl::StatusOr<TierKind> TierFromProto(v1::Tier t) {
  if (t == v1::TIER_RAM) return TierKind::kRam;
  if (t == v1::TIER_DISK) return TierKind::kDisk;
  return absl::InvalidArgumentError("tier must be TIER_RAM or TIER_DISK");
}

void FillTier(v1::Tier tier, const TierSnapshot& s, v1::TierStats* out) {
  out->set_tier(tier);
  out->set_policy(s.policy);
  out->set_capacity_bytes(s.capacity_bytes);
  out->set_used_bytes(s.used_bytes);
  out->set_items(s.items);
  out->set_hits(s.hits);
  out->set_misses(s.misses);
  out->set_evictions(s.evictions);
  out->set_promotions(s.promotions);
  out->set_demotions(s.demotions);
  out->set_bytes_in(s.bytes_in);
  out->set_bytes_out(s.bytes_out);
  out->set_degraded(s.degraded);
  out->set_degraded_reason(s.degraded_reason);
}

void FillPolicy(Store* store, TierKind tier, v1::TierPolicy* out) {
  auto [name, params] = store->GetPolicy(tier);
  out->set_tier(ToProto(tier));
  out->set_policy(name);
  for (const auto& [k, v] : params) (*out->mutable_params())[k] = v;
}

}  // namespace

StoreService::StoreService(Store* store, DataPlaneServer* dataplane, SocketDataPlane* sockets)
    : store_(store),
      instance_id_(((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) | 1),
      dataplane_(dataplane),
      sockets_(sockets),
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
        [this](std::string_view session) { return SessionOf(session).status(); });
  }
}

void StoreService::DetachDataPlane() {
  if (dataplane_) dataplane_->SetCallHandler(nullptr);
  dataplane_ = nullptr;
  if (sockets_) sockets_->SetHandlers(nullptr, nullptr, nullptr);
  sockets_ = nullptr;
}

absl::StatusOr<SocketDataPlane::Grant> StoreService::GrantTransfer(std::string_view session_id,
                                                                   bool is_put, uint64_t lease,
                                                                   uint64_t addr, uint64_t length) {
  auto session = SessionOf(session_id);
  if (!session.ok()) return session.status();
  const int tenant = session->caller.tenant_index();
  // An address below the arena wraps to an offset past it: no slot holds it.
  const Arena& arena = store_->ram().arena();
  const uint64_t offset = addr - reinterpret_cast<uint64_t>(arena.base());
  auto hold = store_->UseLease(lease, is_put, tenant, offset, length);
  if (!hold.ok()) return hold.status();
  return SocketDataPlane::Grant{arena.at(offset), hold->deadline, std::move(hold->token)};
}

StoreService::~StoreService() { DetachDataPlane(); }

grpc::Status StoreService::Identify(const grpc::ServerContext& ctx, Caller* caller) const {
  const Tenants* tenants = store_->tenants();
  if (tenants == nullptr) return grpc::Status::OK;
  const Tenant* t = tenants->ByIdentity(PeerCertificateNames(ctx));
  if (t == nullptr) {
    const auto& md = ctx.client_metadata();
    if (auto it = md.find(kTenantTokenKey); it != md.end()) {
      t = tenants->ByToken(std::string_view(it->second.data(), it->second.size()));
    }
  }
  if (t == nullptr) {
    return grpc::Status(grpc::UNAUTHENTICATED,
                        absl::StrCat("this store serves tenants (--tenants-file): present a client "
                                     "certificate that a tenant's identities= names, or a "
                                     "tenant's token in metadata ",
                                     kTenantTokenKey, " (KVTIER_TENANT_TOKEN for kvtier clients)"));
  }
  caller->tenant = t;
  return grpc::Status::OK;
}

grpc::Status StoreService::Identify(const grpc::ServerContext& ctx, uint64_t ns, Caller* caller,
                                    uint64_t* store_ns) const {
  if (auto s = Identify(ctx, caller); !s.ok()) return s;
  return Resolve(*caller, ns, store_ns);
}

grpc::Status StoreService::Resolve(const Caller& caller, uint64_t ns, uint64_t* store_ns) const {
  *store_ns = ns;
  if (caller.tenant == nullptr) return grpc::Status::OK;
  auto info = store_->ResolveNamespace(*caller.tenant, ns);
  if (!info.ok()) return ToGrpc(info.status());
  *store_ns = info->id;
  return grpc::Status::OK;
}

LeaseOwner StoreService::OwnerOf(const grpc::ServerContext& ctx, const Caller& caller) const {
  if (caller.tenant == nullptr) return LeaseOwner(LeaseHolder(ctx));
  return LeaseOwner(TenantLeaseHolder(*caller.tenant), caller.tenant->max_leases,
                    caller.tenant->index);
}

std::string StoreService::OpenSession(const Caller& caller, const grpc::ServerContext& ctx) {
  std::string id(ucx::kSessionBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(id.data()), static_cast<int>(id.size())) != 1) {
    return {};  // no randomness: no session (the client keeps gRPC)
  }
  Session session{caller, OwnerOf(ctx, caller)};
  std::lock_guard lk(sessions_mu_);
  if (session_order_.size() >= kMaxSessions) {
    sessions_.erase(session_order_.front());
    session_order_.pop_front();
  }
  sessions_.emplace(id, std::move(session));
  session_order_.push_back(id);
  return id;
}

absl::StatusOr<StoreService::Session> StoreService::SessionOf(std::string_view id) const {
  std::lock_guard lk(sessions_mu_);
  auto it = sessions_.find(std::string(id));
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError(
        "unknown data-plane session (the store restarted or dropped it); call "
        "ConnectDataPlane again");
  }
  return it->second;
}

DataPlaneServer::CallReply StoreService::ServeCall(uint16_t method, std::string_view session_id,
                                                   std::string_view request) {
  auto session = SessionOf(session_id);
  if (!session.ok()) {
    return {grpc::UNAUTHENTICATED, std::string(session.status().message())};
  }
  // Parses the request, runs `body` for it and encodes the answer, timed
  // under `rpc`.
  auto serve = [&](const char* rpc, auto req, auto resp, auto body) {
    RpcTimer t(fence_, Histogram(rpc));
    grpc::Status s = req.ParseFromArray(request.data(), static_cast<int>(request.size()))
                         ? body(req, &resp)
                         : grpc::Status(grpc::INVALID_ARGUMENT,
                                        absl::StrCat(rpc, ": not a ", req.GetDescriptor()->name()));
    t.Done(s);
    DataPlaneServer::CallReply r{static_cast<int>(s.error_code()), {}};
    if (s.ok()) {
      resp.SerializeToString(&r.body);
    } else {
      r.body = s.error_message();
    }
    return r;
  };
  switch (method) {
    case ucx::kCallBeginGet:
      return serve("DataPlaneBeginGet", v1::BeginGetRequest(), v1::BeginGetResponse(),
                   [&](const v1::BeginGetRequest& req, v1::BeginGetResponse* resp) {
                     return DoBeginGet(session->caller, session->owner, req, resp);
                   });
    case ucx::kCallReleaseGets:
      return serve("DataPlaneReleaseGets", v1::ReleaseGetsRequest(), v1::ReleaseGetsResponse(),
                   [&](const v1::ReleaseGetsRequest& req, v1::ReleaseGetsResponse* resp) {
                     return DoReleaseGets(session->caller, req, resp);
                   });
    case ucx::kCallBeginPut:
      return serve("DataPlaneBeginPut", v1::BeginPutRequest(), v1::BeginPutResponse(),
                   [&](const v1::BeginPutRequest& req, v1::BeginPutResponse* resp) {
                     return DoBeginPut(session->caller, session->owner, req, resp);
                   });
    case ucx::kCallCommitPut:
      return serve("DataPlaneCommitPut", v1::CommitPutRequest(), v1::CommitPutResponse(),
                   [&](const v1::CommitPutRequest& req, v1::CommitPutResponse* resp) {
                     return DoCommitPut(session->caller, req, resp);
                   });
    default:
      return {grpc::UNIMPLEMENTED,
              absl::StrCat("data-plane call method ", method,
                           " is not one this store knows (1: BeginGet, 2: ReleaseGets, "
                           "3: BeginPut, 4: CommitPut)")};
  }
}

grpc::Status StoreService::RegisterNamespace(grpc::ServerContext* ctx,
                                             const v1::RegisterNamespaceRequest* req,
                                             v1::RegisterNamespaceResponse* resp) {
  RpcTimer t(fence_, Histogram("RegisterNamespace"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  if (!req->has_spec()) return t.Done(grpc::Status(grpc::INVALID_ARGUMENT, "spec is missing"));
  auto info = store_->RegisterNamespace(FromProto(req->spec()), req->expected_id(), caller.tenant);
  if (!info.ok()) return t.Done(ToGrpc(info.status()));
  resp->set_namespace_id(info->client_id);
  resp->set_block_bytes(info->block_bytes);
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::ListNamespaces(grpc::ServerContext* ctx,
                                          const v1::ListNamespacesRequest*,
                                          v1::ListNamespacesResponse* resp) {
  RpcTimer t(fence_, Histogram("ListNamespaces"));
  // A tenant sees its own, as it named them; an operator (or anyone, without
  // tenants) every one, under the ids the store keys and evicts by.
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) {
    if (!admin_.Check(*ctx, "ListNamespaces").ok()) return t.Done(s);
  }
  for (const auto& info : store_->ListNamespaces(caller.tenant)) {
    auto* n = resp->add_namespaces();
    n->set_namespace_id(caller.tenant ? info.client_id : info.id);
    n->set_block_bytes(info.block_bytes);
    ToProto(caller.tenant ? info.client_spec : info.spec, n->mutable_spec());
    const NamespaceUsage u = store_->Usage(info.id);
    n->set_ram_blocks(u.ram_blocks);
    n->set_nvme_blocks(u.nvme_blocks);
    n->set_blocks_asked(u.blocks_asked);
    n->set_blocks_served(u.blocks_served);
  }
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::Lookup(grpc::ServerContext* ctx, const v1::LookupRequest* req,
                                  v1::LookupResponse* resp) {
  RpcTimer t(fence_, Histogram("Lookup"));
  Caller caller;
  uint64_t ns;
  if (auto s = Identify(*ctx, req->namespace_id(), &caller, &ns); !s.ok()) return t.Done(s);
  auto tiers = store_->Lookup(ns, Hashes(req->hashes()));
  if (!tiers.ok()) return t.Done(ToGrpc(tiers.status()));
  resp->set_present_blocks(static_cast<uint32_t>(tiers->size()));
  for (TierKind tier : *tiers) resp->add_tiers(ToProto(tier));
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::BeginPut(grpc::ServerContext* ctx, const v1::BeginPutRequest* req,
                                    v1::BeginPutResponse* resp) {
  RpcTimer t(fence_, Histogram("BeginPut"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoBeginPut(caller, OwnerOf(*ctx, caller), *req, resp));
}

grpc::Status StoreService::DoBeginPut(const Caller& caller, const LeaseOwner& owner,
                                      const v1::BeginPutRequest& req, v1::BeginPutResponse* resp) {
  uint64_t ns;
  if (auto s = Resolve(caller, req.namespace_id(), &ns); !s.ok()) return s;
  auto r = store_->BeginPut(ns, Hashes(req.hashes()), owner);
  if (!r.ok()) return ToGrpc(r.status());
  if (caller.tenant && r->lease == 0 &&
      std::any_of(r->targets.begin(), r->targets.end(),
                  [](const PutTarget& p) { return p.placement == Placement::kNoSpace; })) {
    return ToGrpc(TenantRamFull(*caller.tenant));
  }
  resp->set_lease_id(r->lease);
  resp->set_lease_ms(store_->lease_ms());
  resp->set_instance_id(instance_id_);
  const uint64_t base = reinterpret_cast<uint64_t>(store_->ram().arena().base());
  for (const auto& target : r->targets) {
    auto* out = resp->add_targets();
    switch (target.placement) {
      case Placement::kReserved:
        rma_put_bytes_ += target.slot.length;
        out->set_disposition(v1::PUT_RESERVED);
        out->set_remote_addr(base + target.slot.offset);
        out->set_length(target.slot.length);
        out->set_rkey_id(0);
        break;
      case Placement::kPresent:
        out->set_disposition(v1::PUT_ALREADY_PRESENT);
        break;
      case Placement::kBusy:
        out->set_disposition(v1::PUT_BUSY);
        break;
      case Placement::kNoSpace:
        out->set_disposition(v1::PUT_NO_SPACE);
        break;
    }
  }
  return grpc::Status::OK;
}

grpc::Status StoreService::CommitPut(grpc::ServerContext* ctx, const v1::CommitPutRequest* req,
                                     v1::CommitPutResponse* resp) {
  RpcTimer t(fence_, Histogram("CommitPut"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoCommitPut(caller, *req, resp));
}

grpc::Status StoreService::DoCommitPut(const Caller& caller, const v1::CommitPutRequest& req,
                                       v1::CommitPutResponse* resp) {
  std::vector<uint64_t> sums(req.checksums().begin(), req.checksums().end());
  auto n = store_->CommitPut(req.lease_id(), sums, caller.tenant_index());
  if (!n.ok()) return ToGrpc(n.status());
  resp->set_committed(*n);
  return grpc::Status::OK;
}

grpc::Status StoreService::AbortPut(grpc::ServerContext* ctx, const v1::AbortPutRequest* req,
                                    v1::AbortPutResponse*) {
  RpcTimer t(fence_, Histogram("AbortPut"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(ToGrpc(store_->AbortPut(req->lease_id(), caller.tenant_index())));
}

grpc::Status StoreService::BeginGet(grpc::ServerContext* ctx, const v1::BeginGetRequest* req,
                                    v1::BeginGetResponse* resp) {
  RpcTimer t(fence_, Histogram("BeginGet"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoBeginGet(caller, OwnerOf(*ctx, caller), *req, resp));
}

grpc::Status StoreService::DoBeginGet(const Caller& caller, const LeaseOwner& owner,
                                      const v1::BeginGetRequest& req, v1::BeginGetResponse* resp) {
  // Releases that travel with this request go first: their pins may be what
  // makes room for this one's promotions.
  if (req.end_leases_size() > 0) {
    auto gone = store_->ReleaseGets(
        std::span<const uint64_t>(req.end_leases().data(), req.end_leases_size()),
        caller.tenant_index());
    if (!gone.ok()) return ToGrpc(gone.status());
    for (uint64_t id : *gone) resp->add_leases_not_found(id);
  }
  uint64_t ns;
  if (auto s = Resolve(caller, req.namespace_id(), &ns); !s.ok()) return s;
  auto r = store_->BeginGet(ns, Hashes(req.hashes()), owner);
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_lease_id(r->lease);
  resp->set_lease_ms(store_->lease_ms());
  resp->set_instance_id(instance_id_);
  const uint64_t base = reinterpret_cast<uint64_t>(store_->ram().arena().base());
  for (const auto& src : r->sources) {
    rma_get_bytes_ += src.slot.length;
    auto* out = resp->add_sources();
    out->set_tier(ToProto(src.tier));
    out->set_remote_addr(base + src.slot.offset);
    out->set_length(src.slot.length);
    out->set_rkey_id(0);
    out->set_checksum(src.slot.checksum);
  }
  return grpc::Status::OK;
}

grpc::Status StoreService::EndGet(grpc::ServerContext* ctx, const v1::EndGetRequest* req,
                                  v1::EndGetResponse*) {
  RpcTimer t(fence_, Histogram("EndGet"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(ToGrpc(store_->EndGet(req->lease_id(), caller.tenant_index())));
}

grpc::Status StoreService::ReleaseGets(grpc::ServerContext* ctx, const v1::ReleaseGetsRequest* req,
                                       v1::ReleaseGetsResponse* resp) {
  RpcTimer t(fence_, Histogram("ReleaseGets"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoReleaseGets(caller, *req, resp));
}

grpc::Status StoreService::DoReleaseGets(const Caller& caller, const v1::ReleaseGetsRequest& req,
                                         v1::ReleaseGetsResponse* resp) {
  if (req.lease_ids_size() == 0) {
    return grpc::Status(grpc::INVALID_ARGUMENT, "ReleaseGets names no lease");
  }
  auto gone =
      store_->ReleaseGets(std::span<const uint64_t>(req.lease_ids().data(), req.lease_ids_size()),
                          caller.tenant_index());
  if (!gone.ok()) return ToGrpc(gone.status());
  for (uint64_t id : *gone) resp->add_not_found(id);
  resp->set_released(static_cast<uint32_t>(req.lease_ids_size() - gone->size()));
  return grpc::Status::OK;
}

grpc::Status StoreService::VerifyBlocks(grpc::ServerContext* ctx,
                                        const v1::VerifyBlocksRequest* req,
                                        v1::VerifyBlocksResponse* resp) {
  RpcTimer t(fence_, Histogram("VerifyBlocks"));
  Caller caller;
  uint64_t ns;
  if (auto s = Identify(*ctx, req->namespace_id(), &caller, &ns); !s.ok()) return t.Done(s);
  auto r = store_->VerifyBlocks(ns, Hashes(req->hashes()));
  if (!r.ok()) return t.Done(ToGrpc(r.status()));
  resp->set_checked(r->checked);
  resp->set_dropped(r->dropped);
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::PutBlocks(grpc::ServerContext* ctx,
                                     grpc::ServerReader<v1::PutBlocksRequest>* reader,
                                     v1::PutBlocksResponse* resp) {
  RpcTimer t(fence_, Histogram("PutBlocks"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  v1::PutBlocksRequest req;
  uint32_t index = 0;
  while (reader->Read(&req)) {
    if (!req.has_hash()) {
      return t.Done(grpc::Status(grpc::INVALID_ARGUMENT,
                                 absl::StrCat("message ", index, " of the stream has no hash")));
    }
    absl::StatusOr<InlinePutResult> r = absl::UnknownError("unset");
    uint64_t ns;
    if (grpc::Status s = Resolve(caller, req.namespace_id(), &ns); s.ok()) {
      r = store_->PutInline(ns, FromProto(req.hash()), req.data(), req.checksum());
    } else {
      r = FromGrpc(s);
    }
    if (r.ok() && caller.tenant && r->outcome == InlinePutResult::kNoSpace) {
      r = TenantRamFull(*caller.tenant);
    }
    if (!r.ok()) {
      // Blocks before this one stay stored; say which message failed.
      absl::Status s = r.status();
      return t.Done(ToGrpc(
          absl::Status(s.code(), absl::StrCat("message ", index, " of the stream: ", s.message(),
                                              " (", resp->stored(), " earlier blocks stored)"))));
    }
    switch (r->outcome) {
      case InlinePutResult::kStored:
        resp->set_stored(resp->stored() + 1);
        break;
      case InlinePutResult::kAlreadyPresent:
        resp->set_already_present(resp->already_present() + 1);
        break;
      case InlinePutResult::kNoSpace:
        resp->set_no_space(resp->no_space() + 1);
        break;
    }
    ++index;
  }
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::GetBlocks(grpc::ServerContext* ctx, const v1::GetBlocksRequest* req,
                                     grpc::ServerWriter<v1::GetBlocksResponse>* writer) {
  RpcTimer t(fence_, Histogram("GetBlocks"));
  Caller caller;
  uint64_t ns;
  if (auto s = Identify(*ctx, req->namespace_id(), &caller, &ns); !s.ok()) return t.Done(s);
  v1::GetBlocksResponse msg;
  auto s = store_->GetInline(
      ns, Hashes(req->hashes()),
      [&](uint32_t index, TierKind tier, std::string_view bytes, uint64_t checksum) {
        if (ctx->IsCancelled()) return false;
        msg.set_index(index);
        msg.set_tier(ToProto(tier));
        msg.set_data(bytes.data(), bytes.size());
        msg.set_checksum(checksum);
        return writer->Write(msg);
      });
  return t.Done(ToGrpc(s));
}

grpc::Status StoreService::RemoveNamespace(grpc::ServerContext* ctx,
                                           const v1::RemoveNamespaceRequest* req,
                                           v1::RemoveNamespaceResponse* resp) {
  RpcTimer t(fence_, Histogram("RemoveNamespace"));
  if (auto s = admin_.Check(*ctx, "RemoveNamespace"); !s.ok()) return t.Done(s);
  auto r = store_->RemoveNamespace(req->namespace_id());
  if (!r.ok()) return t.Done(ToGrpc(r.status()));
  resp->set_ram_blocks(r->ram_blocks);
  resp->set_disk_blocks(r->disk_blocks);
  resp->set_pinned_blocks(r->pinned_blocks);
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                                 v1::EvictResponse* resp) {
  RpcTimer t(fence_, Histogram("Evict"));
  if (auto s = admin_.Check(*ctx, "Evict"); !s.ok()) return t.Done(s);
  absl::StatusOr<EvictResult> r;
  switch (req->target_case()) {
    case v1::EvictRequest::kAll:
      if (!req->all()) {
        return t.Done(grpc::Status(grpc::INVALID_ARGUMENT, "evict all=false names nothing"));
      }
      r = store_->EvictAll();
      break;
    case v1::EvictRequest::kNamespaceId:
      r = store_->EvictNamespace(req->namespace_id());
      break;
    case v1::EvictRequest::kKeys: {
      std::vector<BlockKey> keys;
      for (const auto& k : req->keys().keys()) {
        keys.push_back(BlockKey{k.namespace_id(), FromProto(k.hash())});
      }
      r = store_->EvictKeys(keys);
      break;
    }
    default:
      return t.Done(
          grpc::Status(grpc::INVALID_ARGUMENT, "evict needs a target: all, namespace_id or keys"));
  }
  if (!r.ok()) return t.Done(ToGrpc(r.status()));
  resp->set_ram_blocks(r->ram_blocks);
  resp->set_disk_blocks(r->disk_blocks);
  resp->set_pinned_blocks(r->pinned_blocks);
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                    v1::GetStatsResponse* resp) {
  RpcTimer t(fence_, Histogram("GetStats"));
  StoreStats s = store_->Stats();
  FillTier(v1::TIER_RAM, s.ram, resp->add_tiers());
  FillTier(v1::TIER_DISK, s.disk, resp->add_tiers());
  resp->set_demotion_queue_blocks(s.queue.blocks);
  resp->set_demotion_queue_bytes(s.queue.bytes);
  resp->set_demotion_queue_dropped(s.queue.dropped);
  resp->set_put_leases(s.put_leases);
  resp->set_get_leases(s.get_leases);
  resp->set_leases_expired(s.leases_expired);
  resp->set_checksum_failures(s.checksum_failures);
  resp->set_version(Version());
  for (const auto& [name, h] : histograms_) {
    auto snap = h->Take();
    auto* out = resp->add_rpc_latency();
    out->set_rpc(name);
    out->set_count(snap.count);
    out->set_errors(snap.errors);
    out->set_sum_us(snap.sum_us);
    for (size_t i = 0; i < snap.counts.size(); ++i) {
      out->add_bucket_upper_us(snap.upper_us[i]);
      out->add_bucket_counts(snap.counts[i]);
    }
  }
  resp->set_uptime_s(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started_).count()));
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::GetPolicy(grpc::ServerContext*, const v1::GetPolicyRequest*,
                                     v1::GetPolicyResponse* resp) {
  RpcTimer t(fence_, Histogram("GetPolicy"));
  FillPolicy(store_, TierKind::kRam, resp->add_policies());
  FillPolicy(store_, TierKind::kDisk, resp->add_policies());
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::SetPolicy(grpc::ServerContext* ctx, const v1::SetPolicyRequest* req,
                                     v1::SetPolicyResponse* resp) {
  RpcTimer t(fence_, Histogram("SetPolicy"));
  if (auto s = admin_.Check(*ctx, "SetPolicy"); !s.ok()) return t.Done(s);
  auto tier = TierFromProto(req->policy().tier());
  if (!tier.ok()) return t.Done(ToGrpc(tier.status()));
  std::map<std::string, double> params(req->policy().params().begin(),
                                       req->policy().params().end());
  if (auto s = store_->SetPolicy(*tier, req->policy().policy(), params); !s.ok()) {
    return t.Done(ToGrpc(s));
  }
  FillPolicy(store_, *tier, resp->mutable_policy());
  return t.Done(grpc::Status::OK);
}

grpc::Status StoreService::ConnectDataPlane(grpc::ServerContext* ctx,
                                            const v1::ConnectDataPlaneRequest* req,
                                            v1::ConnectDataPlaneResponse* resp) {
  RpcTimer t(fence_, Histogram("ConnectDataPlane"));
  if (sockets_) {
    Caller caller;
    if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
    resp->set_data_address(sockets_->address());
    resp->set_instance_id(instance_id_);
    // Addresses are names of slots here, checked on every transfer; the
    // region is the arena (and its memfd for a same-host client without
    // tenants, the one trusted tenant of --local-shm).
    const Arena& arena = store_->ram().arena();
    uint64_t offset = 0, length = arena.size();
    if (caller.tenant) {  // its own region: where every slot it is handed lies
      const auto regions = store_->ram().pool_regions();
      const size_t i = static_cast<size_t>(caller.tenant->index);
      if (i < regions.size()) offset = regions[i].offset, length = regions[i].length;
    }
    auto* r = resp->add_regions();
    r->set_rkey_id(0);
    r->set_base_addr(reinterpret_cast<uint64_t>(arena.base()) + offset);
    r->set_length(length);
    if (offer_shm_ && caller.tenant == nullptr) r->set_shm_path(arena.shm_path());
    resp->set_session(OpenSession(caller, *ctx));
    return t.Done(grpc::Status::OK);
  }
  if (!dataplane_) {
    return t.Done(grpc::Status(grpc::FAILED_PRECONDITION,
                               "this store has no data plane (start kvtier-store with "
                               "--data-listen HOST:PORT); use PutBlocks/GetBlocks instead"));
  }
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  resp->set_ucx_address(dataplane_->address());
  resp->set_worker_address(dataplane_->worker_address());
  resp->set_instance_id(instance_id_);
  // A tenant gets its own region's key only (as rkey_id 0: the one region
  // its connection knows), and never the arena's memfd, which would map
  // every tenant's region.
  const size_t region = caller.tenant ? static_cast<size_t>(caller.tenant->index) : 0;
  if (region >= dataplane_->regions()) {
    return t.Done(grpc::Status(grpc::FAILED_PRECONDITION,
                               "this store's data plane registered no region for the caller's "
                               "tenant; use PutBlocks/GetBlocks"));
  }
  auto* r = resp->add_regions();
  r->set_rkey_id(0);
  r->set_base_addr(dataplane_->base(region));
  r->set_length(dataplane_->length(region));
  r->set_packed_rkey(dataplane_->packed_rkey(region));
  if (offer_shm_ && caller.tenant == nullptr) r->set_shm_path(store_->ram().arena().shm_path());
  resp->set_session(OpenSession(caller, *ctx));
  return t.Done(grpc::Status::OK);
}

}  // namespace kvtier::store
