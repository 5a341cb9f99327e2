#include "client/router_client.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "common/limits.h"
#include "common/log.h"
#include "common/rpc/proto_convert.h"

namespace kvtier {

namespace {
using Clock = std::chrono::steady_clock;
constexpr size_t kChunk = limits::kMaxEventHashes;
}  // namespace

EventPublisher::EventPublisher(PublisherOptions options, LoadFn load)
    : options_(std::move(options)), load_(std::move(load)) {
  if (options_.hello.epoch() == 0) {
    options_.hello.set_epoch(
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count()));
  }
  // gRPC backs reconnects off up to 120 s by default: a source started long
  // before its router (a store shard before the frontend, a worker before a
  // rolled router) would wait up to that long once the router is up. Keep the
  // channel's back-off within the publisher's own.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::clamp<uint64_t>(options_.backoff_min_ms, 100, 600000)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::clamp<uint64_t>(options_.backoff_max_ms, 100, 600000)));
  channel_ = OpenChannel(options_.router, options_.security, args);
  stub_ = v1::Router::NewStub(channel_);
  thread_ = std::thread([this] { Run(); });
}

EventPublisher::~EventPublisher() { Stop(); }

void EventPublisher::Stop() {
  {
    std::lock_guard lk(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
    if (live_ctx_) live_ctx_->TryCancel();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t EventPublisher::last_seq() const {
  std::lock_guard lk(mu_);
  return seq_;
}

void EventPublisher::SetSilent(bool silent) {
  std::lock_guard lk(mu_);
  silent_ = silent;
  cv_.notify_all();
}

void EventPublisher::BreakStream() {
  std::lock_guard lk(mu_);
  if (live_ctx_) live_ctx_->TryCancel();
}

void EventPublisher::Enqueue(v1::KvEvent e) {
  // REQUIRES: mu_ held.
  e.set_seq(++seq_);
  queue_.push_back(std::move(e));
  while (queue_.size() > options_.max_queued_events) queue_.pop_front();
  cv_.notify_all();
}

void EventPublisher::Stored(uint64_t ns, const std::vector<BlockHash>& hashes) {
  std::lock_guard lk(mu_);
  v1::KvEvent e;
  for (const auto& h : hashes) {
    if (!mirror_.insert(BlockKey{ns, h}).second) continue;  // already published
    auto* s = e.mutable_stored();
    s->set_namespace_id(ns);
    ToProto(h, s->add_hashes());
    if (s->hashes_size() == static_cast<int>(kChunk)) Enqueue(std::exchange(e, v1::KvEvent()));
  }
  if (e.has_stored()) Enqueue(std::move(e));
}

void EventPublisher::Removed(uint64_t ns, const std::vector<BlockHash>& hashes) {
  std::lock_guard lk(mu_);
  v1::KvEvent e;
  for (const auto& h : hashes) {
    if (!mirror_.erase(BlockKey{ns, h})) continue;  // never published
    auto* r = e.mutable_removed();
    r->set_namespace_id(ns);
    ToProto(h, r->add_hashes());
    if (r->hashes_size() == static_cast<int>(kChunk)) Enqueue(std::exchange(e, v1::KvEvent()));
  }
  if (e.has_removed()) Enqueue(std::move(e));
}

void EventPublisher::Cleared() {
  std::lock_guard lk(mu_);
  mirror_.clear();
  v1::KvEvent e;
  e.mutable_cleared();
  Enqueue(std::move(e));
}

bool EventPublisher::Pump(grpc::ClientReaderWriter<v1::SourceMessage, v1::RouterCommand>* stream,
                          Clock::time_point* next_heartbeat) {
  std::vector<v1::SourceMessage> out;
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return stop_ || stream_ended_ || !silent_; });
    cv_.wait_until(lk, *next_heartbeat, [&] {
      return stop_ || stream_ended_ || silent_ || !queue_.empty() || snapshot_requested_;
    });
    if (stop_ || stream_ended_) return false;
    if (silent_) return true;
    if (snapshot_requested_) {
      // Everything queued is covered by the snapshot at seq_.
      snapshot_requested_ = false;
      queue_.clear();
      std::vector<BlockKey> keys(mirror_.begin(), mirror_.end());
      std::sort(keys.begin(), keys.end());
      size_t i = 0;
      do {
        v1::SourceMessage m;
        auto* c = m.mutable_snapshot();
        c->set_seq(seq_);
        uint64_t ns = i < keys.size() ? keys[i].ns : 0;
        c->set_namespace_id(ns);
        size_t n = 0;
        while (i < keys.size() && keys[i].ns == ns && n < kChunk) {
          ToProto(keys[i].hash, c->add_hashes());
          ++i;
          ++n;
        }
        c->set_last(i >= keys.size());
        out.push_back(std::move(m));
      } while (i < keys.size());
      snapshots_sent_++;
    }
    while (!queue_.empty()) {
      v1::SourceMessage m;
      *m.mutable_event() = std::move(queue_.front());
      queue_.pop_front();
      out.push_back(std::move(m));
    }
  }
  if (Clock::now() >= *next_heartbeat) {
    v1::SourceMessage m;
    *m.mutable_heartbeat() = load_ ? load_() : v1::Heartbeat();
    out.push_back(std::move(m));
    *next_heartbeat = Clock::now() + std::chrono::milliseconds(options_.heartbeat_ms);
  }
  for (auto& m : out) {
    if (!stream->Write(m)) return false;
  }
  return true;
}

void EventPublisher::Run() {
  uint64_t backoff = options_.backoff_min_ms;
  while (true) {
    // Wait on the channel until it connects, then open the stream at once
    // (not at the next back-off). Waiting also drives the channel's
    // reconnects: a call failing fast on a down channel does not, and with
    // none in flight gRPC looks at it only every 5 s (100 ms after
    // PrepareGrpcProcess, which a process embedding this may not have run
    // before gRPC started).
    while (!channel_->WaitForConnected(std::chrono::system_clock::now() +
                                       std::chrono::milliseconds(200))) {
      std::lock_guard lk(mu_);
      if (stop_) return;
    }
    grpc::ClientContext ctx;
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      live_ctx_ = &ctx;
      stream_ended_ = false;
    }
    auto stream = stub_->StreamEvents(&ctx);
    v1::SourceMessage hello;
    *hello.mutable_hello() = options_.hello;
    bool ok = stream->Write(hello);
    std::thread reader;
    if (ok) {
      connected_ = true;
      backoff = options_.backoff_min_ms;
      reader = std::thread([&] {
        v1::RouterCommand c;
        while (stream->Read(&c)) {
          if (c.has_snapshot_request()) {
            std::lock_guard lk(mu_);
            snapshot_requested_ = true;
            cv_.notify_all();
          } else if (c.has_event_rejected()) {
            rejected_++;
            Log("publisher", options_.hello.source_id(), ": router rejected event ",
                c.event_rejected().seq(), ": ", c.event_rejected().reason());
          }
        }
        // The stream ended: wake the writer so it notices.
        std::lock_guard lk(mu_);
        stream_ended_ = true;
        cv_.notify_all();
      });
      auto next_heartbeat = Clock::now();
      while (Pump(stream.get(), &next_heartbeat)) {
      }
      stream->WritesDone();
    }
    ctx.TryCancel();
    if (reader.joinable()) reader.join();
    stream->Finish();
    connected_ = false;
    {
      std::unique_lock lk(mu_);
      live_ctx_ = nullptr;
      if (stop_) return;
      cv_.wait_for(lk, std::chrono::milliseconds(backoff), [&] { return stop_; });
      if (stop_) return;
    }
    backoff = std::min(backoff * 2, options_.backoff_max_ms);
  }
}

}  // namespace kvtier
