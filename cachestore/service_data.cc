// The data path's RPCs: lookups, put and get leases, inline puts and gets,
// verification.
#include <algorithm>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cachestore/service.h"
#include "cachestore/service_detail.h"
#include "common/limits.h"
#include "common/rpc/proto_convert.h"

namespace kvtier::store {

using service_detail::Hashes;
using service_detail::RpcTimer;
using service_detail::TenantRamFull;
using service_detail::ToProto;

grpc::Status StoreService::Lookup(grpc::ServerContext* ctx, const v1::LookupRequest* req,
                                  v1::LookupResponse* resp) {
  RpcTimer t(fence_, Histogram("Lookup"));
  Caller caller;
  uint64_t ns;
  if (auto s = Identify(*ctx, req->namespace_id(), &caller, &ns); !s.ok()) return t.Done(s);
  std::vector<BlockHash> hashes = Hashes(req->hashes());
  if (req->chain_lengths_size() == 0) {
    auto tiers = store_->Lookup(ns, hashes);
    if (!tiers.ok()) return t.Done(tiers.status());
    resp->set_present_blocks(static_cast<uint32_t>(tiers->size()));
    for (TierKind tier : *tiers) resp->add_tiers(ToProto(tier));
    return t.Done(absl::OkStatus());
  }
  // Several chains, back to back: each one's present prefix. The lengths
  // are checked whole before any chain is looked up.
  size_t total = 0;
  for (uint32_t n : req->chain_lengths()) {
    if (n == 0) return t.Done(absl::InvalidArgumentError("a chain in chain_lengths is empty"));
    total += n;
  }
  if (hashes.size() > limits::kMaxBlocksPerRequest) {
    return t.Done(absl::InvalidArgumentError(
        absl::StrCat("request names ", hashes.size(), " block hashes; the limit is ",
                     limits::kMaxBlocksPerRequest, " over all its chains")));
  }
  if (total != hashes.size()) {
    return t.Done(absl::InvalidArgumentError(absl::StrCat("chain_lengths add up to ", total,
                                                          " but the request names ", hashes.size(),
                                                          " block hashes")));
  }
  std::span<const BlockHash> all(hashes);
  size_t at = 0;
  for (uint32_t n : req->chain_lengths()) {
    auto tiers = store_->Lookup(ns, all.subspan(at, n));
    if (!tiers.ok()) return t.Done(tiers.status());
    resp->add_present_per_chain(static_cast<uint32_t>(tiers->size()));
    at += n;
  }
  return t.Done(absl::OkStatus());
}

grpc::Status StoreService::BeginPut(grpc::ServerContext* ctx, const v1::BeginPutRequest* req,
                                    v1::BeginPutResponse* resp) {
  RpcTimer t(fence_, Histogram("BeginPut"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  // A caller that stopped waiting (a writer's short budget, spent while this
  // store was stalled) would never commit or abort what this reserved: the
  // slots would stay busy to every other writer until the lease expired.
  if (ctx->deadline() <= std::chrono::system_clock::now()) {
    return t.Done(absl::DeadlineExceededError("BeginPut arrived after its deadline"));
  }
  absl::Status s = DoBeginPut(caller, OwnerOf(*ctx, caller), *req, resp);
  if (s.ok() && (ctx->IsCancelled() || ctx->deadline() <= std::chrono::system_clock::now())) {
    // Reserved, but too late for the caller to hear it: give the slots back.
    if (resp->lease_id() != 0)
      store_->AbortPut(resp->lease_id(), caller.tenant_index()).IgnoreError();
    return t.Done(absl::DeadlineExceededError("BeginPut answered after its deadline"));
  }
  return t.Done(s);
}

absl::Status StoreService::DoBeginPut(const Caller& caller, const LeaseOwner& owner,
                                      const v1::BeginPutRequest& req, v1::BeginPutResponse* resp) {
  uint64_t ns;
  if (auto s = Resolve(caller, req.namespace_id(), &ns); !s.ok()) return s;
  const uint64_t token = req.abandon_token();
  if (token != 0 && abandoned_.GivenUp(caller.tenant_index(), token)) {
    return absl::AbortedError("BeginPut was given up by its writer (AbortPut of its token)");
  }
  auto r = store_->BeginPut(ns, Hashes(req.hashes()), owner);
  if (!r.ok()) return r.status();
  if (token != 0 && r->lease != 0 && abandoned_.Opened(caller.tenant_index(), token, r->lease)) {
    store_->AbortPut(r->lease, caller.tenant_index(), caller.session).IgnoreError();
    return absl::AbortedError("BeginPut was given up by its writer while it was served");
  }
  if (caller.tenant && r->lease == 0 &&
      std::any_of(r->targets.begin(), r->targets.end(),
                  [](const PutTarget& p) { return p.placement == Placement::kNoSpace; })) {
    return TenantRamFull(*caller.tenant);
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
  return absl::OkStatus();
}

grpc::Status StoreService::CommitPut(grpc::ServerContext* ctx, const v1::CommitPutRequest* req,
                                     v1::CommitPutResponse* resp) {
  RpcTimer t(fence_, Histogram("CommitPut"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoCommitPut(caller, *req, resp));
}

absl::Status StoreService::DoCommitPut(const Caller& caller, const v1::CommitPutRequest& req,
                                       v1::CommitPutResponse* resp) {
  std::vector<uint64_t> sums(req.checksums().begin(), req.checksums().end());
  auto n = store_->CommitPut(req.lease_id(), sums, caller.tenant_index(), req.store_checksums(),
                             caller.session);
  if (!n.ok()) return n.status();
  resp->set_committed(*n);
  return absl::OkStatus();
}

grpc::Status StoreService::AbortPut(grpc::ServerContext* ctx, const v1::AbortPutRequest* req,
                                    v1::AbortPutResponse*) {
  RpcTimer t(fence_, Histogram("AbortPut"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  if (req->begin_token() != 0) {
    if (req->lease_id() != 0) {
      return t.Done(
          absl::InvalidArgumentError("AbortPut names a lease_id or a begin_token, not both"));
    }
    const uint64_t lease = abandoned_.Abandon(caller.tenant_index(), req->begin_token());
    // The lease may have been committed since: then there is nothing to give back.
    if (lease != 0) store_->AbortPut(lease, caller.tenant_index(), caller.session).IgnoreError();
    return t.Done(absl::OkStatus());
  }
  return t.Done(store_->AbortPut(req->lease_id(), caller.tenant_index()));
}

grpc::Status StoreService::BeginGet(grpc::ServerContext* ctx, const v1::BeginGetRequest* req,
                                    v1::BeginGetResponse* resp) {
  RpcTimer t(fence_, Histogram("BeginGet"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoBeginGet(caller, OwnerOf(*ctx, caller), *req, resp));
}

absl::Status StoreService::DoBeginGet(const Caller& caller, const LeaseOwner& owner,
                                      const v1::BeginGetRequest& req, v1::BeginGetResponse* resp) {
  // Releases that travel with this request go first: their pins may be what
  // makes room for this one's promotions.
  if (req.end_leases_size() > 0) {
    auto gone = store_->ReleaseGets(
        std::span<const uint64_t>(req.end_leases().data(), req.end_leases_size()),
        caller.tenant_index(), caller.session);
    if (!gone.ok()) return gone.status();
    for (uint64_t id : *gone) resp->add_leases_not_found(id);
  }
  uint64_t ns;
  if (auto s = Resolve(caller, req.namespace_id(), &ns); !s.ok()) return s;
  auto r = store_->BeginGet(ns, Hashes(req.hashes()), owner);
  if (!r.ok()) return r.status();
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
  return absl::OkStatus();
}

grpc::Status StoreService::EndGet(grpc::ServerContext* ctx, const v1::EndGetRequest* req,
                                  v1::EndGetResponse*) {
  RpcTimer t(fence_, Histogram("EndGet"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(store_->EndGet(req->lease_id(), caller.tenant_index()));
}

grpc::Status StoreService::ReleaseGets(grpc::ServerContext* ctx, const v1::ReleaseGetsRequest* req,
                                       v1::ReleaseGetsResponse* resp) {
  RpcTimer t(fence_, Histogram("ReleaseGets"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  return t.Done(DoReleaseGets(caller, *req, resp));
}

absl::Status StoreService::DoReleaseGets(const Caller& caller, const v1::ReleaseGetsRequest& req,
                                         v1::ReleaseGetsResponse* resp) {
  if (req.lease_ids_size() == 0) {
    return absl::InvalidArgumentError("ReleaseGets names no lease");
  }
  auto gone =
      store_->ReleaseGets(std::span<const uint64_t>(req.lease_ids().data(), req.lease_ids_size()),
                          caller.tenant_index(), caller.session);
  if (!gone.ok()) return gone.status();
  for (uint64_t id : *gone) resp->add_not_found(id);
  resp->set_released(static_cast<uint32_t>(req.lease_ids_size() - gone->size()));
  return absl::OkStatus();
}

grpc::Status StoreService::VerifyBlocks(grpc::ServerContext* ctx,
                                        const v1::VerifyBlocksRequest* req,
                                        v1::VerifyBlocksResponse* resp) {
  RpcTimer t(fence_, Histogram("VerifyBlocks"));
  Caller caller;
  uint64_t ns;
  if (auto s = Identify(*ctx, req->namespace_id(), &caller, &ns); !s.ok()) return t.Done(s);
  auto r = store_->VerifyBlocks(ns, Hashes(req->hashes()));
  if (!r.ok()) return t.Done(r.status());
  resp->set_checked(r->checked);
  resp->set_dropped(r->dropped);
  return t.Done(absl::OkStatus());
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
      return t.Done(absl::InvalidArgumentError(
          absl::StrCat("message ", index, " of the stream has no hash")));
    }
    absl::StatusOr<InlinePutResult> r = absl::UnknownError("unset");
    uint64_t ns;
    if (absl::Status s = Resolve(caller, req.namespace_id(), &ns); s.ok()) {
      r = store_->PutInline(ns, FromProto(req.hash()), req.data(), req.checksum());
    } else {
      r = s;
    }
    if (r.ok() && caller.tenant && r->outcome == InlinePutResult::kNoSpace) {
      r = TenantRamFull(*caller.tenant);
    }
    if (!r.ok()) {
      // Blocks before this one stay stored; say which message failed.
      absl::Status s = r.status();
      return t.Done(
          absl::Status(s.code(), absl::StrCat("message ", index, " of the stream: ", s.message(),
                                              " (", resp->stored(), " earlier blocks stored)")));
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
  return t.Done(absl::OkStatus());
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
  return t.Done(s);
}

}  // namespace kvtier::store
