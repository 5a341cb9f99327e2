#include "router/vllm_batch.h"

#include <msgpack.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/block_key.h"
#include "common/limits.h"

namespace kvtier::router {

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
  if (o->via.array.size > limits::kMaxEventHashes) {
    return absl::InvalidArgumentError(absl::StrCat("block_hashes has ", o->via.array.size,
                                                   " entries (at most ", limits::kMaxEventHashes,
                                                   ")"));
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
  const Obj* locality = nullptr;
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
      f.group_idx = at(9), f.spec_kind = at(10), f.locality = at(12);
    } else if (f.tag == "BlockRemoved") {
      f.hashes = at(1), f.medium = at(2), f.group_idx = at(3), f.locality = at(4);
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
      else if (k == "locality")
        f.locality = v;
    }
  } else {
    return absl::InvalidArgumentError("an event is neither an array nor a map");
  }
  if (f.tag.empty()) return absl::InvalidArgumentError("an event has no type tag");
  return f;
}

// Why the router cannot map an event's blocks to kvtier's, or "". Reads
// the medium, group and (for BlockStored) the chain's variant into `e`.
std::string Classify(const Fields& f, VllmEvent* e) {
  if (!IsNil(f.medium)) {
    if (f.medium->type != MSGPACK_OBJECT_STR || Str(*f.medium).empty()) {
      return "malformed: medium is not a name";
    }
    e->medium = std::string(Str(*f.medium));
  }
  if (!IsNil(f.group_idx)) {
    if (f.group_idx->type != MSGPACK_OBJECT_POSITIVE_INTEGER || f.group_idx->via.u64 > 1024) {
      return "malformed: group_idx is not an integer in 0..1024";
    }
    e->group = static_cast<uint32_t>(f.group_idx->via.u64);
  }
  if (!IsNil(f.locality) && Str(*f.locality) == "REMOTE") return "blocks remote to the engine";
  if (!IsNil(f.spec_kind) && Str(*f.spec_kind) != "full_attention" &&
      Str(*f.spec_kind) != "mla_attention") {
    return absl::StrCat("attention kind ", Str(*f.spec_kind));
  }
  if (e->kind != VllmEvent::kStored) return "";
  absl::string_view lora;
  if (!IsNil(f.lora_name)) {
    if (f.lora_name->type != MSGPACK_OBJECT_STR) return "malformed: lora_name is not a string";
    lora = Str(*f.lora_name);
  } else if (!IsNil(f.lora_id)) {
    return "a LoRA adapter with an id and no name";
  }
  // extra_keys: one entry per block, nil or the block's keys untagged, in
  // vLLM's order: the adapter's name (when lora_name is set), multimodal
  // (identifier, offset) pairs, the cache salt (a chain's first block
  // only), prompt-embedding digests.
  absl::string_view salt;
  if (!IsNil(f.extra_keys)) {
    if (f.extra_keys->type != MSGPACK_OBJECT_ARRAY) return "malformed: extra_keys is not an array";
    for (uint32_t i = 0; i < f.extra_keys->via.array.size; ++i) {
      const Obj& keys = f.extra_keys->via.array.ptr[i];
      if (keys.type == MSGPACK_OBJECT_NIL) continue;
      if (keys.type != MSGPACK_OBJECT_ARRAY) return "malformed: a block's extra keys";
      uint32_t k = 0;
      if (!lora.empty() && keys.via.array.size > 0 && Str(keys.via.array.ptr[0]) == lora) k = 1;
      for (; k < keys.via.array.size; ++k) {
        const Obj& key = keys.via.array.ptr[k];
        if (key.type == MSGPACK_OBJECT_ARRAY) return "extra keys: multimodal inputs";
        if (key.type == MSGPACK_OBJECT_BIN) return "extra keys: prompt embeddings";
        if (key.type != MSGPACK_OBJECT_STR) return "malformed: an extra key";
        // A salt opens a request's chain: on its first block, parentless.
        if (i != 0 || !IsNil(f.parent) || !salt.empty()) {
          return "malformed: a cache salt past a chain's first block";
        }
        salt = Str(key);
      }
    }
  }
  e->variant = ChainVariant(std::string_view(lora.data(), lora.size()),
                            std::string_view(salt.data(), salt.size()));
  return "";
}

// One event. Never fails: an event the router cannot use (an attention
// kind other than full, multimodal or embedding keys, remote blocks, a
// type it does not know, or fields of the wrong shape) comes back with
// skip_reason set, so the rest of its batch still applies. vLLM's
// offloading tiers may report a block by hash alone (block_size 0, no
// tokens): by_hash.
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
  if (auto why = Classify(*f, &e); !why.empty()) return skip(std::move(why));
  if (e.kind == VllmEvent::kRemoved) return e;
  if (e.medium != "GPU" && f->block_size != nullptr &&
      f->block_size->type == MSGPACK_OBJECT_POSITIVE_INTEGER && f->block_size->via.u64 == 0 &&
      f->tokens != nullptr && f->tokens->type == MSGPACK_OBJECT_ARRAY &&
      f->tokens->via.array.size == 0) {
    e.by_hash = true;
    return e;
  }
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

}  // namespace kvtier::router
