// StoreDataClient (store_data_client.h, which states its guarantees): its
// lanes and registered memory, and the put/get protocol over one store.
// Connecting and every UCX call are DataPlaneConnection's; queueing and
// back-pressure are TransferLanes'.
#include "client/store_data_client.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/arena_mapping.h"
#include "client/data_plane_connection.h"
#include "client/store_data_detail.h"
#include "common/checksum.h"
#include "common/elapsed.h"
#include "common/limits.h"
#include "common/rpc/grpc_status.h"
#include "common/ucx/calls.h"
#include "common/ucx/ucx.h"

namespace kvtier {

namespace {

// Release ids per ReleaseGets (and per BeginGet's end_leases): the store's
// per-request limit.
constexpr size_t kMaxReleasesPerCall = limits::kMaxBlocksPerRequest;

}  // namespace

StoreDataClient::StoreDataClient(const std::string& address, DataClientOptions options)
    : address_(address),
      options_(std::move(options)),
      control_(address,
               [&] {
                 StoreClientOptions o;
                 o.deadline_ms = options_.deadline_ms;
                 o.security = options_.security;
                 o.tenant_token = options_.tenant_token;
                 return o;
               }()),
      transfers_(static_cast<size_t>(std::max(1, options_.lanes)),
                 static_cast<size_t>(std::max(0, options_.load_lanes)),
                 options_.max_inflight_bytes) {
  auto ctx = ucx::Context::Create();
  if (ctx.ok()) {
    ucx_context_ = *ctx;
  } else {
    init_error_ = ctx.status();
  }
  for (size_t i = 0; i < transfers_.lanes(); ++i) {
    auto worker = init_error_.ok() ? ucx::Worker::Create(ucx_context_, /*wakeup=*/false)
                                   : absl::StatusOr<std::unique_ptr<ucx::Worker>>(init_error_);
    lanes_.push_back(
        std::make_unique<DataPlaneConnection>(std::move(worker), address_, options_, control_));
  }
  for (int i = 0; i < std::max(1, options_.call_lanes); ++i) {
    auto worker = init_error_.ok() ? ucx::Worker::Create(ucx_context_, /*wakeup=*/true)
                                   : absl::StatusOr<std::unique_ptr<ucx::Worker>>(init_error_);
    auto lane = std::make_unique<CallLane>();
    lane->conn = std::make_unique<DataPlaneConnection>(std::move(worker), address_, options_,
                                                       control_, /*map_arena=*/false);
    call_lanes_.push_back(std::move(lane));
  }
  releaser_ = std::thread([this] { ReleaseLoop(); });
}

StoreDataClient::~StoreDataClient() {
  transfers_.Stop();  // runs what is queued; after it no thread touches lanes_
  {
    std::lock_guard lk(release_mu_);
    release_stop_ = true;  // the releaser sends what is pending, then ends
  }
  release_cv_.notify_all();
  if (releaser_.joinable()) releaser_.join();
  // UCX objects go in order: endpoints, keys, workers, registrations, context.
  lanes_.clear();
  call_lanes_.clear();
  regions_.clear();
}

std::optional<absl::StatusOr<std::string>> StoreDataClient::CallOnDataPlane(
    uint16_t method, const google::protobuf::Message& request,
    std::chrono::system_clock::time_point deadline) {
  if (!options_.data_plane_calls) return std::nullopt;
  // The first free lane (so one caller at a time keeps to one connection and
  // more are made only for calls at once), else one in turn as it frees up.
  std::unique_lock<std::timed_mutex> lk;
  CallLane* call = nullptr;
  for (size_t i = 0; i < call_lanes_.size() && call == nullptr; ++i) {
    CallLane* c = call_lanes_[i].get();
    lk = std::unique_lock(c->mu, std::try_to_lock);
    if (lk.owns_lock()) call = c;
  }
  if (call == nullptr) {
    const size_t next = next_call_lane_.fetch_add(1, std::memory_order_relaxed);
    call = call_lanes_[next % call_lanes_.size()].get();
    lk = std::unique_lock(call->mu, std::defer_lock);
    if (!lk.try_lock_until(deadline)) return std::nullopt;
  }
  DataPlaneConnection& lane = *call->conn;
  if (!lane.EnsureConnected(deadline).ok() || !lane.TakesCalls()) return std::nullopt;
  const auto transfers = std::chrono::steady_clock::now() +
                         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             deadline - std::chrono::system_clock::now());
  auto r = lane.Call(method, request.SerializeAsString(), transfers);
  if (!r.ok() && r.status().code() == absl::StatusCode::kUnauthenticated) {
    lane.Reset();  // the store dropped the session: a new connection gets a new one
    return std::nullopt;
  }
  // The call did not travel (the lane dropped its endpoint): gRPC instead.
  if (!r.ok() && !lane.TakesCalls()) return std::nullopt;
  return r;
}

absl::Status StoreDataClient::RegisterMemory(void* addr, size_t length) {
  if (!init_error_.ok()) return init_error_;
  auto r = ucx::MemoryRegion::Map(ucx_context_, addr, length);
  if (!r.ok()) return r.status();
  std::lock_guard lk(regions_mu_);
  regions_.push_back(std::shared_ptr<ucx::MemoryRegion>(std::move(*r)));
  return absl::OkStatus();
}

template <typename Outcome>
std::future<absl::StatusOr<Outcome>> StoreDataClient::Start(TransferLanes::Class c, size_t count,
                                                            uint64_t block_bytes,
                                                            std::string error_prefix,
                                                            Operation<Outcome> op) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<Outcome>>>();
  auto future = promise->get_future();
  const auto submitted = std::chrono::steady_clock::now();
  transfers_.Submit(
      c, count * block_bytes,
      [this, count, submitted, error_prefix = std::move(error_prefix), op = std::move(op),
       promise](size_t i) {
        const double queued = MsSince(submitted);
        DataPlaneConnection& lane = *lanes_[i];
        {
          // Pick up memory registered since the last job.
          std::lock_guard lk(regions_mu_);
          lane.UseRegions(regions_);
        }
        // One deadline for the whole operation (connect, RPCs, transfers).
        const auto budget = std::chrono::milliseconds(options_.deadline_ms);
        const Deadline deadline{std::chrono::steady_clock::now() + budget,
                                std::chrono::system_clock::now() + budget};
        absl::StatusOr<Outcome> r = Outcome{};
        if (count > 0) {
          if (absl::Status s = lane.EnsureConnected(deadline.rpcs); s.ok()) {
            {
              // The lane's view of the store: its mapping, or none (a store that
              // restarted without offering one must not keep the old one alive).
              std::lock_guard lk(mapping_mu_);
              if (mapping_ != lane.mapping()) mapping_ = lane.mapping();
              lane_connected_ = true;
            }
            r = op(lane, deadline);
          } else {
            r = s;
          }
        }
        if (r.ok()) {
          r->times.queue_ms += queued;
        } else {
          // A store that is down, or bytes that failed their checksum (a store
          // restarted under a mapped arena, a corrupt path): connect afresh.
          const auto code = r.status().code();
          if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDataLoss) {
            lane.Reset();
          }
          r = Prefixed(r.status(), error_prefix);
        }
        promise->set_value(std::move(r));
      });
  return future;
}

std::future<absl::StatusOr<PutOutcome>> StoreDataClient::Put(uint64_t ns, uint64_t block_bytes,
                                                             std::vector<PutBlock> blocks) {
  const size_t n = blocks.size();  // before the move below: argument order is unspecified
  return Start<PutOutcome>(TransferLanes::Class::kOffload, n, block_bytes,
                           absl::StrCat("put to store ", address_, ": "),
                           [this, ns, block_bytes, blocks = std::move(blocks)](
                               DataPlaneConnection& lane, const Deadline& deadline) {
                             return PutOnLane(lane, deadline, ns, block_bytes, blocks);
                           });
}

std::future<absl::StatusOr<GetOutcome>> StoreDataClient::Get(uint64_t ns, uint64_t block_bytes,
                                                             std::vector<GetBlock> blocks) {
  const size_t n = blocks.size();  // before the move below: argument order is unspecified
  return Start<GetOutcome>(
      TransferLanes::Class::kLoad, n, block_bytes, absl::StrCat("get from store ", address_, ": "),
      [this, ns, block_bytes, blocks = std::move(blocks)](
          DataPlaneConnection& lane, const Deadline& deadline) -> absl::StatusOr<GetOutcome> {
        std::vector<BlockHash> chain;
        chain.reserve(blocks.size());
        for (const auto& b : blocks) chain.push_back(b.hash);
        auto pinned = PinBy(deadline.rpcs, ns, block_bytes, chain);
        if (!pinned.ok()) return pinned.status();
        ReadPlan plan;
        plan.dest = [&blocks](size_t i, size_t) { return blocks[i].dest; };
        auto r = ReadVia(lane, deadline, *pinned, block_bytes, 0, pinned->sources.size(), plan);
        Release(pinned->lease);  // after the transfers, whatever their outcome
        if (r.ok()) r->times.control_ms += pinned->control_ms;
        return r;
      });
}

absl::StatusOr<PinnedBlocks> StoreDataClient::Pin(uint64_t ns, uint64_t block_bytes,
                                                  const std::vector<BlockHash>& chain,
                                                  std::optional<std::chrono::milliseconds> budget) {
  auto wait = std::chrono::milliseconds(options_.deadline_ms);
  if (budget) wait = std::min(wait, std::max(*budget, std::chrono::milliseconds(1)));
  auto r = PinBy(std::chrono::system_clock::now() + wait, ns, block_bytes, chain);
  if (!r.ok()) return Prefixed(r.status(), absl::StrCat("pin in store ", address_, ": "));
  return r;
}

absl::StatusOr<PinnedBlocks> StoreDataClient::PinBy(std::chrono::system_clock::time_point deadline,
                                                    uint64_t ns, uint64_t block_bytes,
                                                    const std::vector<BlockHash>& chain) {
  const auto start = std::chrono::steady_clock::now();
  v1::BeginGetRequest req;
  req.set_namespace_id(ns);
  req.set_client_id(options_.client_id);
  for (const auto& h : chain) ToProto(h, req.add_hashes());
  std::vector<uint64_t> releases;
  {
    // The releases queued so far travel with this pin.
    std::lock_guard lk(release_mu_);
    const size_t take = std::min<size_t>(pending_releases_.size(), kMaxReleasesPerCall);
    releases.assign(pending_releases_.end() - take, pending_releases_.end());
    pending_releases_.resize(pending_releases_.size() - take);
  }
  for (uint64_t id : releases) req.add_end_leases(id);
  v1::BeginGetResponse resp;
  if (auto s = ControlCall(ucx::kCallBeginGet, &v1::Store::Stub::BeginGet, req, &resp, deadline);
      !s.ok()) {
    if (!releases.empty()) {
      // Not delivered: the releaser tries them again (their expiry is the backstop).
      std::lock_guard lk(release_mu_);
      pending_releases_.insert(pending_releases_.end(), releases.begin(), releases.end());
      release_cv_.notify_all();
    }
    return s;
  }
  PinnedBlocks out;
  out.lease = resp.lease_id();
  out.instance = resp.instance_id();
  out.expires = start + std::chrono::milliseconds(resp.lease_ms());
  bool malformed = resp.sources_size() > static_cast<int>(chain.size());
  for (const auto& src : resp.sources()) {
    malformed |= src.length() != block_bytes;
    out.sources.push_back({src.remote_addr(), src.checksum(), src.tier() == v1::TIER_DISK});
  }
  if (malformed) {
    Release(out.lease);
    return absl::InternalError(absl::StrCat("store answered BeginGet of ", chain.size(),
                                            " blocks with ", resp.sources_size(),
                                            " sources or one that is not ", block_bytes, " bytes"));
  }
  out.control_ms = MsSince(start);
  return out;
}

std::future<absl::StatusOr<GetOutcome>> StoreDataClient::Read(const PinnedBlocks& pinned,
                                                              uint64_t block_bytes, size_t first,
                                                              size_t count, ReadPlan plan) {
  absl::Status bad = absl::OkStatus();
  if (first > pinned.sources.size() || count > pinned.sources.size() - first) {
    bad = absl::InvalidArgumentError(absl::StrCat("read of blocks [", first, ", ", first + count,
                                                  "); ", pinned.sources.size(), " are pinned"));
  } else if (!plan.dest) {
    bad = absl::InvalidArgumentError("read plan has no destination");
  } else if (!plan.bounds.empty()) {
    bool tiles =
        plan.bounds.size() >= 2 && plan.bounds.front() == 0 && plan.bounds.back() == block_bytes;
    for (size_t i = 1; tiles && i < plan.bounds.size(); ++i) {
      tiles = plan.bounds[i] > plan.bounds[i - 1];
    }
    if (!tiles) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("read plan's segments do not tile the block's ", block_bytes,
                       " bytes (they must rise strictly from 0 to the block size)"));
    }
  }
  if (!bad.ok()) {
    std::promise<absl::StatusOr<GetOutcome>> p;
    p.set_value(Prefixed(bad, absl::StrCat("get from store ", address_, ": ")));
    return p.get_future();
  }
  std::shared_ptr<ArenaMapping> mapped;
  {
    std::lock_guard lk(mapping_mu_);
    mapped = mapping_;
  }
  if (mapped && pinned.instance != 0 && mapped->instance() == pinned.instance) {
    // The pin's store is mapped here: copy on this thread, no hand-off.
    const auto budget = std::chrono::milliseconds(options_.deadline_ms);
    const Deadline deadline{std::chrono::steady_clock::now() + budget,
                            std::chrono::system_clock::now() + budget};
    store_data_detail::MappedReads transport{*mapped};
    auto r = ReadVia(transport, deadline, pinned, block_bytes, first, count, plan);
    if (!r.ok()) r = Prefixed(r.status(), absl::StrCat("get from store ", address_, ": "));
    std::promise<absl::StatusOr<GetOutcome>> p;
    p.set_value(std::move(r));
    return p.get_future();
  }
  return Start<GetOutcome>(TransferLanes::Class::kLoad, count, block_bytes,
                           absl::StrCat("get from store ", address_, ": "),
                           [this, block_bytes, first, count, pinned, plan = std::move(plan)](
                               DataPlaneConnection& lane, const Deadline& deadline) {
                             return ReadVia(lane, deadline, pinned, block_bytes, first, count,
                                            plan);
                           });
}

absl::StatusOr<BlockViews> StoreDataClient::View(const PinnedBlocks& pinned, uint64_t block_bytes,
                                                 size_t first, size_t count) {
  const std::string prefix = absl::StrCat("view of store ", address_, ": ");
  if (first > pinned.sources.size() || count > pinned.sources.size() - first) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "blocks [", first, ", ", first + count,
                                                   ") of ", pinned.sources.size(), " pinned"));
  }
  auto known = KnownMapping(/*probe=*/true);
  if (!known.ok()) return Prefixed(known.status(), prefix);
  std::shared_ptr<ArenaMapping> mapped = std::move(*known);
  if (!mapped || pinned.instance == 0 || mapped->instance() != pinned.instance) {
    return absl::FailedPreconditionError(
        absl::StrCat(prefix, "its arena is not mapped in this process; read the blocks instead"));
  }
  if (std::chrono::steady_clock::now() >= pinned.expires) {
    return absl::FailedPreconditionError(absl::StrCat(
        prefix, "lease ", pinned.lease, " expired before the view; pin the blocks again"));
  }
  BlockViews out;
  out.blocks.reserve(count);
  out.checksums.reserve(count);
  for (size_t i = first; i < first + count; ++i) {
    const uint8_t* at = mapped->At(pinned.sources[i].remote_addr, block_bytes);
    if (at == nullptr) {
      return absl::InternalError(
          absl::StrCat(prefix, "the store placed block ", i, " outside its arena"));
    }
    out.blocks.push_back(at);
    out.checksums.push_back(pinned.sources[i].checksum);
    if (pinned.sources[i].from_disk) out.from_disk++;
  }
  out.regions.push_back(BlockViews::Region{mapped->local(), mapped->length(), mapped});
  return out;
}

absl::StatusOr<std::shared_ptr<ArenaMapping>> StoreDataClient::KnownMapping(bool probe) {
  {
    std::lock_guard lk(mapping_mu_);
    if (!probe || lane_connected_ ||
        options_.shared_memory == DataClientOptions::SharedMemory::kOff) {
      return mapping_;
    }
  }
  // No lane has connected yet, so whether the store is mapped here is not
  // known: connect one (what a transfer would do first), which maps it.
  auto connected = Warm().get();
  if (!connected.ok()) return connected.status();
  std::lock_guard lk(mapping_mu_);
  return mapping_;
}

std::future<absl::StatusOr<GetOutcome>> StoreDataClient::Warm() {
  return Start<GetOutcome>(TransferLanes::Class::kLoad, 1, 0,
                           absl::StrCat("connect to store ", address_, ": "),
                           [](DataPlaneConnection&, const Deadline&) {
                             return absl::StatusOr<GetOutcome>(GetOutcome{});
                           });
}

void StoreDataClient::Release(uint64_t lease) {
  if (lease == 0) return;
  {
    std::lock_guard lk(release_mu_);
    pending_releases_.push_back(lease);
  }
  release_cv_.notify_all();
}

void StoreDataClient::ReleaseLoop() {
  std::unique_lock lk(release_mu_);
  for (;;) {
    release_cv_.wait(lk, [&] {
      return release_stop_ || !pending_releases_.empty() || !pending_abandons_.empty();
    });
    if (pending_releases_.empty() && pending_abandons_.empty()) return;  // stopped, nothing left
    if (!pending_abandons_.empty()) {
      std::vector<uint64_t> tokens = std::move(pending_abandons_);
      pending_abandons_.clear();
      const int budget_ms =
          release_stop_ ? std::min(options_.deadline_ms, 1000) : options_.deadline_ms;
      lk.unlock();
      for (uint64_t token : tokens) {
        v1::AbortPutRequest req;
        req.set_begin_token(token);
        v1::AbortPutResponse resp;
        // Best effort: the lease expires anyway.
        store_data_detail::Call(
            control_, &v1::Store::Stub::AbortPut, req, &resp,
            std::chrono::system_clock::now() + std::chrono::milliseconds(budget_ms))
            .IgnoreError();
      }
      lk.lock();
      continue;
    }
    // Give the next Pin a chance to carry them.
    release_cv_.wait_for(lk, std::chrono::milliseconds(options_.release_delay_ms),
                         [&] { return release_stop_ || pending_releases_.empty(); });
    if (pending_releases_.empty()) continue;
    std::vector<uint64_t> ids = std::move(pending_releases_);
    pending_releases_.clear();
    const bool stopping = release_stop_;
    lk.unlock();
    // Best effort: an undelivered release ends at the lease's expiry.
    const int budget_ms = stopping ? std::min(options_.deadline_ms, 1000) : options_.deadline_ms;
    for (size_t at = 0; at < ids.size(); at += kMaxReleasesPerCall) {
      v1::ReleaseGetsRequest req;
      for (size_t i = at; i < std::min(ids.size(), at + kMaxReleasesPerCall); ++i) {
        req.add_lease_ids(ids[i]);
      }
      v1::ReleaseGetsResponse resp;
      ControlCall(ucx::kCallReleaseGets, &v1::Store::Stub::ReleaseGets, req, &resp,
                  std::chrono::system_clock::now() + std::chrono::milliseconds(budget_ms))
          .IgnoreError();
    }
    lk.lock();
  }
}

}  // namespace kvtier
