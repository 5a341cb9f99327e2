/* Compiled as C: the worker header must be usable from C (and so by FFI). */
#include "worker/kvtier_worker.h"

int kvtier_c_abi_roundtrip(const char* store) {
  kvtier_connector_config cfg = {"c-abi-model", "bf16", 2, 2, 32, 8, 64, store, "write-through", 8,
                                 3000, NULL, NULL, NULL};
  kvtier_connector* c = kvtier_connector_create(&cfg);
  if (!c) return -1;
  uint32_t tokens[40];
  for (int i = 0; i < 40; ++i) tokens[i] = (uint32_t)(i * 31);
  uint64_t hashes[2 * 5];
  int64_t blocks = kvtier_hash_tokens(c, tokens, 40, hashes, 5);
  uint64_t gpu = 0, stored = 0;
  if (blocks != 5 || kvtier_get_num_matched_tokens(c, 1, hashes, 5, &gpu, &stored) != 0) return -2;
  uint32_t pages[5];
  if (kvtier_allocate(c, 1, pages, 5) != 5) return -3;
  for (int p = 0; p < 5; ++p) {
    for (uint32_t l = 0; l < 2; ++l) kvtier_layer_base(c, l)[pages[p] * 2 * 8 * 2 * 32 * 2] = (uint8_t)(p + 1);
  }
  if (kvtier_save(c, 1) != 0 || kvtier_wait_for_save(c, 1) != 0) return -4;
  kvtier_request_finished(c, 1);
  if (kvtier_get_num_matched_tokens(c, 2, hashes, 5, &gpu, &stored) != 0 || gpu != 40) return -5;
  kvtier_request_finished(c, 2);
  kvtier_connector_destroy(c);
  return 0;
}
