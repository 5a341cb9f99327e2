#include "router/vllm_events.h"

#include <chrono>
#include <mutex>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/log.h"
#include "router/router_core.h"

namespace kvtier::router {

namespace {

constexpr uint64_t kEndSeq = ~uint64_t{0};
// Larger frames are dropped by ZeroMQ before they reach the decoder.
constexpr int64_t kMaxMessageBytes = int64_t{256} << 20;
// A message this much older than the last applied is an engine that
// restarted and whose first messages were missed, not a stale duplicate
// (those are at most a subscriber queue, ZeroMQ's 1,000 by default, behind).
constexpr uint64_t kRestartLag = 10000;

// Notes when the subscriber's connection to the engine drops: a message
// after that whose sequence goes back is the engine restarted, however
// short its new sequence is.
class PeerWatch : public zmq::monitor_t {
 public:
  explicit PeerWatch(std::atomic<bool>* lost) : lost_(lost) {}
  void on_event_disconnected(const zmq_event_t&, const char*) override { *lost_ = true; }

 private:
  std::atomic<bool>* lost_;
};

std::atomic<uint64_t> watch_ids{0};

uint64_t BigEndian64(const zmq::message_t& m) {
  uint64_t v = 0;
  const auto* p = static_cast<const uint8_t*>(m.data());
  for (size_t i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

struct VllmEventSource::Impl {
  VllmSourceSpec spec;
  RouterCore* core;
  zmq::context_t ctx{1};
  std::atomic<bool> stop{false};
  mutable std::mutex mu;
  VllmSourceStats stats;
  VllmChainMap chain;
  uint64_t router_seq = 0;
  std::optional<uint64_t> last;         // vLLM's last applied sequence number
  std::atomic<bool> registered{false};  // the router took the last hello
  SourceLoad load;                      // guarded by mu: SetLoad's last
  std::atomic<bool> peer_lost{false};   // the connection dropped since the last message
  PeerWatch* watch = nullptr;           // Run's, while it runs

  Impl(VllmSourceSpec s, RouterCore* c)
      : spec(std::move(s)), core(c), chain(spec.namespace_id, spec.block_tokens) {}

  template <class F>
  void Count(F f) {
    std::lock_guard lk(mu);
    f(stats);
  }

  void Deliver(const SourceMessage& m) {
    if (!registered) {
      // Out of routing since a refused hello: try again. Its snapshot
      // carries every block mapped meanwhile, this message's included.
      Register();
      return;
    }
    std::vector<RouterCommand> cmds;
    auto s = core->Handle(spec.id, m, &cmds);
    if (absl::IsNotFound(s)) {  // expired meanwhile: register afresh
      Register();
      return;
    }
    for (const auto& c : cmds) {
      if (c.kind == RouterCommand::Kind::kSnapshotRequest) SendSnapshot();
    }
  }

  // What the router should believe the engine holds: every mapped block.
  void SendSnapshot() {
    SnapshotChunk chunk{router_seq, spec.namespace_id, {}, false};
    std::vector<RouterCommand> cmds;
    auto flush = [&](bool last_chunk) {
      chunk.last = last_chunk;
      if (auto s = core->Handle(spec.id, SourceMessage(std::move(chunk)), &cmds);
          !s.ok() && registered) {
        Count([](VllmSourceStats& st) { st.snapshot_failures++; });
        Log("router", "vLLM source ", spec.id, ": the router refused its snapshot (", s.message(),
            "); registering again");
        registered = false;  // the next delivery registers again
      }
      chunk = SnapshotChunk{router_seq, spec.namespace_id, {}, false};
    };
    VllmChainMap::Moved off_gpu;  // the snapshot puts them on the GPU: moved after it
    chain.ForEach([&](const BlockHash& h, Medium fastest) {
      chunk.hashes.push_back(h);
      if (fastest != Medium::kGpu) off_gpu.emplace_back(h, fastest);
      if (chunk.hashes.size() == limits::kMaxEventHashes) flush(false);
    });
    flush(true);
    if (registered) SendMoved(off_gpu);
  }

  void Register() {
    SourceHello h{spec.id,
                  SourceKind::kWorker,
                  spec.endpoint,
                  spec.namespace_id,
                  spec.block_tokens,
                  static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count())};
    std::vector<RouterCommand> cmds;
    if (auto s = core->Hello(h, &cmds); !s.ok()) {
      uint64_t failures = 0;
      Count([&](VllmSourceStats& st) { failures = ++st.hello_failures; });
      // Said at once, then once a minute while it lasts.
      if (failures == 1 || failures % 60 == 0) {
        Log("router", "vLLM source ", spec.id, ": the router refused its hello (", s.message(),
            "); it is out of routing, retried every second (", failures, " refused so far)");
      }
      registered = false;
      return;
    }
    registered = true;
    router_seq = 0;
    SendSnapshot();
  }

  // Blocks stored, removed or moved to `medium` (kMedium), in events of
  // at most kMaxEventHashes.
  void SendBlocks(BlockEvent::Kind kind, const std::vector<BlockHash>& hashes,
                  Medium medium = Medium::kGpu) {
    for (size_t from = 0; from < hashes.size(); from += limits::kMaxEventHashes) {
      BlockEvent e;
      e.seq = ++router_seq;
      e.kind = kind;
      e.medium = medium;
      e.namespace_id = spec.namespace_id;
      const size_t to = std::min(hashes.size(), from + limits::kMaxEventHashes);
      e.hashes.assign(hashes.begin() + static_cast<ptrdiff_t>(from),
                      hashes.begin() + static_cast<ptrdiff_t>(to));
      Deliver(std::move(e));
    }
  }

  // Blocks whose fastest medium changed, an event per medium.
  void SendMoved(const VllmChainMap::Moved& moved) {
    for (Medium m : {Medium::kGpu, Medium::kCpu, Medium::kDisk}) {
      std::vector<BlockHash> hashes;
      for (const auto& [h, to] : moved) {
        if (to == m) hashes.push_back(h);
      }
      SendBlocks(BlockEvent::Kind::kMedium, hashes, m);
    }
  }

  void SendCleared() {
    BlockEvent e;
    e.seq = ++router_seq;
    e.kind = BlockEvent::Kind::kCleared;
    Deliver(std::move(e));
  }

  void Apply(const VllmBatch& b) {
    VllmSourceStats delta;
    for (const auto& e : b.events) {
      delta.events++;
      if (e.kind == VllmEvent::kCleared) {
        chain.Clear();
        SendCleared();
        continue;
      }
      if (!e.skip_reason.empty()) {
        delta.skipped += e.hashes.size();
        delta.skipped_events++;
        if (absl::StartsWith(e.skip_reason, "malformed")) delta.malformed_events++;
        continue;
      }
      VllmChainMap::Moved moved;
      if (e.kind == VllmEvent::kStored) {
        auto hs = chain.Stored(e, &delta, &moved);
        delta.blocks_stored += hs.size();
        if (!hs.empty()) SendBlocks(BlockEvent::Kind::kStored, hs);
      } else {
        auto hs = chain.Removed(e, &delta, &moved);
        delta.blocks_removed += hs.size();
        if (!hs.empty()) SendBlocks(BlockEvent::Kind::kRemoved, hs);
      }
      if (!moved.empty()) SendMoved(moved);
    }
    Count([&](VllmSourceStats& s) {
      s.batches++;
      s.events += delta.events;
      s.skipped += delta.skipped;
      s.skipped_events += delta.skipped_events;
      s.malformed_events += delta.malformed_events;
      s.unknown_parents += delta.unknown_parents;
      s.blocks_stored += delta.blocks_stored;
      s.blocks_removed += delta.blocks_removed;
    });
  }

  // Asks the replay socket for the batches from `from` on and applies them
  // in order. True when the first batch it sent was `from` (nothing lost)
  // and every batch decoded.
  bool Replay(uint64_t from) {
    if (spec.replay.empty()) return false;
    Count([](VllmSourceStats& s) { s.replays++; });
    zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::rcvtimeo, 2000);
    dealer.set(zmq::sockopt::maxmsgsize, kMaxMessageBytes);
    dealer.connect(spec.replay);
    uint8_t seq8[8];
    for (int i = 0; i < 8; ++i) seq8[i] = static_cast<uint8_t>(from >> (56 - 8 * i));
    std::array<zmq::const_buffer, 2> req = {zmq::buffer(seq8, 0), zmq::buffer(seq8, 8)};
    if (!zmq::send_multipart(dealer, req)) return false;
    bool complete = true, first = true;
    // A peer that never ends its reply is not waited for past this.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      if (stop || std::chrono::steady_clock::now() > deadline) return false;
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(dealer, std::back_inserter(parts))) return false;  // timed out
      // [empty, topic, seq, payload] (vLLM 0.26+) or [empty, seq, payload].
      if (!parts.empty() && parts[0].size() == 0) parts.erase(parts.begin());
      if (parts.size() == 3) parts.erase(parts.begin());
      if (parts.size() != 2 || parts[0].size() != 8) {
        Count([](VllmSourceStats& s) { s.malformed++; });
        return false;
      }
      const uint64_t seq = BigEndian64(parts[0]);
      if (seq == kEndSeq) return complete && !first;
      // The buffer no longer holds `from` (from 0: everything it holds will do).
      if (first && seq != from && from != 0) complete = false;
      first = false;
      if (!complete || (last && seq <= *last)) continue;
      auto batch = DecodeVllmBatch(
          absl::string_view(static_cast<const char*>(parts[1].data()), parts[1].size()));
      if (!batch.ok()) {
        Count([](VllmSourceStats& s) { s.malformed++; });
        complete = false;
        continue;
      }
      Apply(*batch);
      last = seq;
    }
  }

  // Forgets the engine's blocks, then rebuilds them from its replay buffer.
  void Resync(const std::string& why) {
    Count([](VllmSourceStats& s) { s.resyncs++; });
    Log("router", "vLLM source ", spec.id, ": resync (", why, ")");
    chain.Clear();
    SendCleared();
    const std::optional<uint64_t> before = last;
    last.reset();
    if (!Replay(0) && !last) last = before;
  }

  void Run() {
    Register();
    zmq::socket_t sub(ctx, zmq::socket_type::sub);
    sub.set(zmq::sockopt::linger, 0);
    sub.set(zmq::sockopt::subscribe, spec.topic);
    sub.set(zmq::sockopt::maxmsgsize, kMaxMessageBytes);
    PeerWatch w(&peer_lost);
    w.init(sub, absl::StrCat("inproc://kvtier-vllm-watch-", ++watch_ids), ZMQ_EVENT_DISCONNECTED);
    watch = &w;
    struct Unwatch {
      Impl* impl;
      PeerWatch* w;
      ~Unwatch() {
        impl->watch = nullptr;
        w->abort();
      }
    } unwatch{this, &w};
    sub.connect(spec.events);
    // What the engine published before we subscribed.
    if (!spec.replay.empty()) Replay(0);
    auto next_beat = std::chrono::steady_clock::now();
    while (!stop) {
      if (std::chrono::steady_clock::now() >= next_beat) {
        SourceLoad beat;
        {
          std::lock_guard lk(mu);
          beat = load;
        }
        Deliver(beat);
        next_beat = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      }
      zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
      w.check_event(0);
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(sub, std::back_inserter(parts), zmq::recv_flags::dontwait)) continue;
      OnMessage(parts);
    }
  }

  void OnMessage(std::vector<zmq::message_t>& parts) {
    if (parts.size() != 3 || parts[1].size() != 8) {
      Count([](VllmSourceStats& s) { s.malformed++; });
      Resync(absl::StrCat("a message of ", parts.size(), " frames"));
      return;
    }
    const uint64_t seq = BigEndian64(parts[1]);
    if (last && seq <= *last && watch != nullptr) {
      while (watch->check_event(0)) {  // a disconnect not yet read
      }
    }
    const bool reconnected = peer_lost.exchange(false);
    if (last && seq <= *last) {
      // The engine restarted (its sequence starts again): seen as a
      // sequence back at 0, one after the connection dropped, or one too
      // far behind to be a stale duplicate.
      if (seq == 0 || reconnected || *last - seq > kRestartLag) {
        Count([](VllmSourceStats& s) { s.restarts++; });
        Log("router", "vLLM source ", spec.id, " restarted; its blocks are cleared");
        chain.Clear();
        Register();
        last.reset();
        // What the new engine published before this message.
        if (seq > 0) Replay(0);
        if (last && seq <= *last) return;  // the replay covered it
      } else {
        Count([](VllmSourceStats& s) { s.out_of_order++; });
        return;
      }
    }
    if (last && seq > *last + 1) {
      Count([](VllmSourceStats& s) { s.gaps++; });
      if (!Replay(*last + 1))
        Resync(absl::StrCat("sequence gap: expected ", *last + 1, ", got ", seq));
      if (last && seq <= *last) return;  // the replay covered it
    }
    auto batch = DecodeVllmBatch(
        absl::string_view(static_cast<const char*>(parts[2].data()), parts[2].size()));
    if (!batch.ok()) {
      Count([](VllmSourceStats& s) { s.malformed++; });
      Resync(absl::StrCat("batch ", seq, ": ", batch.status().message()));
      return;
    }
    Apply(*batch);
    last = seq;
  }
};

VllmEventSource::VllmEventSource(VllmSourceSpec spec, RouterCore* core)
    : spec_(spec), impl_(std::make_unique<Impl>(std::move(spec), core)) {
  thread_ = std::thread([this] {
    while (!impl_->stop) {
      try {
        impl_->Run();
      } catch (const std::exception& e) {
        Log("router", "vLLM source ", spec_.id, ": ", e.what(), "; retrying in 1 s");
        for (int i = 0; i < 10 && !impl_->stop; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
    }
  });
}

VllmEventSource::~VllmEventSource() {
  impl_->stop = true;
  thread_.join();
}

void VllmEventSource::SetLoad(const SourceLoad& load, bool tell_now) {
  {
    std::lock_guard lk(impl_->mu);
    impl_->load = load;
  }
  if (!tell_now) return;
  // Not registered (or expired meanwhile): the next heartbeat carries it.
  if (!impl_->registered) return;
  std::vector<RouterCommand> ignored;
  (void)impl_->core->Handle(impl_->spec.id, SourceMessage(load), &ignored);
}

VllmSourceStats VllmEventSource::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->stats;
}

}  // namespace kvtier::router
