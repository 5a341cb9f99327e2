// The C ABI over KvConnector. Every entry point that can fail runs its body
// through Call (WithConnector when it needs the handle): that is the one
// place where a C++ exception is stopped before it unwinds into C, and where
// the outcome becomes the thread's last status.
#include "worker/kvtier_worker.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/rpc/tls.h"
#include "worker/connector.h"

struct kvtier_connector {
  std::unique_ptr<kvtier::worker::KvConnector> impl;
};

namespace {

using kvtier::worker::KvConnector;

struct CodeName {
  kvtier_status status;
  absl::StatusCode code;
  const char* name;
};

// Indexed by value; the static_assert below keeps the C enum equal to absl's
// so that converting a code is a lookup, and the store's codes pass through.
constexpr CodeName kCodes[] = {
    {KVTIER_OK, absl::StatusCode::kOk, "OK"},
    {KVTIER_CANCELLED, absl::StatusCode::kCancelled, "CANCELLED"},
    {KVTIER_UNKNOWN, absl::StatusCode::kUnknown, "UNKNOWN"},
    {KVTIER_INVALID_ARGUMENT, absl::StatusCode::kInvalidArgument, "INVALID_ARGUMENT"},
    {KVTIER_DEADLINE_EXCEEDED, absl::StatusCode::kDeadlineExceeded, "DEADLINE_EXCEEDED"},
    {KVTIER_NOT_FOUND, absl::StatusCode::kNotFound, "NOT_FOUND"},
    {KVTIER_ALREADY_EXISTS, absl::StatusCode::kAlreadyExists, "ALREADY_EXISTS"},
    {KVTIER_PERMISSION_DENIED, absl::StatusCode::kPermissionDenied, "PERMISSION_DENIED"},
    {KVTIER_RESOURCE_EXHAUSTED, absl::StatusCode::kResourceExhausted, "RESOURCE_EXHAUSTED"},
    {KVTIER_FAILED_PRECONDITION, absl::StatusCode::kFailedPrecondition, "FAILED_PRECONDITION"},
    {KVTIER_ABORTED, absl::StatusCode::kAborted, "ABORTED"},
    {KVTIER_OUT_OF_RANGE, absl::StatusCode::kOutOfRange, "OUT_OF_RANGE"},
    {KVTIER_UNIMPLEMENTED, absl::StatusCode::kUnimplemented, "UNIMPLEMENTED"},
    {KVTIER_INTERNAL, absl::StatusCode::kInternal, "INTERNAL"},
    {KVTIER_UNAVAILABLE, absl::StatusCode::kUnavailable, "UNAVAILABLE"},
    {KVTIER_DATA_LOSS, absl::StatusCode::kDataLoss, "DATA_LOSS"},
    {KVTIER_UNAUTHENTICATED, absl::StatusCode::kUnauthenticated, "UNAUTHENTICATED"},
};

constexpr bool CodesLineUp() {
  for (size_t i = 0; i < std::size(kCodes); ++i) {
    if (static_cast<size_t>(kCodes[i].status) != i || static_cast<size_t>(kCodes[i].code) != i) {
      return false;
    }
  }
  return true;
}
static_assert(CodesLineUp(), "kvtier_status must equal absl::StatusCode value for value");

thread_local kvtier_status last_status = KVTIER_OK;
thread_local std::string last_error;

kvtier_status ToC(absl::StatusCode code) {
  const size_t v = static_cast<size_t>(code);
  // A code absl adds later is still reported as a failure.
  return v < std::size(kCodes) ? kCodes[v].status : KVTIER_UNKNOWN;
}

// noexcept: it also runs in Call's handlers, where a second exception (no
// memory for the message) must not escape; the code is recorded regardless.
void Record(kvtier_status status, absl::string_view message) noexcept {
  last_status = status;
  try {
    last_error.assign(message.data(), message.size());
  } catch (...) {
    last_error.clear();
  }
}

const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// The C return type of an entry point whose body returns T.
template <typename T>
struct CResult;
template <>
struct CResult<absl::Status> {
  using type = kvtier_status;
};
template <typename T>
struct CResult<absl::StatusOr<T>> {
  using type = T;
};

// What an entry point returning R returns on failure (see the header).
template <typename R>
R FailureValue(kvtier_status status) {
  if constexpr (std::is_same_v<R, kvtier_status>) {
    return status;
  } else if constexpr (std::is_same_v<R, int64_t>) {
    return -static_cast<int64_t>(status);
  } else if constexpr (std::is_pointer_v<R>) {
    return nullptr;
  } else {
    static_assert(std::is_same_v<R, uint64_t>, "no failure value for this return type");
    return 0;
  }
}

// Runs an entry point's body, which returns absl::Status (the entry point
// returns kvtier_status) or absl::StatusOr<R> (it returns R, and
// FailureValue<R> on failure). Records the outcome as the thread's last
// status; an exception becomes KVTIER_INTERNAL with its what().
template <typename Body>
typename CResult<std::invoke_result_t<Body&>>::type Call(Body&& body) noexcept {
  using Result = std::invoke_result_t<Body&>;
  using R = typename CResult<Result>::type;
  try {
    Result result = body();
    if (const absl::Status& s = StatusOf(result); !s.ok()) {
      const kvtier_status status = ToC(s.code());
      Record(status, s.message());
      return FailureValue<R>(status);
    }
    Record(KVTIER_OK, {});
    if constexpr (std::is_same_v<Result, absl::Status>) {
      return KVTIER_OK;
    } else {
      return *std::move(result);
    }
  } catch (const std::exception& e) {
    Record(KVTIER_INTERNAL, e.what());
  } catch (...) {
    Record(KVTIER_INTERNAL, "an exception that is not a std::exception");
  }
  return FailureValue<R>(KVTIER_INTERNAL);
}

// Call for a body that takes the connector: a NULL handle from a binding is
// reported instead of crashing the engine's process.
template <typename Body>
auto WithConnector(const kvtier_connector* c, Body&& body) noexcept {
  return Call([&]() -> std::invoke_result_t<Body&, KvConnector&> {
    if (c == nullptr) return absl::InvalidArgumentError("the connector is NULL");
    return body(*c->impl);
  });
}

// C passes an array as (pointer, size); NULL is fine only when it is empty.
absl::Status CheckArray(const void* p, size_t n, absl::string_view name) {
  if (p == nullptr && n > 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is NULL but its size is ", n));
  }
  return absl::OkStatus();
}

// The message KvConnector gives for a request that is not open.
absl::Status NotOpen(uint64_t request) {
  return absl::NotFoundError(absl::StrCat("no request ", request));
}

absl::StatusOr<kvtier::worker::ConnectorOptions> OptionsFrom(const kvtier_connector_config* cfg) {
  if (!cfg || !cfg->model || !cfg->dtype) {
    return absl::InvalidArgumentError("config, model and dtype are required");
  }
  const uint32_t tp_size = cfg->tp_size == 0 ? 1 : cfg->tp_size;
  if (cfg->tp_rank >= tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp_rank ", cfg->tp_rank, " is not a rank of a group of ", tp_size));
  }
  kvtier::worker::ConnectorOptions o;
  o.spec = kvtier::NamespaceSpec{cfg->model,
                                 cfg->dtype,
                                 cfg->layers,
                                 cfg->kv_heads,
                                 cfg->head_dim,
                                 cfg->block_tokens,
                                 cfg->tp_rank,
                                 tp_size,
                                 cfg->cache_salt ? cfg->cache_salt : "",
                                 "",
                                 ""};
  if (cfg->kv_wire) o.spec.kv_wire = cfg->kv_wire;
  o.num_pages = cfg->num_pages;
  if (cfg->stores) {
    for (absl::string_view s : absl::StrSplit(cfg->stores, ',', absl::SkipEmpty())) {
      o.stores.emplace_back(s);
    }
  }
  if (cfg->offload) o.offload = cfg->offload;
  if (cfg->staging_blocks) o.staging_blocks = cfg->staging_blocks;
  if (cfg->deadline_ms) o.data.deadline_ms = cfg->deadline_ms;
  kvtier::TlsFlags tls;
  if (cfg->tls_ca) tls.ca_file = cfg->tls_ca;
  if (cfg->tls_cert) tls.cert_file = cfg->tls_cert;
  if (cfg->tls_key) tls.key_file = cfg->tls_key;
  absl::StatusOr<kvtier::ChannelSecurity> security = kvtier::ClientSecurity(tls);
  if (!security.ok()) return security.status();
  o.data.security = *security;
  return o;
}

std::vector<kvtier::BlockHash> ChainOf(const uint64_t* hashes, size_t n) {
  std::vector<kvtier::BlockHash> chain(n);
  for (size_t i = 0; i < n; ++i) chain[i] = kvtier::BlockHash{hashes[2 * i], hashes[2 * i + 1]};
  return chain;
}

}  // namespace

extern "C" {

kvtier_connector* kvtier_connector_create(const kvtier_connector_config* cfg) {
  return Call([&]() -> absl::StatusOr<kvtier_connector*> {
    auto o = OptionsFrom(cfg);
    if (!o.ok()) return o.status();
    auto c = KvConnector::Create(*std::move(o));
    if (!c.ok()) return c.status();
    return new kvtier_connector{std::move(*c)};
  });
}

kvtier_connector* kvtier_connector_create_engine(const kvtier_connector_config* cfg,
                                                 const kvtier_engine_kv* kv) {
  return kvtier_connector_create_engine_on(cfg, kv, nullptr);
}

kvtier_connector* kvtier_connector_create_engine_on(const kvtier_connector_config* cfg,
                                                    const kvtier_engine_kv* kv,
                                                    const char* page_copier) {
  return Call([&]() -> absl::StatusOr<kvtier_connector*> {
    auto o = OptionsFrom(cfg);
    if (!o.ok()) return o.status();
    if (!kv || !kv->k || !kv->v)
      return absl::InvalidArgumentError("kv, kv->k and kv->v are required");
    kvtier::gpu::PageMemory m;
    for (uint32_t l = 0; l < cfg->layers; ++l) {
      m.k.push_back(static_cast<uint8_t*>(kv->k[l]));
      m.v.push_back(static_cast<uint8_t*>(kv->v[l]));
    }
    m.page_stride = kv->page_stride;
    o->engine_memory = std::move(m);
    if (page_copier != nullptr) o->page_copier = page_copier;
    auto c = KvConnector::Create(*std::move(o));
    if (!c.ok()) return c.status();
    return new kvtier_connector{std::move(*c)};
  });
}

void kvtier_connector_destroy(kvtier_connector* c) {
  Call([&] {
    delete c;
    return absl::OkStatus();
  });
}

uint64_t kvtier_namespace_id(const kvtier_connector* c) {
  return WithConnector(c,
                       [](KvConnector& k) -> absl::StatusOr<uint64_t> { return k.namespace_id(); });
}

uint64_t kvtier_block_bytes(const kvtier_connector* c) {
  return WithConnector(c,
                       [](KvConnector& k) -> absl::StatusOr<uint64_t> { return k.block_bytes(); });
}

uint8_t* kvtier_layer_base(kvtier_connector* c, uint32_t layer) {
  return WithConnector(c, [&](KvConnector& k) -> absl::StatusOr<uint8_t*> {
    if (k.engine_owned()) {
      return absl::FailedPreconditionError("the engine owns this connector's KV memory");
    }
    const uint32_t layers = k.pool().layout().layers;
    if (layer >= layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " out of range: the pool has ", layers, " layers"));
    }
    return k.pool().layer_bases()[layer];
  });
}

int64_t kvtier_hash_tokens(const kvtier_connector* c, const uint32_t* tokens, size_t n,
                           uint64_t* out, size_t max_blocks) {
  return WithConnector(c, [&](KvConnector& k) -> absl::StatusOr<int64_t> {
    if (auto s = CheckArray(tokens, n, "tokens"); !s.ok()) return s;
    if (auto s = CheckArray(out, max_blocks, "hashes_out"); !s.ok()) return s;
    auto chain = kvtier::ChainHashes(k.namespace_id(), std::span<const uint32_t>(tokens, n),
                                     k.block_tokens());
    const size_t blocks = std::min(chain.size(), max_blocks);
    for (size_t i = 0; i < blocks; ++i) {
      out[2 * i] = chain[i].hi;
      out[2 * i + 1] = chain[i].lo;
    }
    return static_cast<int64_t>(blocks);
  });
}

kvtier_status kvtier_get_num_matched_tokens(kvtier_connector* c, uint64_t request,
                                            const uint64_t* hashes, size_t n, uint64_t* gpu_tokens,
                                            uint64_t* store_tokens) {
  return WithConnector(c, [&](KvConnector& k) -> absl::Status {
    if (auto s = CheckArray(hashes, n, "hashes"); !s.ok()) return s;
    auto m = k.Begin(request, ChainOf(hashes, n));
    if (!m.ok()) return m.status();
    const uint64_t bt = k.block_tokens();
    if (gpu_tokens) *gpu_tokens = m->gpu_blocks * bt;
    if (store_tokens) *store_tokens = m->store_blocks * bt;
    return absl::OkStatus();
  });
}

kvtier_status kvtier_lookup(kvtier_connector* c, uint64_t request, const uint64_t* hashes, size_t n,
                            uint32_t skip_blocks, uint64_t* store_tokens) {
  return WithConnector(c, [&](KvConnector& k) -> absl::Status {
    if (auto s = CheckArray(hashes, n, "hashes"); !s.ok()) return s;
    auto m = k.Lookup(request, ChainOf(hashes, n), skip_blocks);
    if (!m.ok()) return m.status();
    if (store_tokens) *store_tokens = uint64_t{m->store_blocks} * k.block_tokens();
    return absl::OkStatus();
  });
}

kvtier_status kvtier_start_load_into(kvtier_connector* c, uint64_t request, const uint32_t* pages,
                                     size_t n) {
  return WithConnector(c, [&](KvConnector& k) -> absl::Status {
    if (auto s = CheckArray(pages, n, "pages"); !s.ok()) return s;
    return k.StartLoadInto(request, std::vector<uint32_t>(pages, pages + n));
  });
}

kvtier_status kvtier_save_blocks(kvtier_connector* c, uint64_t request, uint32_t first_block,
                                 const uint32_t* pages, size_t n) {
  return WithConnector(c, [&](KvConnector& k) -> absl::Status {
    if (auto s = CheckArray(pages, n, "pages"); !s.ok()) return s;
    return k.SaveFrom(request, first_block, std::vector<uint32_t>(pages, pages + n));
  });
}

kvtier_status kvtier_start_load(kvtier_connector* c, uint64_t request) {
  return WithConnector(c, [&](KvConnector& k) -> absl::Status {
    if (!k.IsOpen(request)) return NotOpen(request);
    return k.StartLoad(request);
  });
}

kvtier_status kvtier_wait_for_layer(kvtier_connector* c, uint64_t request, uint32_t layer) {
  return WithConnector(c, [&](KvConnector& k) -> absl::Status {
    if (!k.IsOpen(request)) return NotOpen(request);
    return k.WaitForLayer(request, layer);
  });
}

int64_t kvtier_wait_for_load(kvtier_connector* c, uint64_t request) {
  return WithConnector(c, [&](KvConnector& k) -> absl::StatusOr<int64_t> {
    auto l = k.WaitForLoad(request);
    if (!l.ok()) return l.status();
    return static_cast<int64_t>(*l) * k.block_tokens();
  });
}

int64_t kvtier_allocate(kvtier_connector* c, uint64_t request, uint32_t* out, size_t max) {
  return WithConnector(c, [&](KvConnector& k) -> absl::StatusOr<int64_t> {
    if (auto s = CheckArray(out, max, "pages_out"); !s.ok()) return s;
    auto p = k.AllocateForCompute(request);
    if (!p.ok()) return p.status();
    if (p->size() > max) {
      // Handing out only some pages would let kvtier_save commit pages the
      // engine never wrote: close the request instead, its pages discarded.
      k.Finished(request);
      return absl::InvalidArgumentError(absl::StrCat(
          "kvtier_allocate: pages_out holds ", max, " pages but request ", request, " needs ",
          p->size(), "; the request is closed (start it again with room for every page)"));
    }
    if (!p->empty()) std::memcpy(out, p->data(), p->size() * sizeof(uint32_t));
    return static_cast<int64_t>(p->size());
  });
}

int64_t kvtier_request_pages(kvtier_connector* c, uint64_t request, uint32_t* out, size_t max) {
  return WithConnector(c, [&](KvConnector& k) -> absl::StatusOr<int64_t> {
    if (auto s = CheckArray(out, max, "pages_out"); !s.ok()) return s;
    // Pages() of an unknown request is empty, as is that of an open one
    // before kvtier_allocate: only IsOpen tells them apart.
    if (!k.IsOpen(request)) return NotOpen(request);
    auto p = k.Pages(request);
    const size_t n = std::min(p.size(), max);
    if (n > 0) std::memcpy(out, p.data(), n * sizeof(uint32_t));
    return static_cast<int64_t>(n);
  });
}

kvtier_status kvtier_save(kvtier_connector* c, uint64_t request) {
  return WithConnector(c, [&](KvConnector& k) { return k.Save(request); });
}

kvtier_status kvtier_wait_for_save(kvtier_connector* c, uint64_t request) {
  return WithConnector(c, [&](KvConnector& k) { return k.WaitForSave(request); });
}

void kvtier_request_finished(kvtier_connector* c, uint64_t request) {
  WithConnector(c, [&](KvConnector& k) {
    k.Finished(request);
    return absl::OkStatus();
  });
}

// These three report the last status, so they must not go through Call
// (which would overwrite it); none of them can throw.
kvtier_status kvtier_last_status(void) { return last_status; }

const char* kvtier_last_error(void) { return last_error.c_str(); }

const char* kvtier_status_name(kvtier_status status) {
  const size_t v = static_cast<size_t>(status);
  return v < std::size(kCodes) ? kCodes[v].name : "INVALID_STATUS";
}

}  // extern "C"
