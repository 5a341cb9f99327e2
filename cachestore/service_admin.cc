// The operators' RPCs and namespace registration: namespaces, eviction,
// stats and policy.
#include "cachestore/service.h"
#include "cachestore/service_detail.h"
#include "common/rpc/proto_convert.h"
#include "common/version.h"

namespace kvtier::store {

using service_detail::Clock;
using service_detail::RpcTimer;
using service_detail::TierFromProto;
using service_detail::ToProto;

namespace {

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

grpc::Status StoreService::RegisterNamespace(grpc::ServerContext* ctx,
                                             const v1::RegisterNamespaceRequest* req,
                                             v1::RegisterNamespaceResponse* resp) {
  RpcTimer t(fence_, Histogram("RegisterNamespace"));
  Caller caller;
  if (auto s = Identify(*ctx, &caller); !s.ok()) return t.Done(s);
  if (!req->has_spec()) return t.Done(absl::InvalidArgumentError("spec is missing"));
  auto info = store_->RegisterNamespace(FromProto(req->spec()), req->expected_id(), caller.tenant);
  if (!info.ok()) return t.Done(info.status());
  resp->set_namespace_id(info->client_id);
  resp->set_block_bytes(info->block_bytes);
  return t.Done(absl::OkStatus());
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
  return t.Done(absl::OkStatus());
}

grpc::Status StoreService::RemoveNamespace(grpc::ServerContext* ctx,
                                           const v1::RemoveNamespaceRequest* req,
                                           v1::RemoveNamespaceResponse* resp) {
  RpcTimer t(fence_, Histogram("RemoveNamespace"));
  if (auto s = admin_.Check(*ctx, "RemoveNamespace"); !s.ok()) return t.Done(s);
  auto r = store_->RemoveNamespace(req->namespace_id());
  if (!r.ok()) return t.Done(r.status());
  resp->set_ram_blocks(r->ram_blocks);
  resp->set_disk_blocks(r->disk_blocks);
  resp->set_pinned_blocks(r->pinned_blocks);
  return t.Done(absl::OkStatus());
}

grpc::Status StoreService::Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                                 v1::EvictResponse* resp) {
  RpcTimer t(fence_, Histogram("Evict"));
  if (auto s = admin_.Check(*ctx, "Evict"); !s.ok()) return t.Done(s);
  absl::StatusOr<EvictResult> r;
  switch (req->target_case()) {
    case v1::EvictRequest::kAll:
      if (!req->all()) {
        return t.Done(absl::InvalidArgumentError("evict all=false names nothing"));
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
      return t.Done(absl::InvalidArgumentError("evict needs a target: all, namespace_id or keys"));
  }
  if (!r.ok()) return t.Done(r.status());
  resp->set_ram_blocks(r->ram_blocks);
  resp->set_disk_blocks(r->disk_blocks);
  resp->set_pinned_blocks(r->pinned_blocks);
  return t.Done(absl::OkStatus());
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
  return t.Done(absl::OkStatus());
}

grpc::Status StoreService::GetPolicy(grpc::ServerContext*, const v1::GetPolicyRequest*,
                                     v1::GetPolicyResponse* resp) {
  RpcTimer t(fence_, Histogram("GetPolicy"));
  FillPolicy(store_, TierKind::kRam, resp->add_policies());
  FillPolicy(store_, TierKind::kDisk, resp->add_policies());
  return t.Done(absl::OkStatus());
}

grpc::Status StoreService::SetPolicy(grpc::ServerContext* ctx, const v1::SetPolicyRequest* req,
                                     v1::SetPolicyResponse* resp) {
  RpcTimer t(fence_, Histogram("SetPolicy"));
  if (auto s = admin_.Check(*ctx, "SetPolicy"); !s.ok()) return t.Done(s);
  auto tier = TierFromProto(req->policy().tier());
  if (!tier.ok()) return t.Done(tier.status());
  std::map<std::string, double> params(req->policy().params().begin(),
                                       req->policy().params().end());
  if (auto s = store_->SetPolicy(*tier, req->policy().policy(), params); !s.ok()) {
    return t.Done(s);
  }
  FillPolicy(store_, *tier, resp->mutable_policy());
  return t.Done(absl::OkStatus());
}

}  // namespace kvtier::store
