#include "common/store_data_client.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/grpc_status.h"
#include "common/ucx.h"

namespace kvtier {

namespace {

using Clock = std::chrono::steady_clock;

// One deadline for a whole operation (connect, RPCs, transfers), on both clocks.
std::pair<Clock::time_point, std::chrono::system_clock::time_point> OperationDeadline(int ms) {
  return {Clock::now() + std::chrono::milliseconds(ms),
          std::chrono::system_clock::now() + std::chrono::milliseconds(ms)};
}

// BeginPut or BeginGet of the blocks' hashes.
template <typename Request, typename Blocks>
Request BeginRequest(uint64_t ns, const std::string& client, const Blocks& blocks) {
  Request req;
  req.set_namespace_id(ns);
  req.set_client_id(client);
  for (const auto& b : blocks) ToProto(b.hash, req.add_hashes());
  return req;
}

}  // namespace

struct StoreDataClient::Lane {
  std::unique_ptr<ucx::Worker> worker;
  std::unique_ptr<ucx::Endpoint> ep;
  std::unique_ptr<ucx::RemoteKey> rkey;
  std::vector<std::shared_ptr<ucx::MemoryRegion>> regions;  // snapshot of the client's
  absl::Status init_error;
  Clock::time_point next_attempt{};
  uint64_t backoff_ms = 0;
  std::string last_error;

  ucp_mem_h MemhFor(const void* p, size_t n) const {
    for (const auto& r : regions) {
      if (r->contains(p, n)) return r->memh();
    }
    return nullptr;
  }
  void Drop() {
    rkey.reset();
    ep.reset();
  }
};

StoreDataClient::StoreDataClient(const std::string& address, DataClientOptions options)
    : address_(address), options_(std::move(options)), control_(address, [&] {
        StoreClientOptions o;
        o.deadline_ms = options_.deadline_ms;
        o.security = options_.security;
        return o;
      }()) {
  auto ctx = ucx::Context::Create();
  if (!ctx.ok()) init_error_ = ctx.status();
  if (ctx.ok()) ucx_context_ = *ctx;
  for (int i = 0; i < std::max(1, options_.lanes); ++i) {
    auto lane = std::make_unique<Lane>();
    lane->backoff_ms = options_.backoff_min_ms;
    lane->init_error = init_error_;
    if (init_error_.ok()) {
      auto w = ucx::Worker::Create(*ctx, false);
      if (w.ok()) lane->worker = std::move(*w);
      else lane->init_error = w.status();
    }
    lanes_.push_back(std::move(lane));
  }
  for (auto& lane : lanes_) threads_.emplace_back([this, l = lane.get()] { Run(*l); });
}

StoreDataClient::~StoreDataClient() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  space_cv_.notify_all();
  for (auto& t : threads_) t.join();
  // UCX objects go in order: endpoints, keys, workers, registrations, context.
  for (auto& lane : lanes_) {
    lane->Drop();
    lane->regions.clear();
    lane->worker.reset();
  }
  regions_.clear();
}

void StoreDataClient::Submit(uint64_t bytes, Job job) {
  std::unique_lock lk(mu_);
  // Back-pressure: wait for room unless nothing is in flight (an operation
  // larger than the bound still runs, alone).
  space_cv_.wait(lk, [&] {
    return stop_ || inflight_bytes_ == 0 || inflight_bytes_ + bytes <= options_.max_inflight_bytes;
  });
  inflight_bytes_ += bytes;
  jobs_.emplace_back(bytes, std::move(job));
  cv_.notify_one();
}

void StoreDataClient::Run(Lane& lane) {
  for (;;) {
    std::pair<uint64_t, Job> job;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    {
      // Pick up memory registered since the last job.
      std::lock_guard lk(regions_mu_);
      if (lane.regions.size() != regions_.size()) {
        lane.regions.clear();
        for (const auto& r : regions_) {
          lane.regions.push_back(std::static_pointer_cast<ucx::MemoryRegion>(r));
        }
      }
    }
    job.second(lane);
    {
      std::lock_guard lk(mu_);
      inflight_bytes_ -= job.first;
    }
    space_cv_.notify_all();
  }
}

absl::Status StoreDataClient::RegisterMemory(void* addr, size_t length) {
  if (!init_error_.ok()) return init_error_;
  auto r = ucx::MemoryRegion::Map(std::static_pointer_cast<ucx::Context>(ucx_context_), addr, length);
  if (!r.ok()) return r.status();
  std::lock_guard lk(regions_mu_);
  regions_.push_back(std::shared_ptr<ucx::MemoryRegion>(std::move(*r)));
  return absl::OkStatus();
}

namespace {

std::string HostOf(const std::string& address) { return address.substr(0, address.rfind(':')); }

// The status with `prefix` in front of its message, once (a status that
// already names the operation keeps its message).
absl::Status Prefixed(const absl::Status& s, const std::string& prefix) {
  if (absl::StartsWith(s.message(), prefix)) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

bool StoreDataClient::UseSharedMemory() const {
  switch (options_.shared_memory) {
    case DataClientOptions::SharedMemory::kOn: return true;
    case DataClientOptions::SharedMemory::kOff: return false;
    case DataClientOptions::SharedMemory::kAuto: break;
  }
  std::string host = HostOf(address_);
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "[::1]" ||
         host == "::1";
}

absl::Status StoreDataClient::EnsureConnected(Lane& lane, std::chrono::system_clock::time_point rpc_deadline) {
  if (!lane.init_error.ok()) return lane.init_error;
  if (lane.ep && !lane.ep->failed()) return absl::OkStatus();
  lane.Drop();
  auto now = Clock::now();
  if (now < lane.next_attempt) {
    return absl::UnavailableError(absl::StrCat(
        "store ", address_, " data plane is down; next reconnect in ",
        std::chrono::duration_cast<std::chrono::milliseconds>(lane.next_attempt - now).count(),
        " ms (last error: ", lane.last_error, ")"));
  }
  auto fail = [&](const absl::Status& s) {
    lane.last_error = std::string(s.message());
    lane.next_attempt = Clock::now() + std::chrono::milliseconds(lane.backoff_ms);
    lane.backoff_ms = std::min(lane.backoff_ms * 2, options_.backoff_max_ms);
    return s;
  };
  v1::ConnectDataPlaneRequest req;
  req.set_client_id(options_.client_id);
  v1::ConnectDataPlaneResponse resp;
  auto ctx = control_.Context(rpc_deadline);
  if (auto s = control_.stub().ConnectDataPlane(ctx.get(), req, &resp); !s.ok()) {
    return fail(FromGrpc(s));
  }
  if (resp.regions_size() != 1 || resp.regions(0).rkey_id() != 0) {
    return fail(absl::InternalError("store data plane offers no region 0"));
  }
  std::string addr = resp.ucx_address();
  std::string host = HostOf(addr);
  if (host.empty() || host == "0.0.0.0" || host == "::") host = HostOf(address_);
  absl::StatusOr<std::unique_ptr<ucx::Endpoint>> ep;
  if (!options_.use_sockaddr && !resp.worker_address().empty()) {
    ep = ucx::Endpoint::ConnectToWorker(lane.worker.get(), resp.worker_address(),
                                        /*peer_failure_handling=*/!UseSharedMemory());
  } else {
    int port = 0;
    if (!absl::SimpleAtoi(addr.substr(addr.rfind(':') + 1), &port)) {
      return fail(absl::InternalError(
          absl::StrCat("store's UCX address \"", addr, "\" has no port")));
    }
    ep = ucx::Endpoint::Connect(lane.worker.get(), host, port);
  }
  if (!ep.ok()) return fail(ep.status());
  auto rkey = (*ep)->Unpack(resp.regions(0).packed_rkey());
  if (!rkey.ok()) return fail(rkey.status());
  lane.ep = std::move(*ep);
  lane.rkey = std::move(*rkey);
  lane.backoff_ms = options_.backoff_min_ms;
  return absl::OkStatus();
}

std::future<absl::StatusOr<PutOutcome>> StoreDataClient::Put(uint64_t ns, uint64_t block_bytes,
                                                             std::vector<PutBlock> blocks) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<PutOutcome>>>();
  auto future = promise->get_future();
  uint64_t bytes = blocks.size() * block_bytes;
  Submit(bytes, [this, ns, block_bytes, blocks = std::move(blocks), promise](Lane& lane) {
    const auto [deadline, rpc_deadline] = OperationDeadline(options_.deadline_ms);
    auto finish = [&](absl::StatusOr<PutOutcome> r) {
      if (!r.ok()) r = Prefixed(r.status(), absl::StrCat("put to store ", address_, ": "));
      promise->set_value(std::move(r));
    };
    if (blocks.empty()) return finish(PutOutcome{});
    if (auto s = EnsureConnected(lane, rpc_deadline); !s.ok()) return finish(s);
    auto req = BeginRequest<v1::BeginPutRequest>(ns, options_.client_id, blocks);
    v1::BeginPutResponse resp;
    {
      auto ctx = control_.Context(rpc_deadline);
      if (auto s = control_.stub().BeginPut(ctx.get(), req, &resp); !s.ok()) return finish(FromGrpc(s));
    }
    auto abort_lease = [&] {
      v1::AbortPutRequest abort;
      abort.set_lease_id(resp.lease_id());
      v1::AbortPutResponse ar;
      auto ctx = control_.Context(rpc_deadline);
      control_.stub().AbortPut(ctx.get(), abort, &ar);  // best effort: the lease expires anyway
    };
    // Check the whole answer before a byte is posted: nothing may be left in
    // flight from blocks the caller is told are done with.
    bool malformed = resp.targets_size() != static_cast<int>(blocks.size());
    for (const auto& t : resp.targets()) {
      malformed |= t.disposition() == v1::PUT_RESERVED && t.length() != block_bytes;
    }
    if (malformed) {
      abort_lease();
      return finish(absl::InternalError(absl::StrCat(
          "store answered BeginPut of ", blocks.size(), " blocks with ", resp.targets_size(),
          " targets or a slot that is not ", block_bytes, " bytes")));
    }
    PutOutcome out;
    std::vector<void*> reqs;
    std::vector<size_t> reserved;
    for (int i = 0; i < resp.targets_size(); ++i) {
      const auto& t = resp.targets(i);
      switch (t.disposition()) {
        case v1::PUT_RESERVED: {
          ucp_request_param_t p{};
          if (ucp_mem_h m = lane.MemhFor(blocks[i].data, block_bytes)) {
            p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
            p.memh = m;
          }
          reqs.push_back(ucp_put_nbx(lane.ep->get(), blocks[i].data, block_bytes,
                                     t.remote_addr(), lane.rkey->get(), &p));
          reserved.push_back(i);
          break;
        }
        case v1::PUT_ALREADY_PRESENT: out.already_present++; break;
        case v1::PUT_BUSY: out.busy++; break;
        default: out.no_space++; break;
      }
    }
    if (reserved.empty()) return finish(out);
    // Checksums while the bytes are on the wire.
    v1::CommitPutRequest commit;
    commit.set_lease_id(resp.lease_id());
    for (size_t i : reserved) commit.add_checksums(Checksum(blocks[i].data, block_bytes));
    ucp_request_param_t fp{};
    reqs.push_back(ucp_ep_flush_nbx(lane.ep->get(), &fp));
    absl::Status moved = lane.worker->WaitAll(reqs, deadline);
    if (moved.ok() && lane.ep->failed()) moved = absl::UnavailableError("the store's UCX endpoint failed");
    if (!moved.ok()) {
      lane.ep->MarkFailed();
      lane.Drop();
      abort_lease();
      return finish(moved);
    }
    v1::CommitPutResponse cr;
    auto ctx = control_.Context(rpc_deadline);
    if (auto s = control_.stub().CommitPut(ctx.get(), commit, &cr); !s.ok()) return finish(FromGrpc(s));
    out.written = cr.committed();
    finish(out);
  });
  return future;
}

std::future<absl::StatusOr<GetOutcome>> StoreDataClient::Get(uint64_t ns, uint64_t block_bytes,
                                                             std::vector<GetBlock> blocks) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<GetOutcome>>>();
  auto future = promise->get_future();
  uint64_t bytes = blocks.size() * block_bytes;
  Submit(bytes, [this, ns, block_bytes, blocks = std::move(blocks), promise](Lane& lane) {
    const auto [deadline, rpc_deadline] = OperationDeadline(options_.deadline_ms);
    auto finish = [&](absl::StatusOr<GetOutcome> r) {
      if (!r.ok()) r = Prefixed(r.status(), absl::StrCat("get from store ", address_, ": "));
      promise->set_value(std::move(r));
    };
    if (blocks.empty()) return finish(GetOutcome{});
    if (auto s = EnsureConnected(lane, rpc_deadline); !s.ok()) return finish(s);
    auto req = BeginRequest<v1::BeginGetRequest>(ns, options_.client_id, blocks);
    v1::BeginGetResponse resp;
    {
      auto ctx = control_.Context(rpc_deadline);
      if (auto s = control_.stub().BeginGet(ctx.get(), req, &resp); !s.ok()) return finish(FromGrpc(s));
    }
    GetOutcome out;
    if (resp.sources_size() == 0) return finish(out);
    std::vector<void*> reqs;
    absl::Status bad = absl::OkStatus();
    for (int i = 0; i < resp.sources_size(); ++i) {
      const auto& src = resp.sources(i);
      if (i >= static_cast<int>(blocks.size()) || src.length() != block_bytes) {
        bad = absl::InternalError("store returned more blocks than asked or one of the wrong size");
        break;
      }
      ucp_request_param_t p{};
      if (ucp_mem_h m = lane.MemhFor(blocks[i].dest, block_bytes)) {
        p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
        p.memh = m;
      }
      reqs.push_back(ucp_get_nbx(lane.ep->get(), blocks[i].dest, block_bytes, src.remote_addr(),
                                 lane.rkey->get(), &p));
    }
    absl::Status moved = lane.worker->WaitAll(reqs, deadline);
    if (moved.ok() && lane.ep->failed()) moved = absl::UnavailableError("the store's UCX endpoint failed");
    if (!moved.ok()) {
      lane.ep->MarkFailed();
      lane.Drop();
    }
    {
      v1::EndGetRequest end;
      end.set_lease_id(resp.lease_id());
      v1::EndGetResponse er;
      auto ctx = control_.Context(rpc_deadline);
      control_.stub().EndGet(ctx.get(), end, &er);  // best effort: the lease expires anyway
    }
    if (!bad.ok()) return finish(bad);
    if (!moved.ok()) {
      return finish(moved);
    }
    for (int i = 0; i < resp.sources_size(); ++i) {
      if (Checksum(blocks[i].dest, block_bytes) != resp.sources(i).checksum()) {
        return finish(absl::DataLossError(absl::StrCat(
            "block ", i, " from store ", address_, " failed its checksum; not used")));
      }
      out.blocks++;
      if (resp.sources(i).tier() == v1::TIER_DISK) out.from_disk++;
    }
    finish(out);
  });
  return future;
}

size_t RendezvousShard(const BlockKey& key, const std::vector<std::string>& shards) {
  uint64_t k[3] = {key.ns, key.hash.hi, key.hash.lo};
  size_t best = 0;
  uint64_t best_score = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    uint64_t seed = XXH3_64bits(shards[i].data(), shards[i].size());
    uint64_t score = XXH3_64bits_withSeed(k, sizeof(k), seed);
    if (i == 0 || score > best_score) {
      best = i;
      best_score = score;
    }
  }
  return best;
}

ShardedStoreClient::ShardedStoreClient(std::vector<std::string> addresses,
                                       DataClientOptions options)
    : addresses_(std::move(addresses)) {
  for (const auto& a : addresses_) shards_.push_back(std::make_unique<StoreDataClient>(a, options));
}

absl::Status ShardedStoreClient::RegisterMemory(void* addr, size_t length) {
  for (auto& s : shards_) {
    if (auto st = s->RegisterMemory(addr, length); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisteredNamespace> ShardedStoreClient::RegisterNamespace(const NamespaceSpec& spec) {
  absl::StatusOr<RegisteredNamespace> r = absl::InvalidArgumentError("no shards");
  for (auto& s : shards_) {
    r = s->control().RegisterNamespace(spec);
    if (!r.ok()) return r;
  }
  return r;
}

absl::StatusOr<uint32_t> ShardedStoreClient::Lookup(uint64_t ns, const std::vector<BlockHash>& chain) {
  std::vector<std::vector<size_t>> parts(shards_.size());
  for (size_t i = 0; i < chain.size(); ++i) parts[RendezvousShard({ns, chain[i]}, addresses_)].push_back(i);
  size_t prefix = chain.size();
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (parts[s].empty()) continue;
    std::vector<BlockHash> sub;
    for (size_t i : parts[s]) sub.push_back(chain[i]);
    auto tiers = shards_[s]->control().Lookup(ns, sub);
    if (!tiers.ok()) return tiers.status();
    if (tiers->size() < sub.size()) prefix = std::min(prefix, parts[s][tiers->size()]);
  }
  return static_cast<uint32_t>(prefix);
}

absl::StatusOr<PutOutcome> ShardedStoreClient::Put(uint64_t ns, uint64_t block_bytes,
                                                   const std::vector<PutBlock>& blocks) {
  std::vector<std::vector<PutBlock>> parts(shards_.size());
  for (const auto& b : blocks) parts[RendezvousShard({ns, b.hash}, addresses_)].push_back(b);
  std::vector<std::future<absl::StatusOr<PutOutcome>>> futures;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (!parts[s].empty()) futures.push_back(shards_[s]->Put(ns, block_bytes, std::move(parts[s])));
  }
  PutOutcome total;
  absl::Status first = absl::OkStatus();
  for (auto& f : futures) {
    auto r = f.get();
    if (!r.ok()) {
      if (first.ok()) first = r.status();
      continue;
    }
    total.written += r->written;
    total.already_present += r->already_present;
    total.busy += r->busy;
    total.no_space += r->no_space;
  }
  if (!first.ok()) return first;
  return total;
}

absl::StatusOr<GetOutcome> ShardedStoreClient::Get(uint64_t ns, uint64_t block_bytes,
                                                   const std::vector<GetBlock>& blocks) {
  std::vector<std::vector<size_t>> idx(shards_.size());
  std::vector<std::vector<GetBlock>> parts(shards_.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    size_t s = RendezvousShard({ns, blocks[i].hash}, addresses_);
    idx[s].push_back(i);
    parts[s].push_back(blocks[i]);
  }
  std::vector<std::pair<size_t, std::future<absl::StatusOr<GetOutcome>>>> futures;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (!parts[s].empty()) futures.emplace_back(s, shards_[s]->Get(ns, block_bytes, std::move(parts[s])));
  }
  size_t prefix = blocks.size();
  uint32_t from_disk = 0;
  absl::Status first = absl::OkStatus();
  for (auto& [s, f] : futures) {
    auto r = f.get();
    if (!r.ok()) {
      if (first.ok()) first = r.status();
      prefix = std::min(prefix, idx[s][0]);
      continue;
    }
    if (r->blocks < idx[s].size()) prefix = std::min(prefix, idx[s][r->blocks]);
    from_disk += r->from_disk;
  }
  if (!first.ok() && prefix == 0) return first;
  return GetOutcome{static_cast<uint32_t>(prefix), from_disk};
}

}  // namespace kvtier
