// The kvtier.v1.Store gRPC service over a Store: message validation, proto
// conversion and per-RPC latency histograms. Thread-safe.
#pragma once

#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "cachestore/abandoned_puts.h"
#include "cachestore/dataplane.h"
#include "cachestore/socket_dataplane.h"
#include "cachestore/store.h"
#include "common/histogram.h"
#include "common/limits.h"
#include "common/rpc/admin_gate.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/metrics.h"
#include "kvtier/v1/store.grpc.pb.h"

namespace kvtier::store {

class StoreService final : public kvtier::v1::Store::Service {
 public:
  // dataplane (UCX) and sockets (the socket data plane) may each be null;
  // with neither, the inline path only. With a data plane, answers its
  // control calls (common/ucx/calls.h) too, and grants the socket data
  // plane's transfers (GrantTransfer). ConnectDataPlane offers the socket
  // data plane where there is one.
  StoreService(Store* store, DataPlaneServer* dataplane, SocketDataPlane* sockets = nullptr);
  // Stops answering the data plane's calls (returns once none runs); call
  // before the data plane goes. Idempotent; the destructor calls it too.
  void DetachDataPlane();
  ~StoreService() override;
  // Whether ConnectDataPlane offers the RAM arena's memfd to same-host
  // clients (RemoteRegion.shm_path). Set before serving.
  void OfferSharedMemory(bool offer) { offer_shm_ = offer; }
  // Admin RPCs (SetPolicy, Evict, RemoveNamespace) then need metadata x-kvtier-admin-token
  // equal to token; empty: no check.
  void SetAdminToken(std::string token) { admin_.set_token(std::move(token)); }
  // Admin RPCs then also need a verified client certificate (mutual TLS)
  // whose common name or a subject alternative name is `name`.
  void SetAdminIdentity(std::string name) { admin_.set_identity(std::move(name)); }
  // A client's socket data-plane connections open at once on a store
  // without tenants (tenants have connections= instead). Set before serving.
  void SetClientConnectionLimit(uint64_t n) { client_connections_ = n; }
  // The HOST:PORT ConnectDataPlane names for the socket data plane instead
  // of the one it is bound to (a proxy, NAT or a port-forward in between);
  // empty: the bound one. Set before serving.
  void AdvertiseDataPlane(std::string address) { data_advertise_ = std::move(address); }
  // Call once the gRPC server has shut down (see HandlerFence).
  void Quiesce() const { fence_.Quiesce(); }

  grpc::Status RegisterNamespace(grpc::ServerContext*, const v1::RegisterNamespaceRequest*,
                                 v1::RegisterNamespaceResponse*) override;
  grpc::Status ListNamespaces(grpc::ServerContext*, const v1::ListNamespacesRequest*,
                              v1::ListNamespacesResponse*) override;
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*, v1::LookupResponse*) override;
  grpc::Status BeginPut(grpc::ServerContext*, const v1::BeginPutRequest*,
                        v1::BeginPutResponse*) override;
  grpc::Status CommitPut(grpc::ServerContext*, const v1::CommitPutRequest*,
                         v1::CommitPutResponse*) override;
  grpc::Status AbortPut(grpc::ServerContext*, const v1::AbortPutRequest*,
                        v1::AbortPutResponse*) override;
  grpc::Status BeginGet(grpc::ServerContext*, const v1::BeginGetRequest*,
                        v1::BeginGetResponse*) override;
  grpc::Status EndGet(grpc::ServerContext*, const v1::EndGetRequest*, v1::EndGetResponse*) override;
  grpc::Status ReleaseGets(grpc::ServerContext*, const v1::ReleaseGetsRequest*,
                           v1::ReleaseGetsResponse*) override;
  grpc::Status VerifyBlocks(grpc::ServerContext*, const v1::VerifyBlocksRequest*,
                            v1::VerifyBlocksResponse*) override;
  grpc::Status PutBlocks(grpc::ServerContext*, grpc::ServerReader<v1::PutBlocksRequest>*,
                         v1::PutBlocksResponse*) override;
  grpc::Status GetBlocks(grpc::ServerContext*, const v1::GetBlocksRequest*,
                         grpc::ServerWriter<v1::GetBlocksResponse>*) override;
  grpc::Status Evict(grpc::ServerContext*, const v1::EvictRequest*, v1::EvictResponse*) override;
  grpc::Status RemoveNamespace(grpc::ServerContext*, const v1::RemoveNamespaceRequest*,
                               v1::RemoveNamespaceResponse*) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                        v1::GetStatsResponse*) override;
  grpc::Status GetPolicy(grpc::ServerContext*, const v1::GetPolicyRequest*,
                         v1::GetPolicyResponse*) override;
  grpc::Status SetPolicy(grpc::ServerContext*, const v1::SetPolicyRequest*,
                         v1::SetPolicyResponse*) override;
  grpc::Status ConnectDataPlane(grpc::ServerContext*, const v1::ConnectDataPlaneRequest*,
                                v1::ConnectDataPlaneResponse*) override;

  // Prometheus families for a scrape (docs/operations.md lists them).
  std::vector<prometheus::MetricFamily> CollectMetrics();

 private:
  LatencyHistogram& Histogram(const std::string& rpc) { return *histograms_.at(rpc); }

  // Who calls: with tenants, the caller's tenant (by certificate name or
  // x-kvtier-tenant-token), else UNAUTHENTICATED; without, nobody in
  // particular (and nothing is looked at).
  struct Caller {
    const Tenant* tenant = nullptr;
    // The data-plane session a call came on (empty over gRPC): the leases
    // it opens are that session's (LeaseOwner::session).
    std::string session{};
    int tenant_index() const { return tenant ? tenant->index : -1; }
  };
  absl::Status Identify(const grpc::ServerContext& ctx, Caller* caller) const;
  // Identify, and the namespace the store keys under for the one the caller
  // names (a tenant's, through its salt; NOT_FOUND as for an unregistered
  // one).
  absl::Status Identify(const grpc::ServerContext& ctx, uint64_t ns, Caller* caller,
                        uint64_t* store_ns) const;
  // The namespace resolution alone, for a caller already identified.
  absl::Status Resolve(const Caller& caller, uint64_t ns, uint64_t* store_ns) const;
  // Whom the caller's leases count against.
  LeaseOwner OwnerOf(const grpc::ServerContext& ctx, const Caller& caller) const;

  // BeginGet, ReleaseGets, BeginPut and CommitPut for an identified caller,
  // whichever way the call came (gRPC, or the data plane's control calls).
  // Inside the service statuses are absl's; a handler's RpcTimer turns its
  // answer into gRPC's, and a data-plane reply carries the absl code.
  absl::Status DoBeginPut(const Caller& caller, const LeaseOwner& owner,
                          const v1::BeginPutRequest& req, v1::BeginPutResponse* resp);
  absl::Status DoBeginGet(const Caller& caller, const LeaseOwner& owner,
                          const v1::BeginGetRequest& req, v1::BeginGetResponse* resp);
  absl::Status DoReleaseGets(const Caller& caller, const v1::ReleaseGetsRequest& req,
                             v1::ReleaseGetsResponse* resp);
  absl::Status DoCommitPut(const Caller& caller, const v1::CommitPutRequest& req,
                           v1::CommitPutResponse* resp);

  // Data-plane sessions: ConnectDataPlane hands one out per client, so a
  // control call on the data plane acts as the authenticated caller did.
  // Each tenant keeps at most its `sessions=` (a store without tenants,
  // limits::kSessions): its idlest goes first, never another tenant's; the
  // client is answered UNAUTHENTICATED and connects again. A socket
  // session is released when its last connection closes.
  struct Session {
    Caller caller;
    LeaseOwner owner;  // OwnerOf the ConnectDataPlane call
    std::string key;   // the socket data plane's hello key (empty on UCX)
    // Without tenants, whose connections it counts against: a verified
    // certificate's identity, else the caller's host.
    std::string client;
    std::list<std::string>::iterator at;  // its place in Sessions::order
    int connections = 0;                  // its open socket connections
  };
  // The sessions, shared with the tickets of their connections (which
  // release them as they close, whenever that is).
  struct Sessions {
    std::mutex mu;
    std::map<std::string, Session> by_id;  // guarded by mu
    // Each tenant's (index; -1: none) sessions, the longest idle first (a
    // session's use moves it to the back): past the tenant's cap the idlest
    // goes, never a long-lived engine's busy one. Guarded by mu.
    std::map<int, std::list<std::string>> order;
    uint64_t released = 0;  // by their last connection's close; guarded by mu
    // `ticket` (an admitted connection's) wrapped so that its release also
    // releases session `id` when that was the session's last connection.
    static std::shared_ptr<void> Hold(const std::shared_ptr<Sessions>& self, const std::string& id,
                                      std::shared_ptr<void> ticket);
  };
  // BeginPut tokens (and tombstones) kept for writers that give up waiting.
  static constexpr size_t kMaxAbandonTokens = 65536;
  // A new session for `caller`: what ConnectDataPlane hands out as its
  // `session`. On the socket data plane it is the id and a key to prove it
  // with (common/data_hello.h); on UCX the id alone. Empty without
  // randomness (the client keeps gRPC).
  std::string OpenSession(const Caller& caller, const grpc::ServerContext& ctx, bool keyed);
  // The session handed out as `id`; UNAUTHENTICATED (saying to connect
  // again) for one the store does not know.
  absl::StatusOr<Session> SessionOf(std::string_view id) const;
  // A socket data-plane connection presenting session `id` with `proof`
  // for its challenge `nonce`: UNAUTHENTICATED unless the proof holds for
  // the session's key; else its ticket (held while the connection lives)
  // within its tenant's `connections=`;
  // RESOURCE_EXHAUSTED naming the limit past it (counted, logged at most
  // once a second per tenant).
  // Without tenants: within the client's --data-max-connections-per-client.
  absl::StatusOr<SocketDataPlane::Admission> AdmitClientConnection(const std::string& client);
  absl::StatusOr<SocketDataPlane::Admission> AdmitTenantConnection(const Session& session);
  absl::StatusOr<SocketDataPlane::Admission> AdmitConnection(std::string_view id,
                                                             std::string_view nonce,
                                                             std::string_view proof);
  DataPlaneServer::CallReply ServeCall(uint16_t method, std::string_view session,
                                       std::string_view request);
  // A socket data-plane transfer of `length` bytes at `addr` (as BeginGet or
  // BeginPut handed it out) under `lease`: allowed only for a live lease of
  // the session's tenant, of the transfer's kind, whose slot holds the whole
  // range (LeaseTable::Use). UNAUTHENTICATED for an unknown session.
  absl::StatusOr<SocketDataPlane::Grant> GrantTransfer(std::string_view session, bool is_put,
                                                       uint64_t lease, uint64_t addr,
                                                       uint64_t length);

  Store* store_;
  bool offer_shm_ = true;
  const uint64_t instance_id_;  // random per process (ConnectDataPlaneResponse.instance_id)
  DataPlaneServer* dataplane_;
  SocketDataPlane* sockets_;
  std::string data_advertise_;  // AdvertiseDataPlane
  uint64_t client_connections_ = limits::kClientDataConnections;
  AdminGate admin_;
  HandlerFence fence_;  // every handler releases it as it finishes
  std::map<std::string, std::unique_ptr<LatencyHistogram>> histograms_;
  const std::shared_ptr<Sessions> sessions_ = std::make_shared<Sessions>();
  // Each tenant's data-plane connections (AdmitConnection).
  struct TenantConnections {
    uint64_t open = 0;
    uint64_t refused = 0;
    uint64_t sessions_dropped = 0;       // its oldest, for its newer ones
    std::shared_ptr<ByteBudget> buffer;  // its call bodies being read (buffered=)
    std::chrono::steady_clock::time_point last_log;
    uint64_t unlogged = 0;
  };
  struct ConnectionCounts {
    std::mutex mu;
    std::map<int, TenantConnections> by_tenant;  // guarded by mu
    // Without tenants: each client's open connections (entries go at 0),
    // and refusals in all.
    std::map<std::string, uint64_t> by_client;              // guarded by mu
    uint64_t clients_refused = 0;                           // guarded by mu
    std::chrono::steady_clock::time_point last_client_log;  // guarded by mu
  };
  // Shared with the tickets, which may outlive the service.
  const std::shared_ptr<ConnectionCounts> conns_ = std::make_shared<ConnectionCounts>();
  AbandonedPuts abandoned_;  // BeginPut tokens their writers gave up on
  std::chrono::steady_clock::time_point started_;
  // Bytes handed out for RMA (reserved by BeginPut, pinned by BeginGet).
  std::atomic<uint64_t> rma_put_bytes_{0}, rma_get_bytes_{0};
};

}  // namespace kvtier::store
