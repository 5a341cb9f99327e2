// The data plane's sessions: ConnectDataPlane hands one out, control calls
// on the data plane act as its caller, and socket transfers are granted
// against the caller's leases.
#include <limits>

#include "absl/strings/str_cat.h"
#include "cachestore/service.h"
#include "cachestore/service_detail.h"
#include "common/data_hello.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/ucx/calls.h"
#include "openssl/rand.h"

namespace kvtier::store {

using service_detail::ClientOf;
using service_detail::RpcTimer;

absl::StatusOr<SocketDataPlane::Grant> StoreService::GrantTransfer(std::string_view session_id,
                                                                   bool is_put, uint64_t lease,
                                                                   uint64_t addr, uint64_t length) {
  auto session = SessionOf(session_id);
  if (!session.ok()) return session.status();
  const int tenant = session->caller.tenant_index();
  // An address below the arena wraps to an offset past it: no slot holds it.
  const Arena& arena = store_->ram().arena();
  const uint64_t offset = addr - reinterpret_cast<uint64_t>(arena.base());
  auto hold = store_->UseLease(lease, is_put, tenant, offset, length, session_id);
  if (!hold.ok()) return hold.status();
  return SocketDataPlane::Grant{arena.at(offset), hold->deadline, std::move(hold->token)};
}

std::string StoreService::OpenSession(const Caller& caller, const grpc::ServerContext& ctx,
                                      bool keyed) {
  static_assert(ucx::kSessionBytes == wire::kSessionIdBytes);
  std::string id(wire::kSessionIdBytes, '\0');
  std::string key(keyed ? wire::kSessionKeyBytes : 0, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(id.data()), static_cast<int>(id.size())) != 1 ||
      (keyed && RAND_bytes(reinterpret_cast<unsigned char*>(key.data()),
                           static_cast<int>(key.size())) != 1)) {
    return {};  // no randomness: no session (the client keeps gRPC)
  }
  Session session{caller, OwnerOf(ctx, caller), key, ClientOf(ctx), {}};
  const int tenant = caller.tenant_index();
  const uint64_t cap = caller.tenant ? caller.tenant->max_sessions : limits::kSessions;
  uint64_t dropped = 0;
  {
    std::lock_guard lk(sessions_->mu);
    std::list<std::string>& order = sessions_->order[tenant];
    while (!order.empty() && order.size() >= cap) {
      sessions_->by_id.erase(order.front());
      order.pop_front();
      dropped++;
    }
    session.at = order.insert(order.end(), id);
    sessions_->by_id.emplace(id, std::move(session));
  }
  if (dropped > 0) {
    std::lock_guard lk(conns_->mu);
    conns_->by_tenant[tenant].sessions_dropped += dropped;
  }
  return id + key;
}

absl::StatusOr<SocketDataPlane::Admission> StoreService::AdmitConnection(std::string_view id,
                                                                         std::string_view nonce,
                                                                         std::string_view proof) {
  auto session = SessionOf(id);
  if (!session.ok()) return session.status();
  if (session->key.empty() || !wire::ProofHolds(session->key, nonce, id, proof)) {
    return absl::UnauthenticatedError(
        "the hello's proof does not hold for this connection's challenge (a hello read off the "
        "wire opens no other connection); call ConnectDataPlane and prove its session's key");
  }
  auto admitted = session->caller.tenant == nullptr ? AdmitClientConnection(session->client)
                                                    : AdmitTenantConnection(*session);
  if (admitted.ok()) {
    admitted->ticket = Sessions::Hold(sessions_, std::string(id), std::move(admitted->ticket));
  }
  return admitted;
}

std::shared_ptr<void> StoreService::Sessions::Hold(const std::shared_ptr<Sessions>& self,
                                                   const std::string& id,
                                                   std::shared_ptr<void> ticket) {
  {
    std::lock_guard lk(self->mu);
    auto it = self->by_id.find(id);
    // Dropped since the hello was checked: its next call is refused anyway.
    if (it == self->by_id.end()) return ticket;
    it->second.connections++;
  }
  return std::shared_ptr<void>(nullptr, [self, id, ticket = std::move(ticket)](void*) mutable {
    ticket.reset();
    std::lock_guard lk(self->mu);
    auto it = self->by_id.find(id);
    if (it == self->by_id.end() || --it->second.connections > 0) return;
    self->order[it->second.caller.tenant_index()].erase(it->second.at);
    self->by_id.erase(it);
    self->released++;
  });
}

absl::StatusOr<SocketDataPlane::Admission> StoreService::AdmitTenantConnection(
    const Session& session) {
  const Tenant* t = session.caller.tenant;
  const int tenant = session.caller.tenant_index();
  const uint64_t cap = t->max_connections;
  std::string log;
  {
    std::lock_guard lk(conns_->mu);
    TenantConnections& tc = conns_->by_tenant[tenant];
    if (tc.open < cap) {
      tc.open++;
      // A tenant's call bodies count against its own budget; a store
      // without tenants leaves them to the data plane's.
      if (t && !tc.buffer) {
        tc.buffer = std::make_shared<ByteBudget>(
            t->max_buffered, absl::StrCat("buffered= of tenant ", t->name, " in the tenants file"));
      }
      return SocketDataPlane::Admission{std::shared_ptr<void>(nullptr,
                                                              [counts = conns_, tenant](void*) {
                                                                std::lock_guard lk(counts->mu);
                                                                counts->by_tenant[tenant].open--;
                                                              }),
                                        tc.buffer};
    }
    tc.refused++;
    const auto now = std::chrono::steady_clock::now();
    if (now - tc.last_log >= std::chrono::seconds(1)) {
      tc.last_log = now;
      log = absl::StrCat(
          "data plane: tenant ", t->name, " refused a connection at its limit of ", cap,
          " (connections= in the tenants file)",
          tc.unlogged > 0 ? absl::StrCat("; ", tc.unlogged, " more not logged") : std::string());
      tc.unlogged = 0;
    } else {
      tc.unlogged++;
    }
  }
  if (!log.empty()) Log("store", log);
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", t->name, " has ", cap,
      " data-plane connections open, its limit (connections= in the tenants file): close one "
      "or raise it"));
}

absl::StatusOr<SocketDataPlane::Admission> StoreService::AdmitClientConnection(
    const std::string& client) {
  std::string log;
  {
    std::lock_guard lk(conns_->mu);
    uint64_t& open = conns_->by_client[client];
    if (open < client_connections_) {
      open++;
      return SocketDataPlane::Admission{
          std::shared_ptr<void>(nullptr,
                                [counts = conns_, client](void*) {
                                  std::lock_guard lk(counts->mu);
                                  auto it = counts->by_client.find(client);
                                  if (it != counts->by_client.end() && --it->second == 0) {
                                    counts->by_client.erase(it);
                                  }
                                }),
          nullptr};
    }
    conns_->clients_refused++;
    const auto now = std::chrono::steady_clock::now();
    if (now - conns_->last_client_log >= std::chrono::seconds(1)) {
      conns_->last_client_log = now;
      log = absl::StrCat("data plane: client ", client, " refused a connection at its limit of ",
                         client_connections_, " (--data-max-connections-per-client; ",
                         conns_->clients_refused, " refused so far)");
    }
  }
  if (!log.empty()) Log("store", log);
  return absl::ResourceExhaustedError(absl::StrCat(
      "client ", client, " has ", client_connections_,
      " data-plane connections open, its limit (--data-max-connections-per-client): close one "
      "or raise it"));
}

absl::StatusOr<StoreService::Session> StoreService::SessionOf(std::string_view id) const {
  std::lock_guard lk(sessions_->mu);
  auto it = sessions_->by_id.find(std::string(id));
  if (it == sessions_->by_id.end()) {
    return absl::UnauthenticatedError(
        "unknown data-plane session (the store restarted or dropped it); call "
        "ConnectDataPlane again");
  }
  // Used now: the last of its tenant's to be dropped.
  std::list<std::string>& order = sessions_->order[it->second.caller.tenant_index()];
  order.splice(order.end(), order, it->second.at);
  return it->second;
}

DataPlaneServer::CallReply StoreService::ServeCall(uint16_t method, std::string_view session_id,
                                                   std::string_view request) {
  auto session = SessionOf(session_id);
  if (!session.ok()) {
    return {static_cast<int>(absl::StatusCode::kUnauthenticated),
            std::string(session.status().message())};
  }
  // What the call opens is this session's; what it ends must be.
  session->caller.session = std::string(session_id);
  session->owner.session = std::string(session_id);
  // Parses the request, runs `body` for it and encodes the answer, timed
  // under `rpc`.
  auto serve = [&](const char* rpc, auto req, auto resp, auto body) {
    RpcTimer t(fence_, Histogram(rpc));
    absl::Status s = req.ParseFromArray(request.data(), static_cast<int>(request.size()))
                         ? body(req, &resp)
                         : absl::InvalidArgumentError(
                               absl::StrCat(rpc, ": not a ", req.GetDescriptor()->name()));
    t.Finish(s);
    DataPlaneServer::CallReply r{static_cast<int>(s.code()), {}};
    if (s.ok()) {
      resp.SerializeToString(&r.body);
    } else {
      r.body = std::string(s.message());
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
      return {static_cast<int>(absl::StatusCode::kUnimplemented),
              absl::StrCat("data-plane call method ", method,
                           " is not one this store knows (1: BeginGet, 2: ReleaseGets, "
                           "3: BeginPut, 4: CommitPut)")};
  }
}

grpc::Status StoreService::ConnectDataPlane(grpc::ServerContext* ctx,
                                            const v1::ConnectDataPlaneRequest* req,
                                            v1::ConnectDataPlaneResponse* resp) {
  RpcTimer t(fence_, Histogram("ConnectDataPlane"));
  if (sockets_) {
    Caller caller;
    if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
    resp->set_data_address(data_advertise_.empty() ? sockets_->address() : data_advertise_);
    resp->set_data_tls(sockets_->tls());
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
    resp->set_session(OpenSession(caller, *ctx, /*keyed=*/true));
    return t.Done(absl::OkStatus());
  }
  if (!dataplane_) {
    return t.Done(
        absl::FailedPreconditionError("this store has no data plane (start kvtier-store with "
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
    return t.Done(absl::FailedPreconditionError(
        "this store's data plane registered no region for the caller's "
        "tenant; use PutBlocks/GetBlocks"));
  }
  auto* r = resp->add_regions();
  r->set_rkey_id(0);
  r->set_base_addr(dataplane_->base(region));
  r->set_length(dataplane_->length(region));
  r->set_packed_rkey(dataplane_->packed_rkey(region));
  if (offer_shm_ && caller.tenant == nullptr) r->set_shm_path(store_->ram().arena().shm_path());
  resp->set_session(OpenSession(caller, *ctx, /*keyed=*/false));
  return t.Done(absl::OkStatus());
}

}  // namespace kvtier::store
