// RawRma (raw_rma.h): the benchmarks' data-plane ceiling.
#include "bench/raw_rma.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "client/data_plane_connection.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"
#include "common/ucx/ucx.h"

namespace kvtier::bench {

namespace {
std::chrono::system_clock::time_point RpcDeadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(30);
}
ucx::Clock::time_point RmaDeadline() { return ucx::Clock::now() + std::chrono::seconds(60); }
}  // namespace

RawRma::RawRma(const std::string& store, DataClientOptions options)
    : address_(store), options_(std::move(options)), control_(store, [&] {
        StoreClientOptions o;
        o.security = options_.security;
        return o;
      }()) {}

absl::StatusOr<std::unique_ptr<RawRma>> RawRma::Connect(const std::string& store,
                                                        DataClientOptions options) {
  std::unique_ptr<RawRma> r(new RawRma(store, std::move(options)));
  auto ctx = ucx::Context::Create();
  if (!ctx.ok()) return ctx.status();
  r->ctx_ = *ctx;
  r->conn_ = std::make_unique<DataPlaneConnection>(ucx::Worker::Create(r->ctx_, false), r->address_,
                                                   r->options_, r->control_);
  if (auto s = r->conn_->EnsureConnected(RpcDeadline()); !s.ok()) return s;
  return r;
}

RawRma::~RawRma() {
  if (!get_leases_.empty()) {
    v1::ReleaseGetsRequest req;
    for (uint64_t lease : get_leases_) req.add_lease_ids(lease);
    v1::ReleaseGetsResponse resp;
    auto ctx = control_.Context(RpcDeadline());
    control_.stub().ReleaseGets(ctx.get(), req, &resp);  // best effort: leases expire
  }
  for (uint64_t lease : put_leases_) {
    v1::AbortPutRequest req;
    req.set_lease_id(lease);
    v1::AbortPutResponse resp;
    auto ctx = control_.Context(RpcDeadline());
    control_.stub().AbortPut(ctx.get(), req, &resp);
  }
  conn_.reset();  // endpoints before registrations
  regions_.clear();
}

absl::Status RawRma::Register(void* addr, size_t length) {
  auto r = ucx::MemoryRegion::Map(ctx_, addr, length);
  if (!r.ok()) return r.status();
  regions_.push_back(std::shared_ptr<ucx::MemoryRegion>(std::move(*r)));
  conn_->UseRegions(regions_);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> RawRma::PinForGet(uint64_t ns,
                                                        const std::vector<BlockHash>& chain) {
  v1::BeginGetRequest req;
  req.set_namespace_id(ns);
  req.set_client_id("raw-rma");
  for (const auto& h : chain) ToProto(h, req.add_hashes());
  v1::BeginGetResponse resp;
  auto ctx = control_.Context(RpcDeadline());
  if (auto s = FromGrpc(control_.stub().BeginGet(ctx.get(), req, &resp)); !s.ok()) return s;
  if (resp.lease_id() != 0) get_leases_.push_back(resp.lease_id());
  std::vector<uint64_t> addrs;
  for (const auto& src : resp.sources()) addrs.push_back(src.remote_addr());
  return addrs;
}

absl::StatusOr<std::vector<uint64_t>> RawRma::ReserveForPut(uint64_t ns, uint64_t first_id,
                                                            size_t count) {
  v1::BeginPutRequest req;
  req.set_namespace_id(ns);
  req.set_client_id("raw-rma");
  for (size_t i = 0; i < count; ++i)
    ToProto(BlockHash{0x7261772d726d61ull, first_id + i}, req.add_hashes());
  v1::BeginPutResponse resp;
  auto ctx = control_.Context(RpcDeadline());
  if (auto s = FromGrpc(control_.stub().BeginPut(ctx.get(), req, &resp)); !s.ok()) return s;
  if (resp.lease_id() != 0) put_leases_.push_back(resp.lease_id());
  std::vector<uint64_t> addrs;
  for (const auto& t : resp.targets()) {
    if (t.disposition() != v1::PUT_RESERVED) {
      return absl::ResourceExhaustedError("the store reserved fewer slots than asked");
    }
    addrs.push_back(t.remote_addr());
  }
  return addrs;
}

absl::Status RawRma::Get(const std::vector<uint64_t>& addrs, uint64_t length, uint8_t* dest) {
  std::vector<void*> reqs;
  reqs.reserve(addrs.size());
  for (size_t i = 0; i < addrs.size(); ++i) {
    reqs.push_back(conn_->PostGet(dest + i * length, length, addrs[i], /*lease=*/0));
  }
  return conn_->Wait(reqs, RmaDeadline());
}

absl::Status RawRma::Put(const std::vector<uint64_t>& addrs, uint64_t length, const uint8_t* src) {
  std::vector<void*> reqs;
  reqs.reserve(addrs.size() + 1);
  for (size_t i = 0; i < addrs.size(); ++i) {
    reqs.push_back(conn_->PostPut(src + i * length, length, addrs[i], /*lease=*/0));
  }
  reqs.push_back(conn_->PostFlush());
  return conn_->Wait(reqs, RmaDeadline());
}

}  // namespace kvtier::bench
