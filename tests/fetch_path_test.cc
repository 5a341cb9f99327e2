// The fetch path (docs/dataplane.md, "Loads"): a load is one pin round trip,
// a read cut into segments (layers) whose progress is reported in order, and
// a release that never blocks; loads go before offloads; int8 namespaces;
// and the bad inputs of each new call, which change nothing stored. Against
// a real kvtier-store, over UCX (TCP) and through the mapped arena.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <set>
#include <thread>

#include "client/store_data_client.h"
#include "client/transfer_lanes.h"
#include "common/data_wire.h"
#include "common/socket_io.h"
#include "common/thread_cache.h"
#include "common/ucx/calls.h"
#include "common/ucx/ucx.h"
#include "tests/raw_hello.h"
#include "tests/test_util.h"
#include "tests/transports.h"
#include "worker/connector.h"
#include "worker/model.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

TEST(TransferLanes, ALoadRunsWhileOffloadsHoldEverySharedLane) {
  TransferLanes lanes(/*shared_lanes=*/1, /*load_lanes=*/1, 1 << 20);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> offloads_done{0};
  std::promise<void> started;
  for (int i = 0; i < 3; ++i) {
    lanes.Submit(TransferLanes::Class::kOffload, 1000, [&, i, released](size_t) {
      if (i == 0) started.set_value();
      released.wait();
      offloads_done++;
    });
  }
  started.get_future().wait();  // the shared lane is busy with an offload
  std::promise<size_t> ran_on;
  lanes.Submit(TransferLanes::Class::kLoad, 1000, [&](size_t lane) { ran_on.set_value(lane); });
  auto f = ran_on.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "the load waited for offloads";
  EXPECT_EQ(f.get(), 1u) << "the load-only lane ran it";
  EXPECT_EQ(offloads_done.load(), 0);
  release.set_value();
  lanes.Stop();
  EXPECT_EQ(offloads_done.load(), 3) << "offloads queued before Stop still ran";
}

TEST(TransferLanes, QueuedLoadsGoBeforeQueuedOffloads) {
  TransferLanes lanes(/*shared_lanes=*/1, /*load_lanes=*/0, 1 << 20);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::mutex mu;
  std::vector<std::string> order;
  auto note = [&](std::string what) {
    std::lock_guard lk(mu);
    order.push_back(std::move(what));
  };
  std::promise<void> started;
  lanes.Submit(TransferLanes::Class::kOffload, 1, [&, released](size_t) {
    started.set_value();
    released.wait();
    note("offload-1");
  });
  started.get_future().wait();  // the only lane is busy: the next two queue
  lanes.Submit(TransferLanes::Class::kOffload, 1, [&](size_t) { note("offload-2"); });
  lanes.Submit(TransferLanes::Class::kLoad, 1, [&](size_t) { note("load"); });
  release.set_value();
  lanes.Stop();
  EXPECT_EQ(order, (std::vector<std::string>{"offload-1", "load", "offload-2"}));
}

TEST(TransferLanes, OffloadBytesNeverHoldALoadsSubmit) {
  // The offload class is full (one job at the bound, blocked): a load's
  // Submit still returns at once, since each class has its own bound.
  TransferLanes lanes(1, 1, 100);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  lanes.Submit(TransferLanes::Class::kOffload, 100, [released](size_t) { released.wait(); });
  auto submitted = std::async(
      std::launch::async, [&] { lanes.Submit(TransferLanes::Class::kLoad, 100, [](size_t) {}); });
  EXPECT_EQ(submitted.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  release.set_value();
}

TEST(ThreadCache, ReusesAThreadForTasksInSequenceAndRunsConcurrentOnesAtOnce) {
  ThreadCache cache;
  // A task's thread goes back to the cache just after its result is
  // delivered: once it waits there, the next task is its, so ten tasks in
  // sequence run on one thread (a thread per task would be ten).
  std::set<std::thread::id> ids;
  for (int i = 0; i < 10; ++i) {
    ids.insert(cache.Run([] { return std::this_thread::get_id(); }).get());
    ASSERT_TRUE(testing::WaitFor([&] { return cache.idle() == 1; })) << cache.idle();
  }
  EXPECT_EQ(ids.size(), 1u) << "the cached thread took the tasks in sequence";
  EXPECT_FALSE(ids.contains(std::this_thread::get_id()));
  // Two tasks that wait for each other finish only if both run at once.
  std::promise<void> a, b;
  auto fa = cache.Run([&] {
    a.set_value();
    b.get_future().wait();
    return 1;
  });
  auto fb = cache.Run([&] {
    a.get_future().wait();
    b.set_value();
    return 2;
  });
  ASSERT_EQ(fa.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(fa.get() + fb.get(), 3);
}

// 4 segments of 64 KiB: 2 (K, V) x 4 layers x 1 head x 64 dim x 2 bytes x 64 tokens.
NamespaceSpec Spec4L() {
  return NamespaceSpec{"fetch-test", "fp16", 4, 1, 64, 64, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 64 << 10;
constexpr uint64_t kLayer = kBlock / 4;

// "socket": the socket data plane; "ucx": UCX RMA over TCP (--data-plane
// ucx); "mapped": the store's arena mapped (memcpy).
class FetchPath : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    store_ = testing::StartLoopbackStore(dir_.sub("store"), testing::StoreFlagsFor(GetParam()));
    ASSERT_GT(store_->port(), 0) << store_->Log();
  }
  DataClientOptions Options() const { return testing::ClientOptionsFor(GetParam()); }
  // Stores n blocks of the namespace and returns their bytes.
  std::vector<uint8_t> PutBlocks(StoreDataClient& c, uint64_t ns, uint64_t n) {
    std::vector<uint8_t> src(n * kBlock);
    for (uint64_t i = 0; i < n; ++i) {
      std::string b = testing::BlockBytesFor(i + 1, kBlock);
      std::memcpy(src.data() + i * kBlock, b.data(), kBlock);
    }
    std::vector<PutBlock> put;
    for (uint64_t i = 0; i < n; ++i) put.push_back({H(i), src.data() + i * kBlock});
    auto r = c.Put(ns, kBlock, put).get();
    EXPECT_TRUE(r.ok()) << r.status();
    return src;
  }
  static BlockHash H(uint64_t i) { return BlockHash{0xFE7C4 + i, i}; }
  std::vector<BlockHash> Chain(uint64_t n) const {
    std::vector<BlockHash> chain;
    for (uint64_t i = 0; i < n; ++i) chain.push_back(H(i));
    return chain;
  }

  testing::TempDir dir_;
  std::unique_ptr<ServerProcess> store_;
};

TEST_P(FetchPath, APinThenASegmentedReadLandsEveryByteAndReportsSegmentsInOrder) {
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(Spec4L());
  ASSERT_TRUE(ns.ok()) << ns.status();
  ASSERT_EQ(ns->block_bytes, kBlock);
  const uint64_t n = 8;
  auto src = PutBlocks(c, ns->id, n);
  auto chain = Chain(n);
  chain.push_back(BlockHash{1, 2});  // absent: the pin ends before it
  auto pin = c.Pin(ns->id, kBlock, chain);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_EQ(pin->sources.size(), n);
  EXPECT_NE(pin->lease, 0u);
  std::vector<uint8_t> dst(n * kBlock);
  std::vector<size_t> segments;
  ReadPlan plan;
  plan.bounds = {0, kLayer, 2 * kLayer, 3 * kLayer, kBlock};
  plan.dest = [&](size_t i, size_t s) { return dst.data() + i * kBlock + s * kLayer; };
  plan.on_segment = [&](size_t s) {
    // Segment s of every block is in when it is reported.
    for (uint64_t i = 0; i < n; ++i) {
      EXPECT_EQ(0, std::memcmp(dst.data() + i * kBlock + s * kLayer,
                               src.data() + i * kBlock + s * kLayer, kLayer));
    }
    segments.push_back(s);
  };
  auto got = c.Read(*pin, kBlock, 0, n, plan).get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->blocks, n);
  EXPECT_EQ(segments, (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
  // The release never blocked the read; it reaches the store soon after.
  c.Release(pin->lease);
  EXPECT_TRUE(WaitFor([&] {
    auto st = c.control().GetStats();
    return st.ok() && st->get_leases() == 0;
  }));
}

TEST_P(FetchPath, EveryBlockOfASmallOrALargeReadIsCheckedAgainstItsChecksum) {
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(Spec4L());
  ASSERT_TRUE(ns.ok()) << ns.status();
  // 10 MiB: a mapped read this large sums on a second thread beside the copy;
  // over TCP each block is summed as it lands.
  const uint64_t n = 160;
  auto src = PutBlocks(c, ns->id, n);
  auto pin = c.Pin(ns->id, kBlock, Chain(n));
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_EQ(pin->sources.size(), n);
  std::vector<uint8_t> dst(n * kBlock);
  ReadPlan plan;
  plan.bounds = {0, kLayer, 2 * kLayer, 3 * kLayer, kBlock};
  plan.dest = [&](size_t i, size_t s) { return dst.data() + i * kBlock + s * kLayer; };
  for (uint64_t count : {uint64_t{4}, n}) {
    SCOPED_TRACE(count);
    // A checksum the bytes do not have: the read fails and names the block.
    PinnedBlocks wrong = *pin;
    const uint64_t k = count - 2;
    wrong.sources[k].checksum ^= 1;
    auto bad = c.Read(wrong, kBlock, 0, count, plan).get();
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
    EXPECT_NE(bad.status().message().find("block " + std::to_string(k) + " "), std::string::npos)
        << bad.status();
    // With the store's checksums every block passes and every byte lands.
    std::fill(dst.begin(), dst.end(), 0);
    auto good = c.Read(*pin, kBlock, 0, count, plan).get();
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_EQ(good->blocks, count);
    EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), count * kBlock));
  }
  c.Release(pin->lease);
}

TEST_P(FetchPath, BadReadsAreRefusedAndChangeNothingStored) {
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(Spec4L());
  ASSERT_TRUE(ns.ok());
  const uint64_t n = 4;
  auto src = PutBlocks(c, ns->id, n);
  auto pin = c.Pin(ns->id, kBlock, Chain(n));
  ASSERT_TRUE(pin.ok()) << pin.status();
  std::vector<uint8_t> dst(n * kBlock);
  ReadPlan plan;
  plan.dest = [&](size_t i, size_t s) { return dst.data() + i * kBlock + s * kLayer; };
  auto expect = [](const absl::StatusOr<GetOutcome>& r, absl::StatusCode code,
                   const std::string& words) {
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status();
  };
  // A layer range outside the block, or segments that do not tile it.
  plan.bounds = {0, kLayer, 2 * kBlock};
  expect(c.Read(*pin, kBlock, 0, n, plan).get(), absl::StatusCode::kInvalidArgument, "do not tile");
  plan.bounds = {0, 2 * kLayer, kLayer, kBlock};
  expect(c.Read(*pin, kBlock, 0, n, plan).get(), absl::StatusCode::kInvalidArgument, "do not tile");
  plan.bounds.clear();
  // More blocks than pinned.
  expect(c.Read(*pin, kBlock, 2, n, plan).get(), absl::StatusCode::kInvalidArgument, "are pinned");
  // A pin whose lease has expired.
  PinnedBlocks stale = *pin;
  stale.expires = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  expect(c.Read(stale, kBlock, 0, n, plan).get(), absl::StatusCode::kFailedPrecondition, "expired");
  // Nothing above touched the caller's memory or the store.
  EXPECT_EQ(dst, std::vector<uint8_t>(n * kBlock, 0));
  auto good = c.Read(*pin, kBlock, 0, n, plan).get();
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
  c.Release(pin->lease);
  auto st = c.control().GetStats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->tiers(0).items(), n);
}

TEST_P(FetchPath, VerifyingIntactBlocksDropsNothingAndBadRequestsAreRefused) {
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(Spec4L());
  ASSERT_TRUE(ns.ok());
  PutBlocks(c, ns->id, 3);
  // Intact copies (and a block the store never had) are kept: 0 dropped.
  std::vector<BlockHash> check = Chain(3);
  check.push_back(BlockHash{1, 2});
  auto dropped = c.control().VerifyBlocks(ns->id, check);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(*dropped, 0u);
  auto present = c.control().Lookup(ns->id, Chain(3));
  ASSERT_TRUE(present.ok());
  EXPECT_EQ(present->size(), 3u);
  EXPECT_EQ(c.control().VerifyBlocks(ns->id + 1, Chain(1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(c.control().VerifyBlocks(ns->id, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(FetchPath, ReleasesOfUnknownLeasesAreReportedNotFailed) {
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(Spec4L());
  ASSERT_TRUE(ns.ok());
  PutBlocks(c, ns->id, 2);
  auto pin = c.Pin(ns->id, kBlock, Chain(2));
  ASSERT_TRUE(pin.ok());
  auto& stub = c.control().stub();
  {
    v1::ReleaseGetsRequest req;
    req.add_lease_ids(pin->lease);
    req.add_lease_ids(987654321);
    v1::ReleaseGetsResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub.ReleaseGets(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.released(), 1u);
    ASSERT_EQ(resp.not_found_size(), 1);
    EXPECT_EQ(resp.not_found(0), 987654321u);
  }
  {
    v1::ReleaseGetsRequest req;  // no ids
    v1::ReleaseGetsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(stub.ReleaseGets(&ctx, req, &resp).error_code(), grpc::INVALID_ARGUMENT);
  }
  {
    // A release riding on a pin: the ended lease is reported, the pin works.
    v1::BeginGetRequest req;
    req.set_namespace_id(ns->id);
    for (const auto& h : Chain(2)) ToProto(h, req.add_hashes());
    req.add_end_leases(pin->lease);  // ended above
    v1::BeginGetResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub.BeginGet(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.sources_size(), 2);
    ASSERT_EQ(resp.leases_not_found_size(), 1);
    EXPECT_NE(resp.instance_id(), 0u);
    c.Release(resp.lease_id());
  }
  EXPECT_TRUE(WaitFor([&] {
    auto st = c.control().GetStats();
    return st.ok() && st->get_leases() == 0;
  }));
}

// Calls of each RPC the store has answered, by histogram name.
uint64_t CallsOf(StoreClient& control, const std::string& rpc) {
  auto st = control.GetStats();
  if (!st.ok()) return 0;
  for (const auto& h : st->rpc_latency()) {
    if (h.rpc() == rpc) return h.count();
  }
  return 0;
}

TEST_P(FetchPath, PinsReleasesAndPutsTravelOnTheDataPlaneAndGrpcStaysForOlderClients) {
  for (bool on_data_plane : {true, false}) {
    SCOPED_TRACE(on_data_plane ? "data-plane calls" : "gRPC calls");
    DataClientOptions o = Options();
    o.data_plane_calls = on_data_plane;
    StoreDataClient c(store_->address(), o);
    auto ns = c.control().RegisterNamespace(Spec4L());
    ASSERT_TRUE(ns.ok());
    const uint64_t grpc_puts = CallsOf(c.control(), "BeginPut");
    const uint64_t ucx_puts = CallsOf(c.control(), "DataPlaneBeginPut");
    auto src = PutBlocks(c, ns->id, 3);
    if (on_data_plane) {
      EXPECT_EQ(CallsOf(c.control(), "DataPlaneBeginPut") - ucx_puts, 1u);
      EXPECT_EQ(CallsOf(c.control(), "BeginPut"), grpc_puts);
    } else {
      EXPECT_EQ(CallsOf(c.control(), "BeginPut") - grpc_puts, 1u);
      EXPECT_EQ(CallsOf(c.control(), "DataPlaneBeginPut"), ucx_puts);
    }
    const uint64_t grpc_pins = CallsOf(c.control(), "BeginGet");
    const uint64_t ucx_pins = CallsOf(c.control(), "DataPlaneBeginGet");
    const uint64_t ucx_releases = CallsOf(c.control(), "DataPlaneReleaseGets");
    for (int i = 0; i < 3; ++i) {
      auto pin = c.Pin(ns->id, kBlock, Chain(3));
      ASSERT_TRUE(pin.ok()) << pin.status();
      ASSERT_EQ(pin->sources.size(), 3u);
      std::vector<uint8_t> dest(3 * kBlock);
      ReadPlan plan;
      plan.dest = [&](size_t b, size_t) { return dest.data() + b * kBlock; };
      auto r = c.Read(*pin, kBlock, 0, 3, plan).get();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(dest, src);
      c.Release(pin->lease);
    }
    // Every lease ends (two rode on the next pin, the last went on its own).
    EXPECT_TRUE(WaitFor([&] {
      auto st = c.control().GetStats();
      return st.ok() && st->get_leases() == 0;
    }));
    if (on_data_plane) {
      EXPECT_EQ(CallsOf(c.control(), "DataPlaneBeginGet") - ucx_pins, 3u);
      EXPECT_EQ(CallsOf(c.control(), "BeginGet"), grpc_pins) << "no pin took gRPC";
      EXPECT_GE(CallsOf(c.control(), "DataPlaneReleaseGets") - ucx_releases, 1u);
    } else {
      EXPECT_EQ(CallsOf(c.control(), "BeginGet") - grpc_pins, 3u);
      EXPECT_EQ(CallsOf(c.control(), "DataPlaneBeginGet"), ucx_pins);
    }
  }
}

// A client of the data plane's control calls written against the wire
// format alone (common/ucx/calls.h), so it can send what a kvtier client
// never would.
class RawCaller {
 public:
  explicit RawCaller(StoreClient& control) {
    v1::ConnectDataPlaneRequest req;
    grpc::ClientContext ctx;
    EXPECT_TRUE(control.stub().ConnectDataPlane(&ctx, req, &connect_).ok());
    if (!connect_.data_address().empty()) {
      // The socket data plane: Call connects. The session lives while one
      // of its connections does, as a client's pooled connection keeps it.
      keeper_ = SocketCall(ucx::kCallReleaseGets, session(), "", ucx::kCallMagic, &keeper_fd_);
      // (An empty ReleaseGets: refused as naming no lease, after the hello.)
      EXPECT_EQ(keeper_.first, grpc::INVALID_ARGUMENT) << keeper_.second;
      return;
    }
    ctx_ = *ucx::Context::Create();
    worker_ = std::move(*ucx::Worker::Create(ctx_, true));
    EXPECT_TRUE(worker_->SetAmHandler(ucx::kReplyAmId, &RawCaller::OnReply, this).ok());
    ep_ = std::move(*ucx::Endpoint::ConnectToWorker(worker_.get(), connect_.worker_address(),
                                                    /*peer_failure_handling=*/true));
  }
  ~RawCaller() {
    if (keeper_fd_ >= 0) close(keeper_fd_);
    ep_.reset();
    worker_.reset();
  }
  const std::string& session() const { return connect_.session(); }
  bool sockets() const { return !connect_.data_address().empty(); }
  // Sends one call; the reply's code and body (code -1: no reply in 2 s).
  std::pair<int, std::string> Call(uint16_t method, const std::string& session,
                                   const std::string& body, uint32_t magic = ucx::kCallMagic) {
    if (!connect_.data_address().empty()) return SocketCall(method, session, body, magic);
    ucx::CallHeader h;
    h.magic = magic;
    h.method = method;
    h.call_id = ++id_;
    std::memcpy(h.session, session.data(), std::min(session.size(), sizeof(h.session)));
    replied_ = false;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    std::vector<void*> reqs = {
        ucp_am_send_nbx(ep_->get(), ucx::kCallAmId, &h, sizeof(h), body.data(), body.size(), &p)};
    EXPECT_TRUE(worker_->WaitAll(reqs, ucx::Clock::now() + std::chrono::seconds(2)).ok());
    if (!worker_->WaitUntil([&] { return replied_; },
                            ucx::Clock::now() + std::chrono::seconds(2))) {
      return {-1, ""};
    }
    return {code_, body_};
  }

 private:
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t*) {
    auto* c = static_cast<RawCaller*>(arg);
    ucx::ReplyHeader h;
    if (header_length != sizeof(h)) return UCS_OK;
    std::memcpy(&h, header, sizeof(h));
    if (h.call_id != c->id_) return UCS_OK;
    c->code_ = h.code;
    c->body_.assign(static_cast<const char*>(data), length);
    c->replied_ = true;
    return UCS_OK;
  }
  // The same call as a socket data-plane frame, on a connection that
  // presented `session` (a frame of another magic stands for the UCX
  // header's; the store then closes the connection). The connection is
  // closed after, or with `keep`, left open there.
  std::pair<int, std::string> SocketCall(uint16_t method, const std::string& session,
                                         const std::string& body, uint32_t magic,
                                         int* keep = nullptr) {
    const std::string& a = connect_.data_address();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    auto fd = net::Connect("127.0.0.1", std::stoi(a.substr(a.rfind(':') + 1)), deadline);
    if (!fd.ok()) return {-1, std::string(fd.status().message())};
    auto exchange = [&](const wire::Frame& f,
                        const std::string& payload) -> std::pair<int, std::string> {
      iovec v[2] = {{const_cast<wire::Frame*>(&f), sizeof(f)},
                    {const_cast<char*>(payload.data()), payload.size()}};
      wire::Reply r;
      if (!net::WriteAll(*fd, v, 2, deadline).ok() ||
          !net::ReadAll(*fd, &r, sizeof(r), deadline).ok()) {
        return {-1, ""};
      }
      std::string text(r.message_bytes, '\0');
      if (!net::ReadAll(*fd, text.data(), text.size(), deadline).ok()) return {-1, ""};
      return {r.code, text};
    };
    auto nonce = testing::ReadChallenge(*fd, deadline);
    if (!nonce.ok()) {
      close(*fd);
      return {-1, std::string(nonce.status().message())};
    }
    const std::string hello = testing::HelloFor(session, *nonce);
    std::pair<int, std::string> out =
        exchange(wire::Frame{wire::kFrameMagic, wire::kHello, 0, 0, 0, hello.size()}, hello);
    if (out.first == 0) {
      out = exchange(wire::Frame{magic == ucx::kCallMagic ? wire::kFrameMagic : magic, wire::kCall,
                                 method, 0, 0, body.size()},
                     body);
    }
    if (keep != nullptr) {
      *keep = *fd;
    } else {
      close(*fd);
    }
    return out;
  }
  v1::ConnectDataPlaneResponse connect_;
  std::pair<int, std::string> keeper_;
  int keeper_fd_ = -1;
  std::shared_ptr<ucx::Context> ctx_;
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<ucx::Endpoint> ep_;
  uint64_t id_ = 0;
  bool replied_ = false;
  int code_ = 0;
  std::string body_;
};

TEST_P(FetchPath, BadDataPlaneCallsAreRefusedAndChangeNothingStored) {
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(Spec4L());
  ASSERT_TRUE(ns.ok());
  auto src = PutBlocks(c, ns->id, 2);
  RawCaller raw(c.control());
  ASSERT_EQ(raw.session().size(), raw.sockets() ? wire::kSocketSessionBytes : ucx::kSessionBytes)
      << "the store hands out a session";
  v1::BeginGetRequest pin;
  pin.set_namespace_id(ns->id);
  for (const auto& h : Chain(2)) ToProto(h, pin.add_hashes());
  const std::string good = pin.SerializeAsString();
  auto expect = [](const std::pair<int, std::string>& r, int code, const std::string& says) {
    EXPECT_EQ(r.first, code) << r.second;
    EXPECT_NE(r.second.find(says), std::string::npos) << r.second;
  };
  // Nobody's session: refused, nothing pinned.
  expect(raw.Call(ucx::kCallBeginGet, std::string(ucx::kSessionBytes, 'x'), good),
         grpc::UNAUTHENTICATED, "unknown data-plane session");
  // Not kvtier's wire format, an unknown method, a body that is not the request.
  expect(raw.Call(ucx::kCallBeginGet, raw.session(), good, 0x12345678), grpc::INVALID_ARGUMENT,
         "magic");
  expect(raw.Call(77, raw.session(), good), grpc::UNIMPLEMENTED, "method 77");
  expect(raw.Call(ucx::kCallBeginGet, raw.session(), std::string("\xff\xff\xff", 3)),
         grpc::INVALID_ARGUMENT, "not a BeginGetRequest");
  // The store's own checks, as over gRPC: an unknown namespace, no lease ids.
  v1::BeginGetRequest unknown = pin;
  unknown.set_namespace_id(ns->id ^ 1);
  expect(raw.Call(ucx::kCallBeginGet, raw.session(), unknown.SerializeAsString()), grpc::NOT_FOUND,
         "namespace");
  expect(
      raw.Call(ucx::kCallReleaseGets, raw.session(), v1::ReleaseGetsRequest().SerializeAsString()),
      grpc::INVALID_ARGUMENT, "names no lease");
  v1::BeginPutRequest put;
  put.set_namespace_id(ns->id ^ 1);
  ToProto(BlockHash{77, 77}, put.add_hashes());
  expect(raw.Call(ucx::kCallBeginPut, raw.session(), put.SerializeAsString()), grpc::NOT_FOUND,
         "namespace");
  expect(raw.Call(ucx::kCallBeginPut, raw.session(), std::string("\x0a\xff", 2)),
         grpc::INVALID_ARGUMENT, "not a BeginPutRequest");
  {
    auto st = c.control().GetStats();
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->get_leases(), 0u) << "no refused call pinned anything";
    EXPECT_EQ(st->put_leases(), 0u) << "no refused call reserved anything";
  }
  // The same connection still pins, and releases, correctly.
  auto ok = raw.Call(ucx::kCallBeginGet, raw.session(), good);
  ASSERT_EQ(ok.first, 0) << ok.second;
  v1::BeginGetResponse resp;
  ASSERT_TRUE(resp.ParseFromString(ok.second));
  ASSERT_EQ(resp.sources_size(), 2);
  v1::ReleaseGetsRequest rel;
  rel.add_lease_ids(resp.lease_id());
  rel.add_lease_ids(987654321);
  auto released = raw.Call(ucx::kCallReleaseGets, raw.session(), rel.SerializeAsString());
  ASSERT_EQ(released.first, 0) << released.second;
  v1::ReleaseGetsResponse rr;
  ASSERT_TRUE(rr.ParseFromString(released.second));
  EXPECT_EQ(rr.released(), 1u);
  ASSERT_EQ(rr.not_found_size(), 1);
  EXPECT_EQ(rr.not_found(0), 987654321u);
  // And every stored byte is as it was.
  std::vector<uint8_t> dest(2 * kBlock);
  std::vector<GetBlock> get;
  for (uint64_t i = 0; i < 2; ++i) get.push_back({H(i), dest.data() + i * kBlock});
  auto r = c.Get(ns->id, kBlock, get).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks, 2u);
  EXPECT_EQ(dest, src);
}

INSTANTIATE_TEST_SUITE_P(Transports, FetchPath, ::testing::Values("socket", "ucx", "mapped"),
                         [](const auto& info) { return std::string(info.param); });

// The connector over the fetch path: layer-wise loads and int8 namespaces.
class ConnectorFetch : public FetchPath {
 protected:
  std::unique_ptr<worker::KvConnector> Make(NamespaceSpec spec, uint64_t pages,
                                            std::string offload) {
    worker::ConnectorOptions o;
    o.spec = std::move(spec);
    o.num_pages = pages;
    o.stores = {store_->address()};
    o.offload = std::move(offload);
    o.staging_blocks = 8;  // int8 loads of more blocks go in runs
    o.data = Options();
    auto c = worker::KvConnector::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // Computes and saves the chain write-through, so the store holds it.
  void Store(worker::KvConnector& a, uint64_t id, const std::vector<BlockHash>& chain) {
    ASSERT_TRUE(a.Begin(id, chain).ok());
    auto pages = a.AllocateForCompute(id);
    ASSERT_TRUE(pages.ok()) << pages.status();
    for (size_t i = 0; i < pages->size(); ++i) {
      worker::ComputeIntoPage(a.pool().layout(), a.pool().layer_bases(), (*pages)[i],
                              a.namespace_id(), chain[i]);
    }
    ASSERT_TRUE(a.Save(id).ok());
    ASSERT_TRUE(a.WaitForSave(id).ok());
    a.Finished(id);
  }
  std::vector<BlockHash> ChainOf(const NamespaceSpec& spec, uint64_t n) const {
    std::vector<uint32_t> tokens(n * spec.block_tokens);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7 + 3);
    return ChainHashes(NamespaceId(spec), tokens, spec.block_tokens);
  }
  // Loads the chain into a fresh worker layer by layer; every layer is
  // reported and every page holds the model's bytes (packed: after int8).
  void LoadLayerByLayer(const NamespaceSpec& spec, uint64_t n, bool packed) {
    auto chain = ChainOf(spec, n);
    auto a = Make(spec, 2 * n, "write-through");
    Store(*a, 1, chain);
    auto b = Make(spec, 2 * n, "none");
    auto m = b->Begin(2, chain);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->store_blocks, n);
    ASSERT_TRUE(b->StartLoad(2).ok());
    EXPECT_EQ(b->StartLoad(2).code(), absl::StatusCode::kFailedPrecondition) << "started twice";
    for (uint32_t l = 0; l < spec.layers; ++l) EXPECT_TRUE(b->WaitForLayer(2, l).ok()) << l;
    EXPECT_EQ(b->WaitForLayer(2, spec.layers).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(b->WaitForLayer(99, 0).code(), absl::StatusCode::kNotFound);
    auto loaded = b->WaitForLoad(2);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(*loaded, n);
    auto pages = b->Pages(2);
    ASSERT_EQ(pages.size(), n);
    for (uint64_t i = 0; i < n; ++i) {
      EXPECT_TRUE(worker::PageMatchesModel(b->pool().layout(), b->pool().layer_bases(), pages[i],
                                           b->namespace_id(), chain[i], packed))
          << "block " << i;
      if (packed) {
        EXPECT_FALSE(worker::PageMatchesModel(b->pool().layout(), b->pool().layer_bases(), pages[i],
                                              b->namespace_id(), chain[i], false))
            << "int8 is lossy: the page cannot hold the unpacked model exactly";
      }
    }
    // The load's time is accounted: a pin round trip, and the bytes moved.
    const auto times = b->LoadTimesOf(2);
    EXPECT_GT(times.transfer.control_ms, 0.0) << "the pin's round trip was not counted";
    EXPECT_GT(times.transfer.rma_ms, 0.0) << "the transfer's time was not counted";
    b->Finished(2);
  }
};

TEST_P(ConnectorFetch, ALayerWiseLoadReportsEveryLayerAndLandsTheModelsBytes) {
  LoadLayerByLayer(Spec4L(), 12, /*packed=*/false);
}

TEST_P(ConnectorFetch, AnInt8NamespaceMovesHalfTheBytesAndLoadsThePackedModel) {
  NamespaceSpec spec = Spec4L();
  spec.kv_wire = kKvWireInt8;
  // Per layer: two float32 scales and one byte per element, against two.
  const uint64_t elems = uint64_t{spec.kv_heads} * spec.head_dim * spec.block_tokens;
  EXPECT_EQ(BlockBytes(spec), spec.layers * (8 + 2 * elems));
  EXPECT_LE(2 * BlockBytes(spec), BlockBytes(Spec4L()) + 16 * spec.layers);
  EXPECT_NE(NamespaceId(spec), NamespaceId(Spec4L())) << "int8 blocks never alias plain ones";
  StoreDataClient c(store_->address(), Options());
  auto ns = c.control().RegisterNamespace(spec);
  ASSERT_TRUE(ns.ok()) << ns.status();
  EXPECT_EQ(ns->block_bytes, BlockBytes(spec)) << "the store holds packed blocks";
  // 12 blocks through 8 staging slots: two runs.
  LoadLayerByLayer(spec, 12, /*packed=*/true);
}

TEST_P(ConnectorFetch, Int8ForAnEightBitCacheOrAnUnknownWireIsRefused) {
  NamespaceSpec fp8 = Spec4L();
  fp8.dtype = "fp8";
  fp8.kv_wire = kKvWireInt8;
  worker::ConnectorOptions o;
  o.spec = fp8;
  o.stores = {store_->address()};
  auto c = worker::KvConnector::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("16-bit"), std::string::npos) << c.status();
  StoreDataClient dc(store_->address(), Options());
  NamespaceSpec odd = Spec4L();
  odd.kv_wire = "int4";
  auto r = dc.control().RegisterNamespace(odd);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kv_wire"), std::string::npos) << r.status();
  v1::ListNamespacesResponse listed;
  grpc::ClientContext ctx;
  ASSERT_TRUE(dc.control().stub().ListNamespaces(&ctx, {}, &listed).ok());
  EXPECT_EQ(listed.namespaces_size(), 0) << "nothing was registered";
}

INSTANTIATE_TEST_SUITE_P(Transports, ConnectorFetch, ::testing::Values("socket", "ucx", "mapped"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kvtier
