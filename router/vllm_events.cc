#include "router/vllm_events.h"

#include <msgpack.h>

#include <chrono>
#include <mutex>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "common/rpc/proto_convert.h"
#include "router/router_core.h"

namespace kvtier::router {

// ---------------------------------------------------------------------------
// Specs

absl::StatusOr<std::vector<VllmSourceSpec>> ParseVllmSources(absl::string_view text) {
  std::vector<VllmSourceSpec> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("vLLM sources, line ", line_no, ": ", why));
    };
    VllmSourceSpec s;
    for (absl::string_view kv : absl::StrSplit(line, ',')) {
      kv = absl::StripAsciiWhitespace(kv);
      const size_t eq = kv.find('=');
      if (eq == absl::string_view::npos) return bad(absl::StrCat("\"", kv, "\" is not key=value"));
      const absl::string_view key = kv.substr(0, eq), value = kv.substr(eq + 1);
      if (key == "id") {
        s.id = std::string(value);
      } else if (key == "endpoint") {
        s.endpoint = std::string(value);
      } else if (key == "events") {
        s.events = std::string(value);
      } else if (key == "replay") {
        s.replay = std::string(value);
      } else if (key == "topic") {
        s.topic = std::string(value);
      } else if (key == "namespace") {
        if (value.size() != 16 || !absl::SimpleHexAtoi(value, &s.namespace_id) ||
            s.namespace_id == 0) {
          return bad(absl::StrCat("namespace \"", value, "\" must be 16 hex digits, not all 0"));
        }
      } else if (key == "block-tokens") {
        if (!absl::SimpleAtoi(value, &s.block_tokens) || s.block_tokens < limits::kMinBlockTokens ||
            s.block_tokens > limits::kMaxBlockTokens) {
          return bad(absl::StrCat("block-tokens \"", value, "\" must be ", limits::kMinBlockTokens,
                                  "..", limits::kMaxBlockTokens));
        }
      } else {
        return bad(
            absl::StrCat("unknown key \"", key,
                         "\" (id, endpoint, events, replay, topic, namespace, block-tokens)"));
      }
    }
    auto zmq_url = [](const std::string& u) {
      return u.rfind("tcp://", 0) == 0 || u.rfind("ipc://", 0) == 0 || u.rfind("inproc://", 0) == 0;
    };
    if (s.id.empty() || s.id.size() > 256) return bad("id must be 1..256 bytes");
    if (s.endpoint.empty() || s.endpoint.size() > 256) return bad("endpoint must be 1..256 bytes");
    if (!zmq_url(s.events)) return bad("events must be a tcp://, ipc:// or inproc:// endpoint");
    if (!s.replay.empty() && !zmq_url(s.replay)) {
      return bad("replay must be a tcp://, ipc:// or inproc:// endpoint");
    }
    if (s.namespace_id == 0) return bad("namespace is missing");
    if (s.block_tokens == 0) return bad("block-tokens is missing");
    for (const auto& o : out) {
      if (o.id == s.id) return bad(absl::StrCat("id \"", s.id, "\" is used twice"));
    }
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Decoding

namespace {

constexpr size_t kMaxBatchEvents = 1 << 20;
constexpr size_t kMaxEventTokens = 1 << 22;

using Obj = msgpack_object;

absl::string_view Str(const Obj& o) {
  return o.type == MSGPACK_OBJECT_STR ? absl::string_view(o.via.str.ptr, o.via.str.size)
                                      : absl::string_view();
}
bool IsNil(const Obj* o) { return o == nullptr || o->type == MSGPACK_OBJECT_NIL; }

absl::StatusOr<uint64_t> Hash(const Obj& o) {
  switch (o.type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
      return o.via.u64;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
      return static_cast<uint64_t>(o.via.i64);
    case MSGPACK_OBJECT_BIN: {
      uint64_t v = 0;
      const size_t n = o.via.bin.size, from = n > 8 ? n - 8 : 0;
      for (size_t i = from; i < n; ++i) {
        v = (v << 8) | static_cast<uint8_t>(o.via.bin.ptr[i]);
      }
      if (n == 0) return absl::InvalidArgumentError("a block hash is empty bytes");
      return v;
    }
    default:
      return absl::InvalidArgumentError("a block hash is neither an integer nor bytes");
  }
}

absl::Status Hashes(const Obj* o, std::vector<uint64_t>* out) {
  if (o == nullptr || o->type != MSGPACK_OBJECT_ARRAY) {
    return absl::InvalidArgumentError("block_hashes is not an array");
  }
  if (o->via.array.size > kMaxEventHashes) {
    return absl::InvalidArgumentError(absl::StrCat("block_hashes has ", o->via.array.size,
                                                   " entries (at most ", kMaxEventHashes, ")"));
  }
  for (uint32_t i = 0; i < o->via.array.size; ++i) {
    auto h = Hash(o->via.array.ptr[i]);
    if (!h.ok()) return h.status();
    out->push_back(*h);
  }
  return absl::OkStatus();
}

// The fields of one event, by name, from either encoding.
struct Fields {
  absl::string_view tag;
  const Obj* hashes = nullptr;
  const Obj* parent = nullptr;
  const Obj* tokens = nullptr;
  const Obj* block_size = nullptr;
  const Obj* lora_id = nullptr;
  const Obj* medium = nullptr;
  const Obj* lora_name = nullptr;
  const Obj* extra_keys = nullptr;
  const Obj* group_idx = nullptr;
  const Obj* spec_kind = nullptr;
};

absl::StatusOr<Fields> ReadFields(const Obj& e) {
  Fields f;
  if (e.type == MSGPACK_OBJECT_ARRAY) {
    const auto& a = e.via.array;
    if (a.size == 0) return absl::InvalidArgumentError("an event is an empty array");
    f.tag = Str(a.ptr[0]);
    auto at = [&](uint32_t i) -> const Obj* { return i < a.size ? &a.ptr[i] : nullptr; };
    if (f.tag == "BlockStored") {
      f.hashes = at(1), f.parent = at(2), f.tokens = at(3), f.block_size = at(4);
      f.lora_id = at(5), f.medium = at(6), f.lora_name = at(7), f.extra_keys = at(8);
      f.group_idx = at(9), f.spec_kind = at(10);
    } else if (f.tag == "BlockRemoved") {
      f.hashes = at(1), f.medium = at(2), f.group_idx = at(3);
    }
  } else if (e.type == MSGPACK_OBJECT_MAP) {
    for (uint32_t i = 0; i < e.via.map.size; ++i) {
      const auto& kv = e.via.map.ptr[i];
      const absl::string_view k = Str(kv.key);
      const Obj* v = &kv.val;
      if (k == "type")
        f.tag = Str(*v);
      else if (k == "block_hashes")
        f.hashes = v;
      else if (k == "parent_block_hash")
        f.parent = v;
      else if (k == "token_ids")
        f.tokens = v;
      else if (k == "block_size")
        f.block_size = v;
      else if (k == "lora_id")
        f.lora_id = v;
      else if (k == "medium")
        f.medium = v;
      else if (k == "lora_name")
        f.lora_name = v;
      else if (k == "extra_keys")
        f.extra_keys = v;
      else if (k == "group_idx")
        f.group_idx = v;
      else if (k == "kv_cache_spec_kind")
        f.spec_kind = v;
    }
  } else {
    return absl::InvalidArgumentError("an event is neither an array nor a map");
  }
  if (f.tag.empty()) return absl::InvalidArgumentError("an event has no type tag");
  return f;
}

// Why the router cannot map an event's blocks to kvtier's, or "".
std::string SkipReason(const Fields& f) {
  if (!IsNil(f.medium) && Str(*f.medium) != "GPU") {
    return absl::StrCat("medium ", Str(*f.medium));
  }
  if (!IsNil(f.group_idx) &&
      !(f.group_idx->type == MSGPACK_OBJECT_POSITIVE_INTEGER && f.group_idx->via.u64 == 0)) {
    return "a KV cache group other than 0";
  }
  if (!IsNil(f.spec_kind) && Str(*f.spec_kind) != "full_attention" &&
      Str(*f.spec_kind) != "mla_attention") {
    return absl::StrCat("attention kind ", Str(*f.spec_kind));
  }
  if (!IsNil(f.lora_id) || !IsNil(f.lora_name)) return "a LoRA adapter";
  if (!IsNil(f.extra_keys)) {
    if (f.extra_keys->type != MSGPACK_OBJECT_ARRAY) return "extra keys";
    for (uint32_t i = 0; i < f.extra_keys->via.array.size; ++i) {
      if (f.extra_keys->via.array.ptr[i].type != MSGPACK_OBJECT_NIL) {
        return "extra keys (a cache salt or multimodal inputs)";
      }
    }
  }
  return "";
}

// One event. Never fails: an event the router cannot use (another medium,
// KV group, attention kind, a LoRA adapter or extra keys, a type it does
// not know, or fields of the wrong shape) comes back with skip_reason set,
// so the rest of its batch still applies. Fields are checked only on the
// events that are applied (vLLM's CPU offloading reports its blocks with
// block_size 0 and no tokens: skipped for their medium first).
VllmEvent ReadEvent(const Obj& o) {
  VllmEvent e;
  auto skip = [&](std::string why) {
    e.skip_reason = std::move(why);
    return e;
  };
  auto f = ReadFields(o);
  if (!f.ok()) return skip(absl::StrCat("malformed: ", f.status().message()));
  if (f->tag == "AllBlocksCleared") {
    e.kind = VllmEvent::kCleared;
    return e;
  }
  if (f->tag != "BlockStored" && f->tag != "BlockRemoved") {
    return skip(absl::StrCat("unknown event type \"", f->tag, "\""));
  }
  e.kind = f->tag == "BlockStored" ? VllmEvent::kStored : VllmEvent::kRemoved;
  if (auto s = Hashes(f->hashes, &e.hashes); !s.ok()) {
    e.hashes.clear();
    return skip(absl::StrCat("malformed: ", s.message()));
  }
  if (auto why = SkipReason(*f); !why.empty()) return skip(std::move(why));
  if (e.kind == VllmEvent::kRemoved) return e;
  if (!IsNil(f->parent)) {
    auto p = Hash(*f->parent);
    if (!p.ok()) return skip(absl::StrCat("malformed: parent_block_hash: ", p.status().message()));
    e.parent = *p;
  }
  if (f->block_size == nullptr || f->block_size->type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
      f->block_size->via.u64 < limits::kMinBlockTokens ||
      f->block_size->via.u64 > limits::kMaxBlockTokens) {
    return skip(absl::StrCat("malformed: block_size is not an integer in ", limits::kMinBlockTokens,
                             "..", limits::kMaxBlockTokens));
  }
  e.block_size = static_cast<uint32_t>(f->block_size->via.u64);
  if (f->tokens == nullptr || f->tokens->type != MSGPACK_OBJECT_ARRAY ||
      f->tokens->via.array.size > kMaxEventTokens) {
    return skip("malformed: token_ids is not an array (of at most 4M ids)");
  }
  e.token_ids.reserve(f->tokens->via.array.size);
  for (uint32_t i = 0; i < f->tokens->via.array.size; ++i) {
    const Obj& t = f->tokens->via.array.ptr[i];
    if (t.type != MSGPACK_OBJECT_POSITIVE_INTEGER || t.via.u64 > UINT32_MAX) {
      e.token_ids.clear();
      return skip("malformed: a token id is not an integer in 0..2^32-1");
    }
    e.token_ids.push_back(static_cast<uint32_t>(t.via.u64));
  }
  if (e.token_ids.size() != uint64_t{e.block_size} * e.hashes.size()) {
    return skip(absl::StrCat("malformed: BlockStored has ", e.token_ids.size(), " token ids for ",
                             e.hashes.size(), " blocks of ", e.block_size));
  }
  return e;
}

// Walks the msgpack value's headers without building it: every declared
// array, map, string or binary must fit in the bytes that remain (msgpack-c
// allocates a container's declared size before reading it, so a 5-byte
// header could ask for gigabytes), and nesting stays under 32 levels.
absl::Status CheckShape(absl::string_view in) {
  const auto* p = reinterpret_cast<const uint8_t*>(in.data());
  size_t pos = 0;
  const size_t n = in.size();
  std::vector<uint64_t> pending = {1};  // items still to read, per open container
  auto need = [&](uint64_t bytes) { return bytes <= n - pos; };
  auto be = [&](int width) {
    uint64_t v = 0;
    for (int i = 0; i < width; ++i) v = (v << 8) | p[pos + i];
    pos += width;
    return v;
  };
  auto fail = [] { return absl::InvalidArgumentError("the payload is not one msgpack value"); };
  while (!pending.empty()) {
    if (pending.back() == 0) {
      pending.pop_back();
      continue;
    }
    pending.back()--;
    if (!need(1)) return fail();
    const uint8_t b = p[pos++];
    uint64_t skip = 0, items = 0;
    bool container = false;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      skip = 0;
    } else if ((b & 0xf0) == 0x80 || (b & 0xf0) == 0x90) {
      container = true;
      items = (b & 0x0f) * ((b & 0xf0) == 0x80 ? 2 : 1);
    } else if ((b & 0xe0) == 0xa0) {
      skip = b & 0x1f;
    } else {
      switch (b) {
        case 0xc4:
        case 0xd9:
          if (!need(1)) return fail();
          skip = be(1);
          break;
        case 0xc5:
        case 0xda:
          if (!need(2)) return fail();
          skip = be(2);
          break;
        case 0xc6:
        case 0xdb:
          if (!need(4)) return fail();
          skip = be(4);
          break;
        case 0xc7:
          if (!need(1)) return fail();
          skip = be(1) + 1;
          break;
        case 0xc8:
          if (!need(2)) return fail();
          skip = be(2) + 1;
          break;
        case 0xc9:
          if (!need(4)) return fail();
          skip = be(4) + 1;
          break;
        case 0xca:
          skip = 4;
          break;
        case 0xcb:
          skip = 8;
          break;
        case 0xcc:
        case 0xd0:
          skip = 1;
          break;
        case 0xcd:
        case 0xd1:
          skip = 2;
          break;
        case 0xce:
        case 0xd2:
          skip = 4;
          break;
        case 0xcf:
        case 0xd3:
          skip = 8;
          break;
        case 0xd4:
          skip = 2;
          break;
        case 0xd5:
          skip = 3;
          break;
        case 0xd6:
          skip = 5;
          break;
        case 0xd7:
          skip = 9;
          break;
        case 0xd8:
          skip = 17;
          break;
        case 0xdc:
          if (!need(2)) return fail();
          container = true;
          items = be(2);
          break;
        case 0xdd:
          if (!need(4)) return fail();
          container = true;
          items = be(4);
          break;
        case 0xde:
          if (!need(2)) return fail();
          container = true;
          items = 2 * be(2);
          break;
        case 0xdf:
          if (!need(4)) return fail();
          container = true;
          items = 2 * be(4);
          break;
        default:
          return fail();  // 0xc1: never used
      }
    }
    if (container) {
      if (!need(items)) return fail();  // each item takes a byte at least
      if (pending.size() >= 32)
        return absl::InvalidArgumentError("the payload nests over 32 levels");
      pending.push_back(items);
    } else {
      if (!need(skip)) return fail();
      pos += skip;
    }
  }
  if (pos != n) return absl::InvalidArgumentError("the payload has bytes after its msgpack value");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<VllmBatch> DecodeVllmBatch(absl::string_view payload) {
  if (auto s = CheckShape(payload); !s.ok()) return s;
  msgpack_unpacked u;
  msgpack_unpacked_init(&u);
  struct Done {
    msgpack_unpacked* u;
    ~Done() { msgpack_unpacked_destroy(u); }
  } done{&u};
  size_t off = 0;
  if (msgpack_unpack_next(&u, payload.data(), payload.size(), &off) != MSGPACK_UNPACK_SUCCESS) {
    return absl::InvalidArgumentError("the payload is not one msgpack value");
  }
  if (off != payload.size()) {
    return absl::InvalidArgumentError("the payload has bytes after its msgpack value");
  }
  const Obj& top = u.data;
  const Obj* ts = nullptr;
  const Obj* events = nullptr;
  if (top.type == MSGPACK_OBJECT_ARRAY && top.via.array.size >= 2) {
    ts = &top.via.array.ptr[0];
    events = &top.via.array.ptr[1];
  } else if (top.type == MSGPACK_OBJECT_MAP) {  // an unreleased variant: tolerated
    for (uint32_t i = 0; i < top.via.map.size; ++i) {
      const absl::string_view k = Str(top.via.map.ptr[i].key);
      if (k == "ts") ts = &top.via.map.ptr[i].val;
      if (k == "events") events = &top.via.map.ptr[i].val;
    }
  }
  if (events == nullptr || events->type != MSGPACK_OBJECT_ARRAY) {
    return absl::InvalidArgumentError("the payload is not a KVEventBatch [ts, events, ...]");
  }
  if (events->via.array.size > kMaxBatchEvents) {
    return absl::InvalidArgumentError("the batch has over 1M events");
  }
  VllmBatch b;
  if (ts != nullptr) {
    if (ts->type == MSGPACK_OBJECT_FLOAT64 || ts->type == MSGPACK_OBJECT_FLOAT32)
      b.ts = ts->via.f64;
    else if (ts->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
      b.ts = static_cast<double>(ts->via.u64);
  }
  for (uint32_t i = 0; i < events->via.array.size; ++i) {
    b.events.push_back(ReadEvent(events->via.array.ptr[i]));
  }
  return b;
}

// ---------------------------------------------------------------------------
// Hash mapping

std::vector<BlockHash> VllmChainMap::Stored(const VllmEvent& e, VllmSourceStats* stats) {
  std::vector<BlockHash> out;
  // An event the decoder marked skipped, or one built by hand without a
  // block's worth of tokens per hash, maps nothing (its tokens are not there
  // to hash).
  if (!e.skip_reason.empty() || e.block_size != block_tokens_ ||
      e.token_ids.size() != size_t{block_tokens_} * e.hashes.size()) {
    stats->skipped += e.hashes.size();
    return out;
  }
  BlockHash prev{ns_, 0};  // the root of a chain (common/block_key.h)
  if (e.parent) {
    auto it = map_.find(*e.parent);
    if (it == map_.end()) {
      stats->unknown_parents += e.hashes.size();
      return out;
    }
    prev = it->second;
  }
  std::span<const uint32_t> tokens(e.token_ids);
  for (size_t i = 0; i < e.hashes.size(); ++i) {
    prev = NextBlockHash(prev, tokens.subspan(i * block_tokens_, block_tokens_));
    map_[e.hashes[i]] = prev;
    out.push_back(prev);
  }
  return out;
}

std::vector<BlockHash> VllmChainMap::Removed(const VllmEvent& e, VllmSourceStats* stats) {
  std::vector<BlockHash> out;
  for (uint64_t h : e.hashes) {
    auto it = map_.find(h);
    if (it == map_.end()) continue;  // never mapped (skipped or before a resync)
    out.push_back(it->second);
    map_.erase(it);
  }
  (void)stats;
  return out;
}

// ---------------------------------------------------------------------------
// The subscriber

namespace {

constexpr uint64_t kEndSeq = ~uint64_t{0};
// Larger frames are dropped by ZeroMQ before they reach the decoder.
constexpr int64_t kMaxMessageBytes = int64_t{256} << 20;
// A message this much older than the last applied is an engine that
// restarted and whose first messages were missed, not a stale duplicate
// (those are at most a subscriber queue, ZeroMQ's 1,000 by default, behind).
constexpr uint64_t kRestartLag = 10000;

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
  std::optional<uint64_t> last;  // vLLM's last applied sequence number
  bool registered = false;       // the router took the last hello

  Impl(VllmSourceSpec s, RouterCore* c)
      : spec(std::move(s)), core(c), chain(spec.namespace_id, spec.block_tokens) {}

  template <class F>
  void Count(F f) {
    std::lock_guard lk(mu);
    f(stats);
  }

  void Deliver(const v1::SourceMessage& m) {
    if (!registered) {
      // Out of routing since a refused hello: try again. Its snapshot
      // carries every block mapped meanwhile, this message's included.
      Register();
      return;
    }
    std::vector<v1::RouterCommand> cmds;
    auto s = core->Handle(spec.id, m, &cmds);
    if (absl::IsNotFound(s)) {  // expired meanwhile: register afresh
      Register();
      return;
    }
    for (const auto& c : cmds) {
      if (c.has_snapshot_request()) SendSnapshot();
    }
  }

  // What the router should believe the engine holds: every mapped block.
  void SendSnapshot() {
    v1::SourceMessage m;
    auto* snap = m.mutable_snapshot();
    snap->set_seq(router_seq);
    snap->set_namespace_id(spec.namespace_id);
    size_t in_chunk = 0;
    std::vector<v1::RouterCommand> cmds;
    auto flush = [&](bool last_chunk) {
      snap->set_last(last_chunk);
      if (auto s = core->Handle(spec.id, m, &cmds); !s.ok() && registered) {
        Count([](VllmSourceStats& st) { st.snapshot_failures++; });
        Log("router", "vLLM source ", spec.id, ": the router refused its snapshot (", s.message(),
            "); registering again");
        registered = false;  // the next delivery registers again
      }
      snap->clear_hashes();
      in_chunk = 0;
    };
    chain.ForEach([&](const BlockHash& h) {
      ToProto(h, snap->add_hashes());
      if (++in_chunk == kMaxEventHashes) flush(false);
    });
    flush(true);
  }

  void Register() {
    v1::Hello h;
    h.set_source_id(spec.id);
    h.set_kind(v1::SOURCE_WORKER);
    h.set_endpoint(spec.endpoint);
    h.set_namespace_id(spec.namespace_id);
    h.set_block_tokens(spec.block_tokens);
    h.set_epoch(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count()));
    std::vector<v1::RouterCommand> cmds;
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

  void SendBlocks(bool stored, const std::vector<BlockHash>& hashes) {
    for (size_t from = 0; from < hashes.size(); from += kMaxEventHashes) {
      v1::SourceMessage m;
      auto* e = m.mutable_event();
      e->set_seq(++router_seq);
      auto* list = stored ? e->mutable_stored() : nullptr;
      auto* gone = stored ? nullptr : e->mutable_removed();
      const size_t to = std::min(hashes.size(), from + kMaxEventHashes);
      for (size_t i = from; i < to; ++i) {
        ToProto(hashes[i], stored ? list->add_hashes() : gone->add_hashes());
      }
      if (stored)
        list->set_namespace_id(spec.namespace_id);
      else
        gone->set_namespace_id(spec.namespace_id);
      Deliver(m);
    }
  }

  void SendCleared() {
    v1::SourceMessage m;
    m.mutable_event()->set_seq(++router_seq);
    m.mutable_event()->mutable_cleared();
    Deliver(m);
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
      if (e.kind == VllmEvent::kStored) {
        auto hs = chain.Stored(e, &delta);
        delta.blocks_stored += hs.size();
        if (!hs.empty()) SendBlocks(true, hs);
      } else {
        auto hs = chain.Removed(e, &delta);
        delta.blocks_removed += hs.size();
        if (!hs.empty()) SendBlocks(false, hs);
      }
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
    sub.connect(spec.events);
    // What the engine published before we subscribed.
    if (!spec.replay.empty()) Replay(0);
    auto next_beat = std::chrono::steady_clock::now();
    while (!stop) {
      if (std::chrono::steady_clock::now() >= next_beat) {
        v1::SourceMessage hb;
        hb.mutable_heartbeat();
        Deliver(hb);
        next_beat = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      }
      zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
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
    if (last && seq <= *last) {
      if (seq == 0 ||
          *last - seq > kRestartLag) {  // the engine restarted: its sequence starts again
        Count([](VllmSourceStats& s) { s.restarts++; });
        Log("router", "vLLM source ", spec.id, " restarted; its blocks are cleared");
        chain.Clear();
        Register();
        last.reset();
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

VllmSourceStats VllmEventSource::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->stats;
}

}  // namespace kvtier::router
