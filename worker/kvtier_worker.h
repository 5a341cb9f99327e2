/* The C ABI of kvtier's worker library, for engines written in other
 * languages (a Python engine binds it with ctypes or cffi).
 *
 * One connector owns the engine's paged KV cache (kvtier_layer_base) and
 * talks to the store. Per request, in order:
 *   kvtier_get_num_matched_tokens  -> tokens on the GPU and in the store
 *   kvtier_start_load / kvtier_wait_for_load
 *   kvtier_allocate                -> pages for the tokens to compute
 *   (the engine computes into those pages)
 *   kvtier_save / kvtier_wait_for_save
 *   kvtier_request_finished
 * Functions return 0 (or a count) on success and -1 on failure; then
 * kvtier_last_error() says why (per thread). Thread-safe; one request id is
 * used by one thread at a time. */
#ifndef KVTIER_WORKER_H_
#define KVTIER_WORKER_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvtier_connector kvtier_connector;

typedef struct {
  const char* model;        /* model id of the namespace */
  const char* dtype;        /* "fp16", "bf16", "fp8" */
  uint32_t layers, kv_heads, head_dim, block_tokens;
  uint64_t num_pages;       /* pages in the pool */
  const char* stores;       /* comma-separated kvtier-store addresses; "" for none */
  const char* offload;      /* "write-back", "write-through", "none" */
  uint64_t staging_blocks;  /* staging bound, in blocks (0: 64) */
  int deadline_ms;          /* per store operation (0: 10000) */
  /* TLS towards the stores' gRPC control plane; NULL or "" each: unused.
   * tls_ca set: TLS, verifying stores against it; tls_cert and tls_key set
   * as well: mutual TLS. PEM file paths. */
  const char* tls_ca;
  const char* tls_cert;
  const char* tls_key;
} kvtier_connector_config;

/* NULL on failure (see kvtier_last_error). */
kvtier_connector* kvtier_connector_create(const kvtier_connector_config* config);
void kvtier_connector_destroy(kvtier_connector* c);

uint64_t kvtier_namespace_id(const kvtier_connector* c);
uint64_t kvtier_block_bytes(const kvtier_connector* c);
/* Start of layer `layer` of the pool: [num_pages][2][block_tokens][kv_heads][head_dim]. */
uint8_t* kvtier_layer_base(kvtier_connector* c, uint32_t layer);

/* Chained block hashes of a prompt's full blocks: 2 uint64 (hi, lo) per
 * block into hashes_out (room for max_blocks). Returns the block count. */
int64_t kvtier_hash_tokens(const kvtier_connector* c, const uint32_t* tokens, size_t n_tokens,
                           uint64_t* hashes_out, size_t max_blocks);

/* Opens a request over its hash chain (2 uint64 per block, e.g. from
 * kvtier_hash_tokens or the engine's own hashes). */
int kvtier_get_num_matched_tokens(kvtier_connector* c, uint64_t request, const uint64_t* hashes,
                                  size_t n_blocks, uint64_t* gpu_tokens, uint64_t* store_tokens);
int kvtier_start_load(kvtier_connector* c, uint64_t request);
/* Tokens loaded from the store; -1 if the load failed (compute them instead). */
int64_t kvtier_wait_for_load(kvtier_connector* c, uint64_t request);
/* Pages (in chain order) for the blocks still to compute. Returns how many;
 * -1 if they do not fit in max (the request is then closed, nothing saved). */
int64_t kvtier_allocate(kvtier_connector* c, uint64_t request, uint32_t* pages_out, size_t max);
/* All of the request's pages in chain order. Returns how many. */
int64_t kvtier_request_pages(kvtier_connector* c, uint64_t request, uint32_t* pages_out, size_t max);
int kvtier_save(kvtier_connector* c, uint64_t request);
int kvtier_wait_for_save(kvtier_connector* c, uint64_t request);
void kvtier_request_finished(kvtier_connector* c, uint64_t request);

const char* kvtier_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_WORKER_H_ */
