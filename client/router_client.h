// The event-source side of the router protocol: what a worker or store shard
// links to publish its KV events.
//
// EventPublisher keeps one StreamEvents stream open (reconnecting with
// exponential back-off), numbers events 1, 2, 3... in its epoch, sends a
// heartbeat every heartbeat_ms, and answers the router's snapshot requests
// from a mirror of everything it has published, so the snapshot is exactly
// consistent with its sequence number. Events made while disconnected are
// queued (bounded; past the bound the oldest are dropped and the router's gap
// detection asks for a snapshot). Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "common/block_key.h"
#include "common/rpc/tls.h"
#include "kvtier/v1/router.grpc.pb.h"

namespace kvtier {

struct PublisherOptions {
  std::string router;  // HOST:PORT
  v1::Hello hello;     // epoch 0 is replaced by the current time in ns
  uint64_t heartbeat_ms = 1000;
  // Between reconnects; these also bound the channel's own reconnect back-off
  // (at least 100 ms), and the publisher waits on the channel while it is
  // down, so a source reaches a router within about backoff_max_ms of its
  // coming up, however long it was away.
  uint64_t backoff_min_ms = 50;
  uint64_t backoff_max_ms = 2000;
  size_t max_queued_events = 100000;
  ChannelSecurity security;  // plaintext unless TLS credentials are set
};

// Where a source reports what it holds: one router's publisher, or all of
// them (client/router_fanout.h).
class BlockEventSink {
 public:
  virtual ~BlockEventSink() = default;
  // Publish changes; blocks already published as stored (or never
  // published) are skipped, so callers may report the same change twice.
  virtual void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) = 0;
  virtual void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) = 0;
  virtual void Cleared() = 0;
};

class EventPublisher : public BlockEventSink {
 public:
  using LoadFn = std::function<v1::Heartbeat()>;
  explicit EventPublisher(PublisherOptions options, LoadFn load = nullptr);
  ~EventPublisher() override;

  void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) override;
  void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) override;
  void Cleared() override;
  // Closes the stream and stops the background thread.
  void Stop();

  bool connected() const { return connected_; }
  uint64_t epoch() const { return options_.hello.epoch(); }
  uint64_t last_seq() const;
  uint64_t snapshots_sent() const { return snapshots_sent_; }
  uint64_t events_rejected() const { return rejected_; }
  // Test hooks: go silent (no heartbeats, no events) while keeping the
  // stream open; break the current stream (it reconnects).
  void SetSilent(bool silent);
  void BreakStream();

 private:
  void Run();
  void Enqueue(v1::KvEvent e);
  // Sends queued events, a snapshot if asked, a heartbeat if due. False when
  // the stream broke.
  bool Pump(grpc::ClientReaderWriter<v1::SourceMessage, v1::RouterCommand>* stream,
            std::chrono::steady_clock::time_point* next_heartbeat);

  PublisherOptions options_;
  LoadFn load_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Router::Stub> stub_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::KvEvent> queue_;
  absl::flat_hash_set<BlockKey, BlockKeyHasher> mirror_;
  uint64_t seq_ = 0;
  bool snapshot_requested_ = false;
  bool stop_ = false;
  bool silent_ = false;
  bool stream_ended_ = false;  // set by the reader of the current stream
  grpc::ClientContext* live_ctx_ = nullptr;

  std::atomic<bool> connected_{false};
  std::atomic<uint64_t> snapshots_sent_{0}, rejected_{0};
  std::thread thread_;
};

}  // namespace kvtier
