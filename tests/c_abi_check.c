/* Compiled as C: the worker header must be usable from C (and so by FFI).
 * Each check that fails returns its own negative number, so the C++ side
 * can say which one it was. */
#include <string.h>

#include "worker/kvtier_worker.h"

/* A failure's code, both ways the ABI reports it. */
static int failed_with(int64_t got, kvtier_status want) {
  return got == -(int64_t)want && kvtier_last_status() == want;
}

int kvtier_c_abi_roundtrip(const char* store) {
  kvtier_connector_config cfg = {"c-abi-model", "bf16", 2, 2, 32, 8, 64, store, "write-through", 8,
                                 3000, NULL, NULL, NULL, NULL, 0, 0, NULL};
  kvtier_connector* c = kvtier_connector_create(&cfg);
  if (!c) return -1;
  if (kvtier_last_status() != KVTIER_OK || kvtier_last_error()[0] != '\0') return -1;
  uint32_t tokens[40];
  for (int i = 0; i < 40; ++i) tokens[i] = (uint32_t)(i * 31);
  uint64_t hashes[2 * 5];
  int64_t blocks = kvtier_hash_tokens(c, tokens, 40, hashes, 5);
  uint64_t gpu = 0, stored = 0;
  if (blocks != 5 || kvtier_get_num_matched_tokens(c, 1, hashes, 5, &gpu, &stored) != KVTIER_OK) {
    return -2;
  }
  /* The same id again while it is open. */
  if (kvtier_get_num_matched_tokens(c, 1, hashes, 5, &gpu, &stored) != KVTIER_ALREADY_EXISTS ||
      kvtier_last_status() != KVTIER_ALREADY_EXISTS) {
    return -6;
  }
  uint32_t pages[5];
  if (kvtier_allocate(c, 1, pages, 5) != 5) return -3;
  for (int p = 0; p < 5; ++p) {
    for (uint32_t l = 0; l < 2; ++l) kvtier_layer_base(c, l)[pages[p] * 2 * 8 * 2 * 32 * 2] = (uint8_t)(p + 1);
  }
  if (kvtier_save(c, 1) != KVTIER_OK || kvtier_wait_for_save(c, 1) != KVTIER_OK) return -4;
  kvtier_request_finished(c, 1);
  if (kvtier_get_num_matched_tokens(c, 2, hashes, 5, &gpu, &stored) != KVTIER_OK || gpu != 40) {
    return -5;
  }
  kvtier_request_finished(c, 2);

  /* Request 1 is closed now: every call about it says NOT_FOUND, in its
   * function's way; finishing it again is harmless. */
  uint32_t more[5];
  if (kvtier_start_load(c, 1) != KVTIER_NOT_FOUND || kvtier_last_status() != KVTIER_NOT_FOUND) {
    return -7;
  }
  if (!failed_with(kvtier_wait_for_load(c, 1), KVTIER_NOT_FOUND)) return -8;
  if (!failed_with(kvtier_allocate(c, 1, more, 5), KVTIER_NOT_FOUND)) return -9;
  if (!failed_with(kvtier_request_pages(c, 1, more, 5), KVTIER_NOT_FOUND)) return -10;
  if (kvtier_save(c, 1) != KVTIER_NOT_FOUND || kvtier_wait_for_save(c, 1) != KVTIER_NOT_FOUND) {
    return -11;
  }
  if (strcmp(kvtier_status_name(kvtier_last_status()), "NOT_FOUND") != 0) return -12;
  kvtier_request_finished(c, 1);
  if (kvtier_last_status() != KVTIER_OK) return -13;

  /* A layer the pool does not have. */
  if (kvtier_layer_base(c, 2) != NULL || kvtier_last_status() != KVTIER_INVALID_ARGUMENT) return -14;

  /* A second connector finds the blocks in the store and loads them. */
  kvtier_connector* d = kvtier_connector_create(&cfg);
  if (!d) return -15;
  if (kvtier_get_num_matched_tokens(d, 3, hashes, 5, &gpu, &stored) != KVTIER_OK || gpu != 0 ||
      stored != 40) {
    return -16;
  }
  if (kvtier_start_load(d, 3) != KVTIER_OK || kvtier_wait_for_load(d, 3) != 40) return -17;
  if (kvtier_request_pages(d, 3, more, 5) != 5 || kvtier_layer_base(d, 1)[more[4] * 2 * 8 * 2 * 32 * 2] != 5) {
    return -18;
  }
  kvtier_request_finished(d, 3);
  kvtier_connector_destroy(d);

  kvtier_connector_destroy(c);
  return 0;
}
