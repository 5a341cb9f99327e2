#include "client/store_client.h"

#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/rpc/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvtier {

StoreClient::StoreClient(const std::string& address, StoreClientOptions options)
    : address_(address), options_(options) {
  if (options_.tenant_token.empty()) {
    if (const char* t = std::getenv("KVTIER_TENANT_TOKEN")) options_.tenant_token = t;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Come back quickly after a store restart (gRPC's default starts at 1 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // gRPC gives each connection attempt this long at least, its handshake
  // included. At 100 ms a client in a starved process (an engine whose
  // ranks spin on every core) never finished one, and at 1 s a TP = 2
  // engine's scheduler beside a CPU hog timed out its first ("before
  // receiving SETTINGS frame"), so its lookups failed until the back-off
  // let it try again; calls are bounded by their own deadlines meanwhile.
  // A refused attempt ends at once either way, so a restarted store is
  // still found within the back-off.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  channel_ = OpenChannel(address, options.security, args);
  stub_ = v1::Store::NewStub(channel_);
}

absl::StatusOr<v1::ConnectDataPlaneResponse> StoreClient::DataPlaneSession(
    const std::string& client_id, std::chrono::system_clock::time_point deadline, bool* fresh) {
  *fresh = false;
  {
    std::lock_guard lk(session_mu_);
    if (session_) return *session_;
  }
  v1::ConnectDataPlaneRequest req;
  req.set_client_id(client_id);
  v1::ConnectDataPlaneResponse resp;
  auto ctx = Context(deadline);
  // (Its callers, the data plane's, name the operation and the store.)
  if (auto s = stub_->ConnectDataPlane(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
  *fresh = true;
  std::lock_guard lk(session_mu_);
  // Two connections that asked at once keep the first answer.
  if (!session_) session_ = resp;
  return *session_;
}

void StoreClient::ForgetDataPlaneSession(const std::string& session) {
  std::lock_guard lk(session_mu_);
  if (session_ && session_->session() == session) session_.reset();
}

absl::Status StoreClient::Failed(const grpc::Status& s) const {
  absl::Status st = FromGrpc(s);
  if (st.code() != absl::StatusCode::kDeadlineExceeded) return st;
  return Prefixed(st, absl::StrCat("store ", address_, ": "));
}

std::unique_ptr<grpc::ClientContext> StoreClient::Context() const {
  return Context(std::chrono::system_clock::now() +
                 std::chrono::milliseconds(options_.deadline_ms));
}

std::unique_ptr<grpc::ClientContext> StoreClient::Context(
    std::chrono::system_clock::time_point deadline) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(deadline);
  if (!options_.admin_token.empty()) ctx->AddMetadata("x-kvtier-admin-token", options_.admin_token);
  if (!options_.tenant_token.empty()) {
    ctx->AddMetadata("x-kvtier-tenant-token", options_.tenant_token);
  }
  return ctx;
}

absl::StatusOr<RegisteredNamespace> StoreClient::RegisterNamespace(const NamespaceSpec& spec) {
  v1::RegisterNamespaceRequest req;
  ToProto(spec, req.mutable_spec());
  v1::RegisterNamespaceResponse resp;
  auto ctx = Context();
  if (auto st = stub_->RegisterNamespace(ctx.get(), req, &resp); !st.ok()) return Failed(st);
  return RegisteredNamespace{resp.namespace_id(), resp.block_bytes()};
}

absl::StatusOr<std::vector<v1::Tier>> StoreClient::Lookup(uint64_t ns,
                                                          const std::vector<BlockHash>& hashes) {
  v1::LookupRequest req;
  req.set_namespace_id(ns);
  for (const auto& h : hashes) ToProto(h, req.add_hashes());
  v1::LookupResponse resp;
  auto ctx = Context();
  if (auto st = stub_->Lookup(ctx.get(), req, &resp); !st.ok()) return Failed(st);
  std::vector<v1::Tier> out;
  for (int t : resp.tiers()) out.push_back(static_cast<v1::Tier>(t));
  return out;
}

absl::StatusOr<std::vector<uint32_t>> StoreClient::LookupChains(
    uint64_t ns, const std::vector<std::vector<BlockHash>>& chains,
    std::chrono::system_clock::time_point deadline) {
  v1::LookupRequest req;
  req.set_namespace_id(ns);
  for (const auto& chain : chains) {
    req.add_chain_lengths(static_cast<uint32_t>(chain.size()));
    for (const auto& h : chain) ToProto(h, req.add_hashes());
  }
  v1::LookupResponse resp;
  auto ctx = Context(deadline);
  if (auto st = stub_->Lookup(ctx.get(), req, &resp); !st.ok()) return Failed(st);
  if (static_cast<size_t>(resp.present_per_chain_size()) != chains.size()) {
    // A store from before LookupRequest.chain_lengths answers one chain.
    return absl::UnimplementedError(
        absl::StrCat("the store answered ", resp.present_per_chain_size(), " of ", chains.size(),
                     " chains: it predates batched lookups (upgrade kvtier-store)"));
  }
  return std::vector<uint32_t>(resp.present_per_chain().begin(), resp.present_per_chain().end());
}

absl::StatusOr<uint32_t> StoreClient::VerifyBlocks(uint64_t ns,
                                                   const std::vector<BlockHash>& hashes) {
  v1::VerifyBlocksRequest req;
  req.set_namespace_id(ns);
  for (const auto& h : hashes) ToProto(h, req.add_hashes());
  v1::VerifyBlocksResponse resp;
  auto ctx = Context();
  if (auto st = stub_->VerifyBlocks(ctx.get(), req, &resp); !st.ok()) return Failed(st);
  return resp.dropped();
}

absl::StatusOr<InlinePutSummary> StoreClient::PutInline(
    uint64_t ns, const std::vector<std::pair<BlockHash, std::string_view>>& blocks) {
  auto ctx = Context();
  v1::PutBlocksResponse resp;
  auto writer = stub_->PutBlocks(ctx.get(), &resp);
  v1::PutBlocksRequest msg;
  for (const auto& [hash, data] : blocks) {
    msg.set_namespace_id(ns);
    ToProto(hash, msg.mutable_hash());
    msg.set_data(data.data(), data.size());
    msg.set_checksum(Checksum(data.data(), data.size()));
    if (!writer->Write(msg)) break;  // the server ended the stream; Finish says why
  }
  writer->WritesDone();
  if (auto st = writer->Finish(); !st.ok()) return Failed(st);
  return InlinePutSummary{resp.stored(), resp.already_present(), resp.no_space()};
}

absl::StatusOr<std::vector<FetchedBlock>> StoreClient::GetInline(
    uint64_t ns, const std::vector<BlockHash>& hashes) {
  v1::GetBlocksRequest req;
  req.set_namespace_id(ns);
  for (const auto& h : hashes) ToProto(h, req.add_hashes());
  auto ctx = Context();
  auto reader = stub_->GetBlocks(ctx.get(), req);
  std::vector<FetchedBlock> out;
  v1::GetBlocksResponse msg;
  while (reader->Read(&msg)) {
    uint64_t actual = Checksum(msg.data().data(), msg.data().size());
    if (actual != msg.checksum()) {
      ctx->TryCancel();
      reader->Finish();
      return absl::DataLossError(
          absl::StrCat("block ", msg.index(), " failed its checksum on arrival"));
    }
    out.push_back(FetchedBlock{msg.index(), msg.tier(), std::move(*msg.mutable_data())});
  }
  if (auto st = reader->Finish(); !st.ok()) return Failed(st);
  return out;
}

absl::StatusOr<v1::GetStatsResponse> StoreClient::GetStats() {
  v1::GetStatsResponse resp;
  auto ctx = Context();
  if (auto st = stub_->GetStats(ctx.get(), v1::GetStatsRequest(), &resp); !st.ok()) {
    return Failed(st);
  }
  return resp;
}

absl::StatusOr<v1::EvictResponse> StoreClient::Evict(const v1::EvictRequest& request) {
  v1::EvictResponse resp;
  auto ctx = Context();
  if (auto st = stub_->Evict(ctx.get(), request, &resp); !st.ok()) return Failed(st);
  return resp;
}

absl::StatusOr<v1::TierPolicy> StoreClient::SetPolicy(v1::Tier tier, const std::string& policy) {
  v1::SetPolicyRequest req;
  req.mutable_policy()->set_tier(tier);
  req.mutable_policy()->set_policy(policy);
  v1::SetPolicyResponse resp;
  auto ctx = Context();
  if (auto st = stub_->SetPolicy(ctx.get(), req, &resp); !st.ok()) return Failed(st);
  return resp.policy();
}

absl::Status StoreClient::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  auto ctx = Context();
  if (auto st = health->Check(ctx.get(), req, &resp); !st.ok()) return Failed(st);
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("store health is ", resp.status()));
  }
  return absl::OkStatus();
}

}  // namespace kvtier
