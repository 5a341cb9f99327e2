#include "worker/kvtier_worker.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/tls.h"
#include "worker/connector.h"

struct kvtier_connector {
  std::unique_ptr<kvtier::worker::KvConnector> impl;
};

namespace {
thread_local std::string last_error;

int Fail(const absl::Status& s) {
  last_error = std::string(s.message());
  return -1;
}
}  // namespace

extern "C" {

kvtier_connector* kvtier_connector_create(const kvtier_connector_config* cfg) {
  if (!cfg || !cfg->model || !cfg->dtype) {
    last_error = "config, model and dtype are required";
    return nullptr;
  }
  kvtier::worker::ConnectorOptions o;
  o.spec = kvtier::NamespaceSpec{cfg->model, cfg->dtype, cfg->layers, cfg->kv_heads,
                                 cfg->head_dim, cfg->block_tokens, 0, 1, ""};
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
  if (!security.ok()) {
    Fail(security.status());
    return nullptr;
  }
  o.data.security = *security;
  auto c = kvtier::worker::KvConnector::Create(o);
  if (!c.ok()) {
    Fail(c.status());
    return nullptr;
  }
  return new kvtier_connector{std::move(*c)};
}

void kvtier_connector_destroy(kvtier_connector* c) { delete c; }

uint64_t kvtier_namespace_id(const kvtier_connector* c) { return c->impl->namespace_id(); }
uint64_t kvtier_block_bytes(const kvtier_connector* c) { return c->impl->block_bytes(); }

uint8_t* kvtier_layer_base(kvtier_connector* c, uint32_t layer) {
  if (layer >= c->impl->pool().layout().layers) {
    last_error = "layer out of range";
    return nullptr;
  }
  return c->impl->pool().layer_bases()[layer];
}

int64_t kvtier_hash_tokens(const kvtier_connector* c, const uint32_t* tokens, size_t n,
                           uint64_t* out, size_t max_blocks) {
  auto chain = kvtier::ChainHashes(c->impl->namespace_id(), std::span<const uint32_t>(tokens, n),
                                   c->impl->block_tokens());
  size_t k = std::min(chain.size(), max_blocks);
  for (size_t i = 0; i < k; ++i) {
    out[2 * i] = chain[i].hi;
    out[2 * i + 1] = chain[i].lo;
  }
  return static_cast<int64_t>(k);
}

int kvtier_get_num_matched_tokens(kvtier_connector* c, uint64_t request, const uint64_t* hashes,
                                  size_t n, uint64_t* gpu_tokens, uint64_t* store_tokens) {
  std::vector<kvtier::BlockHash> chain(n);
  for (size_t i = 0; i < n; ++i) chain[i] = kvtier::BlockHash{hashes[2 * i], hashes[2 * i + 1]};
  auto m = c->impl->Begin(request, std::move(chain));
  if (!m.ok()) return Fail(m.status());
  const uint64_t bt = c->impl->block_tokens();
  if (gpu_tokens) *gpu_tokens = m->gpu_blocks * bt;
  if (store_tokens) *store_tokens = m->store_blocks * bt;
  return 0;
}

int kvtier_start_load(kvtier_connector* c, uint64_t request) {
  c->impl->StartLoad(request);
  return 0;
}

int64_t kvtier_wait_for_load(kvtier_connector* c, uint64_t request) {
  auto l = c->impl->WaitForLoad(request);
  if (!l.ok()) return Fail(l.status());
  return static_cast<int64_t>(*l) * c->impl->block_tokens();
}

int64_t kvtier_allocate(kvtier_connector* c, uint64_t request, uint32_t* out, size_t max) {
  auto p = c->impl->AllocateForCompute(request);
  if (!p.ok()) return Fail(p.status());
  if (p->size() > max) {
    // Handing out only some pages would let kvtier_save commit pages the
    // engine never wrote: close the request instead, its pages discarded.
    c->impl->Finished(request);
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "kvtier_allocate: pages_out holds ", max, " pages but request ", request, " needs ",
        p->size(), "; the request is closed (start it again with room for every page)")));
  }
  std::memcpy(out, p->data(), p->size() * sizeof(uint32_t));
  return static_cast<int64_t>(p->size());
}

int64_t kvtier_request_pages(kvtier_connector* c, uint64_t request, uint32_t* out, size_t max) {
  auto p = c->impl->Pages(request);
  size_t k = std::min(p.size(), max);
  std::memcpy(out, p.data(), k * sizeof(uint32_t));
  return static_cast<int64_t>(k);
}

int kvtier_save(kvtier_connector* c, uint64_t request) {
  auto s = c->impl->Save(request);
  return s.ok() ? 0 : Fail(s);
}

int kvtier_wait_for_save(kvtier_connector* c, uint64_t request) {
  auto s = c->impl->WaitForSave(request);
  return s.ok() ? 0 : Fail(s);
}

void kvtier_request_finished(kvtier_connector* c, uint64_t request) { c->impl->Finished(request); }

const char* kvtier_last_error(void) { return last_error.c_str(); }

}  // extern "C"
