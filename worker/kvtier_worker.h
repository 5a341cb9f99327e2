/* The C ABI of kvtier's worker library, for engines written in other
 * languages (Python engines use the kvtier package, which binds the C++
 * library directly; docs/engines.md).
 *
 * Two kinds of connector. One made by kvtier_connector_create owns the
 * paged KV cache (kvtier_layer_base) and talks to the store. Per request,
 * in order:
 *   kvtier_get_num_matched_tokens  -> tokens on the GPU and in the store
 *   kvtier_start_load / kvtier_wait_for_layer / kvtier_wait_for_load
 *   kvtier_allocate                -> pages for the tokens to compute
 *   (the engine computes into those pages)
 *   kvtier_save / kvtier_wait_for_save
 *   kvtier_request_finished
 *
 * One made by kvtier_connector_create_engine works over the engine's own KV
 * memory (kvtier_engine_kv), and the engine keeps its prefix cache and
 * chooses its pages, as with vLLM's KV-connector API:
 *   kvtier_lookup            -> tokens the store holds after the engine's own
 *   kvtier_start_load_into   -> into the engine's pages; then
 *                               kvtier_wait_for_layer / kvtier_wait_for_load
 *   (the engine computes the rest)
 *   kvtier_save_blocks / kvtier_wait_for_save
 *   kvtier_request_finished
 * Calls of the other kind return KVTIER_FAILED_PRECONDITION on it.
 * Thread-safe; one request id is used by one thread at a time.
 *
 * Errors. A failure has a kvtier_status code (absl::StatusCode's and gRPC's
 * values) and a message. How a function returns the code depends on what it
 * returns:
 *   kvtier_status  KVTIER_OK, or the code.
 *   int64_t        a count, >= 0, on success; the code NEGATED on failure
 *                  (-KVTIER_NOT_FOUND, ...): n < 0 is a failure, and
 *                  (kvtier_status)-n its code.
 *   a pointer      NULL on failure.
 *   uint64_t, void fail only for a NULL connector (uint64_t: 0); see
 *                  kvtier_last_status().
 * Every function except kvtier_last_status, kvtier_last_error and
 * kvtier_status_name also records its outcome for the calling thread, until
 * that thread's next call: kvtier_last_status() gives the code (KVTIER_OK
 * after a success) and kvtier_last_error() the message ("" after a success).
 *
 * Each function lists the codes it returns. Besides those, any function may
 * return KVTIER_INVALID_ARGUMENT for a NULL connector, or for a NULL array
 * with a nonzero size, and KVTIER_INTERNAL for a C++ exception inside the
 * library (its what() is the message; no exception ever reaches the caller).
 * Unless its description says otherwise, a failed call leaves an open
 * request as it was. */
#ifndef KVTIER_WORKER_H_
#define KVTIER_WORKER_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Values equal absl::StatusCode's and grpc::StatusCode's, so codes from the
 * store pass through unchanged. An int at the ABI (ctypes: c_int). */
typedef enum kvtier_status {
  KVTIER_OK = 0,
  KVTIER_CANCELLED = 1,
  KVTIER_UNKNOWN = 2,
  KVTIER_INVALID_ARGUMENT = 3,
  KVTIER_DEADLINE_EXCEEDED = 4,
  KVTIER_NOT_FOUND = 5,
  KVTIER_ALREADY_EXISTS = 6,
  KVTIER_PERMISSION_DENIED = 7,
  KVTIER_RESOURCE_EXHAUSTED = 8,
  KVTIER_FAILED_PRECONDITION = 9,
  KVTIER_ABORTED = 10,
  KVTIER_OUT_OF_RANGE = 11,
  /* gRPC's code 12, passed through from a store that lacks an RPC (an older
   * kvtier-store); no call of this library is unimplemented. */
  KVTIER_UNIMPLEMENTED = 12,
  KVTIER_INTERNAL = 13,
  KVTIER_UNAVAILABLE = 14,
  KVTIER_DATA_LOSS = 15,
  KVTIER_UNAUTHENTICATED = 16
} kvtier_status;

typedef struct kvtier_connector kvtier_connector;

typedef struct {
  const char* model; /* model id of the namespace */
  const char* dtype; /* "fp16", "bf16", "fp8" ("fp8_e4m3", "fp8_e5m2") */
  uint32_t layers, kv_heads, head_dim, block_tokens;
  uint64_t num_pages;      /* pages in the pool */
  const char* stores;      /* comma-separated kvtier-store addresses; "" for none */
  const char* offload;     /* "write-back", "write-through", "none" */
  uint64_t staging_blocks; /* staging bound, in blocks (0: 64) */
  int deadline_ms;         /* per store operation (0: 10000) */
  /* TLS towards the stores' gRPC control plane; NULL or "" each: unused.
   * tls_ca set: TLS, verifying stores against it; tls_cert and tls_key set
   * as well: mutual TLS. PEM file paths. */
  const char* tls_ca;
  const char* tls_cert;
  const char* tls_key;
  /* Block encoding in the store: NULL or "" (the dtype's bytes) or "int8"
   * (half the bytes of a 16-bit cache; see docs/dataplane.md for the error
   * bound). Part of the namespace: int8 blocks never mix with plain ones. */
  const char* kv_wire;
  /* Tensor parallelism: this engine process's rank and the group's size
   * (0 and 0: one rank, as rank 0 of 1). Part of the namespace: each rank
   * stores the blocks of its own heads, so ranks never share a block. */
  uint32_t tp_rank, tp_size;
  /* A per-user or per-tenant salt (vLLM's cache_salt): NULL or "" for none.
   * Part of the namespace: requests of different salts never share blocks. */
  const char* cache_salt;
} kvtier_connector_config;

/* Zero-initialise the config (= {0}) and set what you use: fields added in
 * later versions then keep their defaults.
 * NULL on failure; kvtier_last_status() says which:
 *   KVTIER_INVALID_ARGUMENT    config, model or dtype NULL; an unknown dtype
 *                              or offload policy; a dimension out of range
 *                              (layers, kv_heads, head_dim, block_tokens) or
 *                              too many pages; tp_rank not below tp_size
 *                              (tp_size 0 counts as 1); a model id empty or over 256
 *                              bytes; a TLS file unreadable or not PEM, or a
 *                              certificate without its key; kv_wire neither
 *                              "" nor "int8", or int8 with an fp8 dtype.
 *   KVTIER_RESOURCE_EXHAUSTED  no memory for the staging buffers.
 *   the data plane's code      registering the staging memory with it failed.
 * A store that is down is no failure here: it is asked again per request. */
kvtier_connector* kvtier_connector_create(const kvtier_connector_config* config);
/* Where an engine's paged KV cache is, per layer: page 0's K chunk and V
 * chunk (block_tokens x kv_heads x head_dim contiguous elements each), and
 * the bytes from one page's chunk to the next page's (the same for K and V).
 * vLLM's [2][num_pages][block_tokens][kv_heads][head_dim] per layer:
 *   k = base, v = base + num_pages * page_stride, page_stride = chunk bytes;
 * [num_pages][2][...]: k = base, v = base + chunk, page_stride = 2 chunks.
 * Host memory, valid for the connector's lifetime. */
typedef struct {
  void* const* k;       /* config.layers entries */
  void* const* v;       /* config.layers entries */
  uint64_t page_stride; /* bytes */
} kvtier_engine_kv;

/* A connector over the engine's memory: config.num_pages is the engine's
 * page count. NULL on failure, with the codes of kvtier_connector_create and
 *   KVTIER_INVALID_ARGUMENT  kv or its arrays NULL, a NULL layer, a page
 *                            stride below a chunk, K and V overlapping, or
 *                            kv_wire int8 (it needs a kvtier-owned pool). */
kvtier_connector* kvtier_connector_create_engine(const kvtier_connector_config* config,
                                                 const kvtier_engine_kv* kv);
/* The same over memory reached through a page copier (gpu/page_copier.h):
 * page_copier "cuda" or "cuda:N" for KV pages on that GPU, "host" for host
 * pages taking the same staged path; NULL or "" is
 * kvtier_connector_create_engine. Besides its codes:
 *   KVTIER_INVALID_ARGUMENT     an unknown page copier, or a layer's memory
 *                               not on its device.
 *   KVTIER_FAILED_PRECONDITION  no libkvtier_cuda.so could be loaded
 *                               (scripts/build_cuda_module.sh builds it).
 *   KVTIER_UNAVAILABLE          CUDA finds no such device. */
kvtier_connector* kvtier_connector_create_engine_on(const kvtier_connector_config* config,
                                                    const kvtier_engine_kv* kv,
                                                    const char* page_copier);
/* NULL: nothing happens. Waits for pending offloads. */
void kvtier_connector_destroy(kvtier_connector* c);

/* 0 for a NULL connector. */
uint64_t kvtier_namespace_id(const kvtier_connector* c);
uint64_t kvtier_block_bytes(const kvtier_connector* c);
/* Start of layer `layer` of the pool: [num_pages][2][block_tokens][kv_heads][head_dim].
 * NULL with KVTIER_INVALID_ARGUMENT if layer >= layers. */
uint8_t* kvtier_layer_base(kvtier_connector* c, uint32_t layer);

/* Chained block hashes of a prompt's full blocks: 2 uint64 (hi, lo) per
 * block into hashes_out (room for max_blocks). Returns the block count
 * written: the first max_blocks at most. No codes of its own. */
int64_t kvtier_hash_tokens(const kvtier_connector* c, const uint32_t* tokens, size_t n_tokens,
                           uint64_t* hashes_out, size_t max_blocks);

/* Opens a request over its hash chain (2 uint64 per block, e.g. from
 * kvtier_hash_tokens or the engine's own hashes); gpu_tokens and
 * store_tokens may be NULL. A store that cannot be asked is no failure:
 * store_tokens is then 0.
 *   KVTIER_INVALID_ARGUMENT  n_blocks is 0 (no full block to match).
 *   KVTIER_ALREADY_EXISTS    the request is open already. */
kvtier_status kvtier_get_num_matched_tokens(kvtier_connector* c, uint64_t request,
                                            const uint64_t* hashes, size_t n_blocks,
                                            uint64_t* gpu_tokens, uint64_t* store_tokens);
/* Engine connectors. Opens the request over its hash chain, of which the
 * engine holds the first skip_blocks itself, and pins in the store the
 * blocks after those that it holds; store_tokens (may be NULL) gets their
 * tokens. A store that cannot be asked is no failure (0 tokens). A request
 * open already whose load has not started is looked up afresh.
 *   KVTIER_INVALID_ARGUMENT     n_blocks is 0, or skip_blocks > n_blocks.
 *   KVTIER_FAILED_PRECONDITION  a kvtier-owned connector, or the request's
 *                               load or save is under way. */
kvtier_status kvtier_lookup(kvtier_connector* c, uint64_t request, const uint64_t* hashes,
                            size_t n_blocks, uint32_t skip_blocks, uint64_t* store_tokens);
/* Engine connectors. Starts loading the first n_pages blocks kvtier_lookup
 * found into pages[0..n_pages) (the engine may take fewer than were found),
 * layer by layer; wait with kvtier_wait_for_layer / kvtier_wait_for_load.
 *   KVTIER_INVALID_ARGUMENT     more pages than blocks found, a page id
 *                               >= num_pages, or a page named twice.
 *   KVTIER_NOT_FOUND            the request is not open.
 *   KVTIER_FAILED_PRECONDITION  a kvtier-owned connector, or the load was
 *                               started already. */
kvtier_status kvtier_start_load_into(kvtier_connector* c, uint64_t request, const uint32_t* pages,
                                     size_t n_pages);
/* Engine connectors. Queues the request's blocks first_block + i, computed
 * into pages[i], for the store; their bytes are copied out before it
 * returns, so the engine may reuse the pages at once (a save larger than
 * the staging waits for slots as earlier blocks leave for the store).
 * Blocks known to be in the store are skipped. kvtier_wait_for_save waits
 * for them.
 *   KVTIER_INVALID_ARGUMENT     blocks beyond the chain, a page id out of range.
 *   KVTIER_NOT_FOUND            the request is not open.
 *   KVTIER_RESOURCE_EXHAUSTED   no staging memory before the deadline (the
 *                               blocks before that one are queued).
 *   KVTIER_FAILED_PRECONDITION  a kvtier-owned connector. */
kvtier_status kvtier_save_blocks(kvtier_connector* c, uint64_t request, uint32_t first_block,
                                 const uint32_t* pages, size_t n_pages);

/* Starts loading the request's store tokens in the background, layer by
 * layer (layer 0 of every block first).
 *   KVTIER_NOT_FOUND            the request is not open.
 *   KVTIER_FAILED_PRECONDITION  its load was started already. */
kvtier_status kvtier_start_load(kvtier_connector* c, uint64_t request);
/* Returns once layer `layer` of every block being loaded is in its page, so
 * the engine can compute that layer while later ones are in flight. The
 * bytes are verified only when the whole load is: kvtier_wait_for_load's
 * answer is the verdict. KVTIER_OK at once when no load was started.
 *   KVTIER_INVALID_ARGUMENT  layer is not below the namespace's layers.
 *   KVTIER_NOT_FOUND         the request is not open.
 *   (the load's code)        it failed before the layer came. */
kvtier_status kvtier_wait_for_layer(kvtier_connector* c, uint64_t request, uint32_t layer);
/* Tokens loaded from the store (0 if kvtier_start_load was not called). A
 * load is all or nothing, except that a full page pool loads fewer blocks
 * and an int8 namespace's load, done in runs of staging_blocks, keeps the
 * runs verified before a failing one; one that loaded nothing fails, and
 * the engine computes the tokens instead:
 *   -KVTIER_NOT_FOUND           the request is not open.
 *   -KVTIER_RESOURCE_EXHAUSTED  no staging memory before the deadline.
 *   -(the store's code)         e.g. -KVTIER_UNAVAILABLE,
 *                               -KVTIER_DEADLINE_EXCEEDED, -KVTIER_DATA_LOSS
 *                               (a block failed its checksum). */
int64_t kvtier_wait_for_load(kvtier_connector* c, uint64_t request);
/* Pages (in chain order) for the blocks still to compute. Returns how many.
 *   -KVTIER_NOT_FOUND            the request is not open.
 *   -KVTIER_FAILED_PRECONDITION  a load was started and not waited for.
 *   -KVTIER_RESOURCE_EXHAUSTED   every page is pinned by requests.
 *   -KVTIER_INVALID_ARGUMENT     the pages do not fit in max: the request is
 *                                then closed, nothing saved (handing out only
 *                                some would let kvtier_save commit pages the
 *                                engine never wrote). Start it again with
 *                                room for every page. */
int64_t kvtier_allocate(kvtier_connector* c, uint64_t request, uint32_t* pages_out, size_t max);
/* All of the request's pages in chain order, the first max at most. Returns
 * how many it wrote.
 *   -KVTIER_NOT_FOUND  the request is not open. */
int64_t kvtier_request_pages(kvtier_connector* c, uint64_t request, uint32_t* pages_out,
                             size_t max);
/* The computed pages hold their blocks now: they become matchable, and
 * under write-through are queued for the store (each page stays referenced
 * until it is copied out; a request that needs pages takes them from the
 * oldest queued saves first, which are then dropped). Never waits.
 *   KVTIER_NOT_FOUND  the request is not open. */
kvtier_status kvtier_save(kvtier_connector* c, uint64_t request);
/* Waits for the request's write-through offloads (none under write-back or
 * none). The blocks stay cached on the GPU either way. A dropped save (see
 * kvtier_save) is no failure.
 *   KVTIER_NOT_FOUND           the request is not open.
 *   the store's code           e.g. KVTIER_UNAVAILABLE,
 *                              KVTIER_DEADLINE_EXCEEDED. */
kvtier_status kvtier_wait_for_save(kvtier_connector* c, uint64_t request);
/* Unpins the request's pages. Does not wait for its saves (they finish on
 * their own; kvtier_wait_for_save waits for them). A request that is not
 * open is ignored (so closing twice, or after kvtier_allocate closed it, is
 * harmless). */
void kvtier_request_finished(kvtier_connector* c, uint64_t request);

/* The outcome of the calling thread's last call into this library. */
kvtier_status kvtier_last_status(void);
/* Its message; "" after a success. Valid until the thread's next call. */
const char* kvtier_last_error(void);
/* "OK", "NOT_FOUND", ... (absl's and gRPC's names, without KVTIER_); never
 * NULL ("INVALID_STATUS" for a value outside the enum). Static storage. */
const char* kvtier_status_name(kvtier_status status);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_WORKER_H_ */
