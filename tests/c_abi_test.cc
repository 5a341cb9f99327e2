// The C ABI, called from C (c_abi_check.c) against a real store, and its
// error model: which kvtier_status each failure reports, and how.
#include <gtest/gtest.h>

#include <string>

#include "absl/status/status.h"
#include "common/block_key.h"
#include "tests/test_util.h"
#include "worker/kvtier_worker.h"

extern "C" int kvtier_c_abi_roundtrip(const char* store);

namespace kvtier {
namespace {

// A connector without a store: one layer, 4-token blocks.
kvtier_connector* MakeSmall(const char* model, uint64_t num_pages = 16) {
  kvtier_connector_config cfg = {model,     "fp16",  1,       1, 8, 4,
                                 num_pages, "",      "none",  0, 0, nullptr,
                                 nullptr,   nullptr, nullptr, 0, 0, nullptr};
  return kvtier_connector_create(&cfg);
}

// Opens `request` over 4 blocks: 16 tokens from `first` on.
kvtier_status Open(kvtier_connector* c, uint64_t request, uint64_t (&hashes)[8],
                   uint32_t first = 0) {
  uint32_t tokens[16];
  for (uint32_t i = 0; i < 16; ++i) tokens[i] = first + i;
  if (kvtier_hash_tokens(c, tokens, 16, hashes, 4) != 4) return KVTIER_INTERNAL;
  uint64_t gpu = 0, store = 0;
  return kvtier_get_num_matched_tokens(c, request, hashes, 4, &gpu, &store);
}

TEST(CAbi, AConnectorDrivenFromCRoundTrips) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  testing::ServerProcess store(
      KVTIER_STORE_BIN, dir.sub("store"),
      {"--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0", "--data-dir=" + dir.sub("db"),
       "--hugepages=false", "--ram-bytes=16MiB"});
  ASSERT_GT(store.port(), 0);
  EXPECT_EQ(kvtier_c_abi_roundtrip(store.address().c_str()), 0)
      << kvtier_status_name(kvtier_last_status()) << ": " << kvtier_last_error();
}

TEST(CAbi, AnAllocateBufferTooSmallClosesTheRequestInsteadOfHandingOutSomePages) {
  kvtier_connector* c = MakeSmall("small-buffer");
  ASSERT_NE(c, nullptr) << kvtier_last_error();
  uint64_t hashes[2 * 4] = {};
  ASSERT_EQ(Open(c, 1, hashes), KVTIER_OK) << kvtier_last_error();
  uint32_t pages[4];
  EXPECT_EQ(kvtier_allocate(c, 1, pages, 2), -KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("holds 2 pages but request 1 needs 4"),
            std::string::npos)
      << kvtier_last_error();
  // The request is closed: it is unknown now, and finishing it is harmless.
  EXPECT_EQ(kvtier_wait_for_load(c, 1), -KVTIER_NOT_FOUND);
  kvtier_request_finished(c, 1);
  EXPECT_EQ(kvtier_last_status(), KVTIER_OK);
  // Nothing of it was committed: the same prompt matches nothing, and all
  // 16 pages are free again for a request that fits.
  uint64_t gpu = 0, store = 0;
  ASSERT_EQ(kvtier_get_num_matched_tokens(c, 2, hashes, 4, &gpu, &store), KVTIER_OK)
      << kvtier_last_error();
  EXPECT_EQ(gpu, 0u);
  EXPECT_EQ(kvtier_allocate(c, 2, pages, 4), 4) << kvtier_last_error();
  EXPECT_EQ(kvtier_last_status(), KVTIER_OK);
  EXPECT_STREQ(kvtier_last_error(), "");
  kvtier_request_finished(c, 2);
  kvtier_connector_destroy(c);
}

// Each tensor-parallel rank and each salt is a namespace of its own: a C
// engine's ranks (or users) never read one another's blocks. (The ABI used
// to fix rank 0 of 1 and no salt, so every rank aliased rank 0's blocks.)
TEST(CAbi, RanksAndSaltsAreNamespacesOfTheirOwn) {
  auto id_of = [](uint32_t rank, uint32_t size, const char* salt) {
    kvtier_connector_config cfg = {"tp-model", "fp16",  1,       1,    8,    4,
                                   16,         "",      "none",  0,    0,    nullptr,
                                   nullptr,    nullptr, nullptr, rank, size, salt};
    kvtier_connector* c = kvtier_connector_create(&cfg);
    EXPECT_NE(c, nullptr) << kvtier_last_error();
    const uint64_t id = kvtier_namespace_id(c);
    kvtier_connector_destroy(c);
    return id;
  };
  const uint64_t alone = id_of(0, 0, nullptr);
  EXPECT_EQ(alone, id_of(0, 1, ""));  // 0 and 0 mean rank 0 of 1, and no salt is ""
  const uint64_t r0 = id_of(0, 2, nullptr), r1 = id_of(1, 2, nullptr);
  EXPECT_NE(r0, r1);
  EXPECT_NE(r0, alone);
  EXPECT_EQ(r0, NamespaceId(NamespaceSpec{"tp-model", "fp16", 1, 1, 8, 4, 0, 2, "", "", ""}));
  const uint64_t salted = id_of(0, 0, "user-7");
  EXPECT_NE(salted, alone);
  EXPECT_EQ(salted,
            NamespaceId(NamespaceSpec{"tp-model", "fp16", 1, 1, 8, 4, 0, 1, "user-7", "", ""}));
}

TEST(CAbi, BadConfigurationsReportWhy) {
  kvtier_connector_config cfg = {"m", "int4", 1,       1,       1,       1,       1, "", "none",
                                 0,   0,      nullptr, nullptr, nullptr, nullptr, 0, 0,  nullptr};
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("int4"), std::string::npos);
  cfg.dtype = "fp16";
  cfg.offload = "sometimes";
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("sometimes"), std::string::npos);
  cfg.offload = "none";
  cfg.tls_ca = "/nonexistent/ca.pem";
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("/nonexistent/ca.pem"), std::string::npos);
  cfg.tls_ca = nullptr;
  cfg.tls_cert = "/nonexistent/cert.pem";  // a certificate without its key
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("--tls-key"), std::string::npos);
  cfg.tls_cert = nullptr;
  cfg.tp_rank = 2;  // of a group of 2: no such rank
  cfg.tp_size = 2;
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("tp_rank 2"), std::string::npos);
  cfg.tp_size = 0;  // one rank: only rank 0
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  cfg.tp_rank = 0;
  cfg.layers = 0;
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("layers"), std::string::npos);
  EXPECT_EQ(kvtier_connector_create(nullptr), nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
}

TEST(CAbi, CallsAboutARequestThatIsNotOpenAreNotFound) {
  kvtier_connector* c = MakeSmall("not-open");
  ASSERT_NE(c, nullptr) << kvtier_last_error();
  uint32_t pages[4] = {};
  EXPECT_EQ(kvtier_start_load(c, 7), KVTIER_NOT_FOUND);
  EXPECT_EQ(kvtier_last_status(), KVTIER_NOT_FOUND);
  EXPECT_NE(std::string(kvtier_last_error()).find("no request 7"), std::string::npos)
      << kvtier_last_error();
  EXPECT_EQ(kvtier_wait_for_load(c, 7), -KVTIER_NOT_FOUND);
  EXPECT_EQ(kvtier_allocate(c, 7, pages, 4), -KVTIER_NOT_FOUND);
  EXPECT_EQ(kvtier_request_pages(c, 7, pages, 4), -KVTIER_NOT_FOUND);
  EXPECT_EQ(kvtier_save(c, 7), KVTIER_NOT_FOUND);
  EXPECT_EQ(kvtier_wait_for_save(c, 7), KVTIER_NOT_FOUND);
  EXPECT_EQ(kvtier_last_status(), KVTIER_NOT_FOUND);
  // Finishing is idempotent, so an unknown request is no error there.
  kvtier_request_finished(c, 7);
  EXPECT_EQ(kvtier_last_status(), KVTIER_OK);
  EXPECT_STREQ(kvtier_last_error(), "");
  kvtier_connector_destroy(c);
}

TEST(CAbi, MisusesReportTheirOwnCodes) {
  kvtier_connector* c = MakeSmall("misuse", /*num_pages=*/4);
  ASSERT_NE(c, nullptr) << kvtier_last_error();
  uint64_t hashes[2 * 4] = {};
  uint64_t gpu = 0, store = 0;
  EXPECT_EQ(kvtier_get_num_matched_tokens(c, 1, hashes, 0, &gpu, &store), KVTIER_INVALID_ARGUMENT)
      << "a request without a full block";
  EXPECT_EQ(kvtier_get_num_matched_tokens(c, 1, nullptr, 4, &gpu, &store), KVTIER_INVALID_ARGUMENT);
  ASSERT_EQ(Open(c, 1, hashes), KVTIER_OK) << kvtier_last_error();
  EXPECT_EQ(Open(c, 1, hashes), KVTIER_ALREADY_EXISTS);
  EXPECT_EQ(kvtier_last_status(), KVTIER_ALREADY_EXISTS);
  // A started load must be waited for before allocating (no store: it loads
  // nothing, but the order still holds).
  uint32_t pages[4] = {};
  ASSERT_EQ(kvtier_start_load(c, 1), KVTIER_OK);
  EXPECT_EQ(kvtier_allocate(c, 1, pages, 4), -KVTIER_FAILED_PRECONDITION);
  EXPECT_EQ(kvtier_wait_for_load(c, 1), 0) << kvtier_last_error();
  // A NULL buffer claiming room is refused before anything is allocated, so
  // the request stays open.
  EXPECT_EQ(kvtier_allocate(c, 1, nullptr, 4), -KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_allocate(c, 1, pages, 4), 4) << kvtier_last_error();
  EXPECT_EQ(kvtier_request_pages(c, 1, pages, 4), 4) << kvtier_last_error();
  // Request 1 holds all 4 pages: request 2 gets none, and stays open.
  uint64_t other[2 * 4] = {};
  ASSERT_EQ(Open(c, 2, other, /*first=*/100), KVTIER_OK) << kvtier_last_error();
  uint32_t more[4] = {};
  EXPECT_EQ(kvtier_allocate(c, 2, more, 4), -KVTIER_RESOURCE_EXHAUSTED);
  EXPECT_EQ(kvtier_last_status(), KVTIER_RESOURCE_EXHAUSTED);
  EXPECT_EQ(kvtier_request_pages(c, 2, more, 4), 0) << kvtier_last_error();
  kvtier_request_finished(c, 2);
  EXPECT_EQ(kvtier_layer_base(c, 1), nullptr) << "the pool has one layer";
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(kvtier_layer_base(c, 0), nullptr);
  kvtier_request_finished(c, 1);
  kvtier_connector_destroy(c);
}

TEST(CAbi, ANullConnectorIsAnInvalidArgumentNotACrash) {
  uint32_t pages[1] = {};
  EXPECT_EQ(kvtier_start_load(nullptr, 1), KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_allocate(nullptr, 1, pages, 1), -KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_hash_tokens(nullptr, nullptr, 0, nullptr, 0), -KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_block_bytes(nullptr), 0u);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  EXPECT_EQ(kvtier_layer_base(nullptr, 0), nullptr);
  kvtier_request_finished(nullptr, 1);
  EXPECT_EQ(kvtier_last_status(), KVTIER_INVALID_ARGUMENT);
  kvtier_connector_destroy(nullptr);
  EXPECT_EQ(kvtier_last_status(), KVTIER_OK);
}

TEST(CAbi, StatusCodesAreAbslsAndHaveTheirNames) {
  for (int v = 0; v <= 16; ++v) {
    auto code = static_cast<absl::StatusCode>(v);
    EXPECT_EQ(kvtier_status_name(static_cast<kvtier_status>(v)), absl::StatusCodeToString(code));
  }
  EXPECT_EQ(static_cast<int>(KVTIER_INVALID_ARGUMENT),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(static_cast<int>(KVTIER_UNAUTHENTICATED),
            static_cast<int>(absl::StatusCode::kUnauthenticated));
  EXPECT_STREQ(kvtier_status_name(static_cast<kvtier_status>(17)), "INVALID_STATUS");
}

}  // namespace
}  // namespace kvtier
