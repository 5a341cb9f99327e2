// What the StoreService's files share: the RPC timer (where the store's
// absl::Status becomes a gRPC one), tenant and lease helpers, and the tier
// and hash conversions. Internal to cachestore/service*.cc.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cachestore/service.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"
#include "common/rpc/tls.h"

namespace kvtier::store::service_detail {

// Whom a lease counts against (--max-leases-per-client): the identity of a
// verified client certificate, else the connection. Never the request's
// client_id: a client filling in a new one per request would have no limit.
// (client_id stays in the protocol as a label for logs; it keys nothing.)
inline std::string LeaseHolder(const grpc::ServerContext& ctx) {
  std::vector<std::string> names = PeerCertificateNames(ctx);
  return names.empty() ? absl::StrCat("connection ", ctx.peer())
                       : absl::StrCat("identity ", names[0]);
}

// Whom a data-plane connection counts against on a store without tenants
// (--data-max-connections-per-client): a verified certificate's identity,
// else the peer's host without its port (a client opening more gRPC
// connections is still one client; clients behind one address share).
inline std::string ClientOf(const grpc::ServerContext& ctx) {
  std::vector<std::string> names = PeerCertificateNames(ctx);
  if (!names.empty()) return absl::StrCat("identity ", names[0]);
  const std::string peer = ctx.peer();  // "ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"
  const size_t colon = peer.rfind(':');
  const size_t scheme = peer.find(':');
  return colon != std::string::npos && colon != scheme ? peer.substr(0, colon) : peer;
}

using Clock = std::chrono::steady_clock;

// The metadata key a tenant's bearer token travels in.
inline constexpr char kTenantTokenKey[] = "x-kvtier-tenant-token";

// Why a tenant's put found no room: its region is full of pinned or
// half-written blocks (evictable ones would have made room).
inline absl::Status TenantRamFull(const Tenant& t) {
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
  // The handler's answer, as gRPC status (the one place the store's
  // absl::Status becomes one).
  grpc::Status Done(const absl::Status& s) {
    Record(s.ok());
    return ToGrpc(s);
  }
  grpc::Status Done(const grpc::Status& s) {  // AdminGate's answer
    Record(s.ok());
    return s;
  }
  // A data-plane call's answer, which stays an absl::Status.
  void Finish(const absl::Status& s) { Record(s.ok()); }

 private:
  void Record(bool ok) {
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start_);
    h_.Record(static_cast<uint64_t>(us.count()), ok);
    fence_.Release();
  }

  HandlerFence& fence_;
  LatencyHistogram& h_;
  Clock::time_point start_;
};

inline std::vector<BlockHash> Hashes(const google::protobuf::RepeatedPtrField<v1::BlockHash>& in) {
  std::vector<BlockHash> out;
  out.reserve(in.size());
  for (const auto& h : in) out.push_back(FromProto(h));
  return out;
}

inline v1::Tier ToProto(TierKind t) { return t == TierKind::kRam ? v1::TIER_RAM : v1::TIER_DISK; }

inline absl::StatusOr<TierKind> TierFromProto(v1::Tier t) {
  if (t == v1::TIER_RAM) return TierKind::kRam;
  if (t == v1::TIER_DISK) return TierKind::kDisk;
  return absl::InvalidArgumentError("tier must be TIER_RAM or TIER_DISK");
}

}  // namespace kvtier::store::service_detail
