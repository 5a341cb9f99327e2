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
#include "common/checksum.h"
#include "common/elapsed.h"
#include "common/limits.h"
#include "common/rpc/grpc_status.h"
#include "common/ucx/calls.h"
#include "common/ucx/ucx.h"

namespace kvtier {

struct StoreDataClient::Deadline {
  std::chrono::steady_clock::time_point transfers;  // UCX waits
  std::chrono::system_clock::time_point rpcs;       // gRPC contexts
};

namespace {

// BeginPut of the blocks' hashes.
v1::BeginPutRequest BeginPutOf(uint64_t ns, const std::string& client,
                               const std::vector<PutBlock>& blocks) {
  v1::BeginPutRequest req;
  req.set_namespace_id(ns);
  req.set_client_id(client);
  for (const auto& b : blocks) ToProto(b.hash, req.add_hashes());
  return req;
}

// One control RPC that ends by the operation's deadline.
template <typename Request, typename Response>
absl::Status Call(StoreClient& control,
                  grpc::Status (v1::Store::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                       Response*),
                  const Request& request, Response* response,
                  std::chrono::system_clock::time_point deadline) {
  auto ctx = control.Context(deadline);
  return FromGrpc((control.stub().*rpc)(ctx.get(), request, response));
}

// Release ids per ReleaseGets (and per BeginGet's end_leases): the store's
// per-request limit.
constexpr size_t kMaxReleasesPerCall = limits::kMaxBlocksPerRequest;

// Pieces a copying transport copies and then sums while they are in cache.
constexpr uint64_t kHashPieceBytes = 16 << 10;

// Reads at least this large from a mapped arena sum on a second thread while
// the caller copies. Measured on this VM: copying from memory runs at 10-16
// GB/s and XXH3 at ~30, so in turn they run at ~2/3 of the copy's rate,
// side by side at its rate (a 64 MiB load: 7.1 ms, then 5.3). Smaller reads
// are mostly in cache, where the copy is as fast as the sum and reading the
// pieces from the other core's cache (and starting the thread) cost more
// than they save (a 4 MiB load: 0.23 ms in turn, 0.3-0.5 side by side).
constexpr uint64_t kSumAsideBytes = 8ull << 20;

// Reads copying through a mapped arena in this process right now. A read
// sums aside only while it is the only one: two reads copying at once
// already keep two cores busy, and a summing thread each only took turns
// with them (measured: 32-block gets on two lanes fell from memcpy's rate
// to 0.65-0.8 of it).
std::atomic<int> copying_reads{0};

// Cores this process may run on, read once (glibc reads sysfs for it).
const unsigned kCores = std::thread::hardware_concurrency();

// Sums, on a thread of its own, the pieces a copying read hands it, in the
// order handed (so each block's stream gets its bytes in order).
class SumAside {
 public:
  // REQUIRES: at most `max_pieces` pieces are handed.
  explicit SumAside(size_t max_pieces) : pieces_(max_pieces), thread_([this] { Run(); }) {}
  ~SumAside() { Finish(); }
  SumAside(const SumAside&) = delete;
  SumAside& operator=(const SumAside&) = delete;

  // Hands a copied piece over; `sum` must not be touched until Finish.
  void Add(ChecksumStream* sum, const uint8_t* data, size_t len) {
    const size_t k = added_.load(std::memory_order_relaxed);
    pieces_[k] = {sum, data, len};
    added_.store(k + 1, std::memory_order_release);
  }

  // Returns once every piece handed over is summed.
  void Finish() {
    if (!thread_.joinable()) return;
    finished_.store(true, std::memory_order_release);
    thread_.join();
  }

 private:
  struct Piece {
    ChecksumStream* sum;
    const uint8_t* data;
    size_t len;
  };
  void Run() {
    size_t done = 0;
    for (;;) {
      // Read `finished_` first: once it is set, `added_` is final.
      const bool last = finished_.load(std::memory_order_acquire);
      const size_t ready = added_.load(std::memory_order_acquire);
      for (; done < ready; ++done) pieces_[done].sum->Update(pieces_[done].data, pieces_[done].len);
      if (last) return;
      if (done == ready) std::this_thread::yield();  // ahead of the copy
    }
  }
  std::vector<Piece> pieces_;
  std::atomic<size_t> added_{0};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// Bytes of a read's segments kept in flight ahead of the one waited for.
constexpr uint64_t kReadWindowBytes = 4ull << 20;

// Reads through a mapped arena, shaped like a lane's DataPlaneConnection for
// ReadVia: a "post" is the copy itself, a wait only reports copies that fell
// outside the arena.
struct MappedReads {
  const ArenaMapping& arena;
  void* PostGet(void* dest, size_t length, uint64_t remote_addr, uint64_t /*lease*/) {
    const uint8_t* from = arena.At(remote_addr, length);
    if (from == nullptr) return UCS_STATUS_PTR(UCS_ERR_INVALID_ADDR);
    std::memcpy(dest, from, length);
    return nullptr;
  }
  absl::Status Wait(std::vector<void*>& requests, ucx::Clock::time_point) {
    absl::Status s = absl::OkStatus();
    for (void*& r : requests) {
      if (r != nullptr && s.ok()) {
        s = absl::InternalError("the store answered an address outside its arena");
      }
      r = nullptr;
    }
    return s;
  }
  bool CopiesAtPost() const { return true; }
  absl::Status EnsureInstance(uint64_t instance, std::chrono::system_clock::time_point) {
    if (instance == arena.instance()) return absl::OkStatus();
    return absl::UnavailableError("the store restarted since the pin; pin the blocks again");
  }
};

// The status with `prefix` in front of its message, once (a status that
// already names the operation keeps its message).
absl::Status Prefixed(const absl::Status& s, const std::string& prefix) {
  if (absl::StartsWith(s.message(), prefix)) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

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

template <typename Request, typename Response>
absl::Status StoreDataClient::ControlCall(
    uint16_t method,
    grpc::Status (v1::Store::Stub::*rpc)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, Response* response, std::chrono::system_clock::time_point deadline) {
  auto answer = CallOnDataPlane(method, request, deadline);
  if (!answer) return Call(control_, rpc, request, response, deadline);
  if (!answer->ok()) return answer->status();
  if (!response->ParseFromString(**answer)) {
    return absl::InternalError(absl::StrCat("store answered a data-plane call with no ",
                                            response->GetDescriptor()->name()));
  }
  return absl::OkStatus();
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
    MappedReads transport{*mapped};
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
    release_cv_.wait(lk, [&] { return release_stop_ || !pending_releases_.empty(); });
    if (pending_releases_.empty()) return;  // stopped with nothing left
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

absl::StatusOr<PutOutcome> StoreDataClient::PutOnLane(DataPlaneConnection& lane,
                                                      const Deadline& deadline, uint64_t ns,
                                                      uint64_t block_bytes,
                                                      const std::vector<PutBlock>& blocks) {
  PutOutcome out;
  auto start = std::chrono::steady_clock::now();
  auto req = BeginPutOf(ns, options_.client_id, blocks);
  v1::BeginPutResponse resp;
  if (auto s =
          ControlCall(ucx::kCallBeginPut, &v1::Store::Stub::BeginPut, req, &resp, deadline.rpcs);
      !s.ok()) {
    return s;
  }
  out.times.control_ms = MsSince(start);
  out.round_trips = 1;
  auto abort_lease = [&] {
    v1::AbortPutRequest abort;
    abort.set_lease_id(resp.lease_id());
    v1::AbortPutResponse ar;
    // Best effort: the lease expires anyway.
    Call(control_, &v1::Store::Stub::AbortPut, abort, &ar, deadline.rpcs).IgnoreError();
  };
  // Check the whole answer before a byte is posted: nothing may be left in
  // flight from blocks the caller is told are done with.
  bool malformed = resp.targets_size() != static_cast<int>(blocks.size());
  for (const auto& t : resp.targets()) {
    malformed |= t.disposition() == v1::PUT_RESERVED && t.length() != block_bytes;
  }
  if (malformed) {
    abort_lease();
    return absl::InternalError(absl::StrCat(
        "store answered BeginPut of ", blocks.size(), " blocks with ", resp.targets_size(),
        " targets or a slot that is not ", block_bytes, " bytes"));
  }
  // Addresses mean something only in the store instance that reserved them.
  if (auto s = lane.EnsureInstance(resp.instance_id(), deadline.rpcs); !s.ok()) {
    abort_lease();
    return s;
  }
  std::vector<void*> reqs;
  v1::CommitPutRequest commit;
  commit.set_lease_id(resp.lease_id());
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < resp.targets_size(); ++i) {
    const auto& t = resp.targets(i);
    switch (t.disposition()) {
      case v1::PUT_RESERVED:
        // Each block is summed just before it is posted: the transport then
        // reads it from cache (a post copies what the socket takes at once;
        // summing the whole batch afterwards read it from memory twice and
        // held up the sends, which need this thread).
        commit.add_checksums(Checksum(blocks[i].data, block_bytes));
        reqs.push_back(lane.PostPut(blocks[i].data, block_bytes, t.remote_addr(), resp.lease_id()));
        break;
      case v1::PUT_ALREADY_PRESENT:
        out.already_present++;
        break;
      case v1::PUT_BUSY:
        out.busy++;
        break;
      default:
        out.no_space++;
        break;
    }
  }
  if (reqs.empty()) return out;
  out.round_trips = 2;  // BeginPut's, then the bytes' with the commit behind them
  out.bytes_sent = uint64_t{reqs.size()} * block_bytes;
  v1::CommitPutResponse cr;
  if (lane.CallsFollowTransfers()) {
    // The commit follows the bytes on the same connection and is served
    // after them: no flush, no round trip of its own.
    auto answer = lane.Call(ucx::kCallCommitPut, commit.SerializeAsString(), deadline.transfers);
    // The puts' own errors first (a refused put fails the commit too).
    absl::Status moved = lane.Wait(reqs, deadline.transfers);
    if (moved.ok() && !answer.ok()) moved = answer.status();
    if (!moved.ok()) {
      abort_lease();
      return moved;
    }
    if (!cr.ParseFromString(*answer)) {
      return absl::InternalError("store answered a data-plane CommitPut with no CommitPutResponse");
    }
    out.times.rma_ms = MsSince(start);
    out.written = cr.committed();
    return out;
  }
  ++out.round_trips;  // the flush's, then CommitPut's own
  reqs.push_back(lane.PostFlush());
  if (absl::Status moved = lane.Wait(reqs, deadline.transfers); !moved.ok()) {
    abort_lease();
    return moved;
  }
  out.times.rma_ms = MsSince(start);
  start = std::chrono::steady_clock::now();
  if (auto s = Call(control_, &v1::Store::Stub::CommitPut, commit, &cr, deadline.rpcs); !s.ok()) {
    return s;
  }
  out.written = cr.committed();
  out.times.control_ms += MsSince(start);
  return out;
}

template <typename Transport>
absl::StatusOr<GetOutcome> StoreDataClient::ReadVia(Transport& lane, const Deadline& deadline,
                                                    const PinnedBlocks& pinned,
                                                    uint64_t block_bytes, size_t first,
                                                    size_t count, const ReadPlan& plan) {
  GetOutcome out;
  if (count == 0) return out;
  // Addresses mean something only in the store instance that pinned them.
  if (auto s = lane.EnsureInstance(pinned.instance, deadline.rpcs); !s.ok()) return s;
  if (std::chrono::steady_clock::now() >= pinned.expires) {
    return absl::FailedPreconditionError(
        absl::StrCat("lease ", pinned.lease, " expired before the read; pin the blocks again"));
  }
  const std::vector<uint64_t> whole = {0, block_bytes};
  const std::vector<uint64_t>& bounds = plan.bounds.empty() ? whole : plan.bounds;
  const size_t segments = bounds.size() - 1;
  // Segments are posted in order (a layer-wise load gets layer 0 of every
  // block first). The first goes alone, so it lands as early as it can even
  // on a transport that moves bytes as they are posted (CMA); after it, a
  // window of segments is in flight: enough bytes to keep the transport busy.
  const auto rma_start = std::chrono::steady_clock::now();
  std::vector<std::vector<void*>> reqs(segments);
  std::vector<void*> dests(count * segments);
  uint64_t window_bytes = 0;
  size_t posted = 0;  // segments posted so far
  // Each segment is summed as it lands, while the later ones are in flight;
  // a transport that copies as it posts (the mapped arena) has each piece
  // summed right after it is copied, while its bytes are in cache.
  const bool copies_at_post = lane.CopiesAtPost();
  std::vector<ChecksumStream> sums(count);
  double sum_ms = 0;
  std::optional<SumAside> aside;
  if (copies_at_post) copying_reads.fetch_add(1, std::memory_order_relaxed);
  struct Uncount {
    bool counted;
    ~Uncount() {
      if (counted) copying_reads.fetch_sub(1, std::memory_order_relaxed);
    }
  } uncount{copies_at_post};
  if (copies_at_post && count * block_bytes >= kSumAsideBytes &&
      copying_reads.load(std::memory_order_relaxed) == 1 && kCores > 1) {
    size_t pieces = 0;
    for (size_t s = 0; s < segments; ++s) {
      pieces += count * ((bounds[s + 1] - bounds[s] + kHashPieceBytes - 1) / kHashPieceBytes);
    }
    try {
      aside.emplace(pieces);
    } catch (const std::system_error&) {  // no thread to be had: sum in turn
      aside.reset();
    }
  }
  auto post = [&](size_t s) {
    const uint64_t len = bounds[s + 1] - bounds[s];
    reqs[s].reserve(count);
    for (size_t i = 0; i < count; ++i) {
      auto* d = static_cast<uint8_t*>(plan.dest(first + i, s));
      dests[i * segments + s] = d;
      const uint64_t from = pinned.sources[first + i].remote_addr + bounds[s];
      if (!copies_at_post) {
        reqs[s].push_back(lane.PostGet(d, len, from, pinned.lease));
        continue;
      }
      for (uint64_t off = 0; off < len; off += kHashPieceBytes) {
        const uint64_t n = std::min(kHashPieceBytes, len - off);
        reqs[s].push_back(lane.PostGet(d + off, n, from + off, pinned.lease));
        if (reqs[s].back() != nullptr) continue;  // not copied (outside the arena)
        if (aside) {
          aside->Add(&sums[i], d + off, n);
        } else {
          sums[i].Update(d + off, n);  // copied: sum it now
        }
      }
    }
    window_bytes += len * count;
  };
  auto fill_window = [&](size_t waiting) {
    while (posted < segments &&
           (posted <= waiting ||
            (waiting > 0 && (posted <= waiting + 1 || window_bytes < kReadWindowBytes)))) {
      post(posted++);
    }
  };
  absl::Status moved = absl::OkStatus();
  for (size_t s = 0; s < segments; ++s) {
    if (moved.ok()) fill_window(s);
    if (s >= posted) break;  // failed: nothing later was posted
    // After a failure the endpoint is closed: what was posted completes
    // (with errors) at once, and nothing may still write into the caller's
    // memory.
    const uint64_t len = bounds[s + 1] - bounds[s];
    if (copies_at_post) {  // summed as copied (the time is in rma_ms)
      absl::Status st = lane.Wait(reqs[s], deadline.transfers);
      if (moved.ok()) moved = st;
    } else {
      // Block by block, each summed as soon as it lands, while its bytes
      // are still in cache and the later blocks keep arriving (the kernel
      // buffers them meanwhile). Summing a whole batch after it landed read
      // it back from memory and stalled the transfer for as long.
      std::vector<void*> one(1);
      for (size_t i = 0; i < count; ++i) {
        one[0] = reqs[s][i];
        absl::Status st = lane.Wait(one, deadline.transfers);
        reqs[s][i] = nullptr;
        if (moved.ok()) moved = st;
        if (!moved.ok()) continue;
        const auto sum_start = std::chrono::steady_clock::now();
        sums[i].Update(dests[i * segments + s], len);
        sum_ms += MsSince(sum_start);
      }
    }
    window_bytes -= len * count;
    if (!moved.ok()) continue;
    if (plan.on_segment) plan.on_segment(s);
  }
  if (aside) aside->Finish();  // summed beside the copy (the time is in rma_ms)
  out.times.rma_ms = MsSince(rma_start) - sum_ms;
  out.times.checksum_ms = sum_ms;
  if (!moved.ok()) return moved;
  for (size_t i = 0; i < count; ++i) {
    if (sums[i].Digest() != pinned.sources[first + i].checksum) {
      return absl::DataLossError(absl::StrCat("block ", first + i, " from store ", address_,
                                              " failed its checksum; not used"));
    }
    out.blocks++;
    if (pinned.sources[first + i].from_disk) out.from_disk++;
  }
  return out;
}

}  // namespace kvtier
