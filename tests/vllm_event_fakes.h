// Test helpers for the router's vLLM KV-event subscriber: an encoder of
// vLLM 0.26+'s KVEventBatch (msgpack, events as maps), a fake engine's two
// ZeroMQ sockets (PUB and replay ROUTER) on loopback, and a fixture with a
// real RouterCore. Shared by tests/vllm_events_test.cc and
// tests/vllm_events_index_test.cc.
#pragma once

#include <gtest/gtest.h>
#include <msgpack.h>

#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "router/router_core.h"
#include "router/vllm_events.h"

namespace kvtier::router {

// A test encoder following vLLM 0.26+'s layout (map events in declaration
// order, the batch an array), with the msgpack-c packer.
inline std::string Encode(const std::function<void(msgpack_packer*)>& f) {
  msgpack_sbuffer sb;
  msgpack_sbuffer_init(&sb);
  msgpack_packer pk;
  msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
  f(&pk);
  std::string out(sb.data, sb.size);
  msgpack_sbuffer_destroy(&sb);
  return out;
}
inline void Key(msgpack_packer* pk, const std::string& s) {
  msgpack_pack_str(pk, s.size());
  msgpack_pack_str_body(pk, s.data(), s.size());
}
struct Ev {
  enum Kind { kStored, kRemoved, kCleared };
  Ev(Kind k, std::vector<uint64_t> h = {}, std::optional<uint64_t> p = std::nullopt,
     std::vector<uint32_t> t = {}, std::string lora = "")
      : kind(k),
        hashes(std::move(h)),
        parent(p),
        tokens(std::move(t)),
        lora_name(std::move(lora)) {}
  Kind kind;
  std::vector<uint64_t> hashes;
  std::optional<uint64_t> parent;
  std::vector<uint32_t> tokens;
  std::string lora_name;  // also the first extra key of every block, as vLLM writes it
  std::string salt;       // the first block's cache salt (an extra key)
  std::string medium = "GPU";
  uint32_t group = 0;
  std::string spec_kind = "full_attention";
  bool by_hash = false;  // an offloading tier's placeholder: block_size 0, no tokens
};
inline std::string Batch(const std::vector<Ev>& events, uint32_t block_size) {
  return Encode([&](msgpack_packer* pk) {
    msgpack_pack_array(pk, 3);
    msgpack_pack_double(pk, 1700000000.25);
    msgpack_pack_array(pk, events.size());
    for (const auto& e : events) {
      if (e.kind == Ev::kCleared) {
        msgpack_pack_map(pk, 1);
        Key(pk, "type");
        Key(pk, "AllBlocksCleared");
        continue;
      }
      const bool stored = e.kind == Ev::kStored;
      msgpack_pack_map(pk, stored ? 11 : 4);
      Key(pk, "type");
      Key(pk, stored ? "BlockStored" : "BlockRemoved");
      Key(pk, "block_hashes");
      msgpack_pack_array(pk, e.hashes.size());
      for (uint64_t h : e.hashes) msgpack_pack_uint64(pk, h);
      if (stored) {
        Key(pk, "parent_block_hash");
        e.parent ? msgpack_pack_uint64(pk, *e.parent) : msgpack_pack_nil(pk);
        Key(pk, "token_ids");
        msgpack_pack_array(pk, e.by_hash ? 0 : e.tokens.size());
        if (!e.by_hash) {
          for (uint32_t t : e.tokens) msgpack_pack_uint32(pk, t);
        }
        Key(pk, "block_size");
        msgpack_pack_uint32(pk, e.by_hash ? 0 : block_size);
        Key(pk, "lora_id");
        e.lora_name.empty() ? msgpack_pack_nil(pk) : msgpack_pack_uint32(pk, 1);
      }
      Key(pk, "medium");
      Key(pk, e.medium);
      if (stored) {
        Key(pk, "lora_name");
        if (e.lora_name.empty()) {
          msgpack_pack_nil(pk);
        } else {
          Key(pk, e.lora_name);
        }
        Key(pk, "extra_keys");
        msgpack_pack_array(pk, e.hashes.size());
        for (size_t i = 0; i < e.hashes.size(); ++i) {
          const bool salted = i == 0 && !e.salt.empty();
          const size_t n = (e.lora_name.empty() ? 0 : 1) + (salted ? 1 : 0);
          if (n == 0) {
            msgpack_pack_nil(pk);
            continue;
          }
          msgpack_pack_array(pk, n);
          if (!e.lora_name.empty()) Key(pk, e.lora_name);
          if (salted) Key(pk, e.salt);
        }
      }
      Key(pk, "group_idx");
      msgpack_pack_uint32(pk, e.group);
      if (stored) {
        Key(pk, "kv_cache_spec_kind");
        Key(pk, e.spec_kind);
      }
    }
    msgpack_pack_uint32(pk, 0);
  });
}

constexpr uint64_t kNs = 0x00c0ffee00c0ffee;
constexpr uint32_t kBt = 4;
inline std::vector<uint32_t> Tokens(uint32_t from, uint32_t n) {
  std::vector<uint32_t> t;
  for (uint32_t i = 0; i < n; ++i) t.push_back(from + i);
  return t;
}
// A decoded event built by hand.
inline VllmEvent Made(VllmEvent::Kind kind, std::vector<uint64_t> hashes,
                      std::optional<uint64_t> parent, std::vector<uint32_t> tokens,
                      uint32_t block_size, std::string skip_reason = "") {
  VllmEvent e;
  e.kind = kind;
  e.hashes = std::move(hashes);
  e.parent = parent;
  e.token_ids = std::move(tokens);
  e.block_size = block_size;
  e.skip_reason = std::move(skip_reason);
  return e;
}

// A vLLM engine's two sockets: PUB for the live stream and ROUTER for
// replay, answering from every batch it published (vLLM 0.26+ framing).
class FakeEngine {
 public:
  // Bound to ports of its own, or to another engine's (a restart in its place).
  explicit FakeEngine(const std::string& events = "tcp://127.0.0.1:*",
                      const std::string& replay = "tcp://127.0.0.1:*")
      : pub_(ctx_, zmq::socket_type::pub), router_(ctx_, zmq::socket_type::router) {
    pub_.set(zmq::sockopt::linger, 0);
    router_.set(zmq::sockopt::linger, 0);
    pub_.bind(events);
    router_.bind(replay);
    events_ = pub_.get(zmq::sockopt::last_endpoint);
    replay_ = router_.get(zmq::sockopt::last_endpoint);
    replayer_ = std::thread([this] { Serve(); });
  }
  ~FakeEngine() {
    stop_ = true;
    replayer_.join();
  }
  // Records the batch for replay; sends it live unless `drop` (a message
  // the subscriber never sees).
  void Publish(uint64_t seq, const std::string& payload, bool drop = false) {
    {
      std::lock_guard lk(mu_);
      buffer_.emplace_back(seq, payload);
    }
    if (!drop) SendLive({"", Seq(seq), payload});
  }
  void SendLive(const std::vector<std::string>& frames) {
    std::vector<zmq::const_buffer> parts;
    for (const auto& f : frames) parts.push_back(zmq::buffer(f));
    std::lock_guard lk(pub_mu_);
    zmq::send_multipart(pub_, parts);
  }
  void ForgetBefore(uint64_t seq) {
    std::lock_guard lk(mu_);
    while (!buffer_.empty() && buffer_.front().first < seq) buffer_.pop_front();
  }
  void Restart() {
    std::lock_guard lk(mu_);
    buffer_.clear();
  }
  static std::string Seq(uint64_t s) {
    std::string b(8, '\0');
    for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(s >> (56 - 8 * i));
    return b;
  }
  const std::string& events() const { return events_; }
  const std::string& replay() const { return replay_; }
  std::atomic<int> replay_requests{0};

 private:
  void Serve() {
    while (!stop_) {
      zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(50));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> req;
      if (!zmq::recv_multipart(router_, std::back_inserter(req))) continue;
      if (req.size() != 3 || req[2].size() != 8) continue;  // as vLLM: ignored
      replay_requests++;
      uint64_t from = 0;
      for (int i = 0; i < 8; ++i)
        from = (from << 8) | static_cast<const uint8_t*>(req[2].data())[i];
      const std::string id = req[0].to_string();
      std::vector<std::pair<uint64_t, std::string>> items;
      {
        std::lock_guard lk(mu_);
        for (const auto& b : buffer_) {
          if (b.first >= from) items.push_back(b);
        }
      }
      auto reply = [&](const std::vector<std::string>& frames) {
        std::vector<zmq::const_buffer> parts = {zmq::buffer(id), zmq::buffer(id.data(), 0)};
        for (const auto& f : frames) parts.push_back(zmq::buffer(f));
        zmq::send_multipart(router_, parts);
      };
      for (const auto& [seq, payload] : items) reply({"", Seq(seq), payload});
      reply({"", Seq(~uint64_t{0}), ""});
    }
  }

  zmq::context_t ctx_{1};
  zmq::socket_t pub_, router_;
  std::mutex pub_mu_, mu_;
  std::string events_, replay_;
  std::deque<std::pair<uint64_t, std::string>> buffer_;
  std::atomic<bool> stop_{false};
  std::thread replayer_;
};

class VllmSubscriber : public ::testing::Test {
 protected:
  VllmSubscriber() : core_(RouterOptions{}) {}
  uint64_t Held() {
    for (const auto& s : core_.Sources()) {
      if (s.source_id == "vllm-0") return s.indexed_blocks;
    }
    return ~uint64_t{0};
  }
  // The route of tokens [from, from + n), a request of `variant` (ChainVariant);
  // a dry run unless `counted` (its load and pending blocks then stay on its worker).
  absl::StatusOr<RouteResult> RouteTokens(uint32_t tokens_from, uint32_t n, uint64_t variant = 0,
                                          bool counted = false) {
    const std::vector<uint32_t> tokens = Tokens(tokens_from, n);
    RouteQuery q;
    q.namespace_id = kNs;
    q.prompt = RouteQuery::Prompt::kTokens;
    q.tokens = tokens;
    q.variant = variant;
    q.dry_run = !counted;
    return core_.Route(q);
  }
  // The blocks of those tokens the router credits vllm-0's GPU with (a
  // counted route, as before RouteTokens was split out).
  uint32_t GpuHit(uint32_t tokens_from, uint32_t n, uint64_t variant = 0) {
    auto res = RouteTokens(tokens_from, n, variant, /*counted=*/true);
    return res.ok() && res->worker_id == "vllm-0" ? res->gpu_blocks : 0;
  }
  RouterCore core_;
};

}  // namespace kvtier::router
