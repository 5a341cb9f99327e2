// The C ABI, called from C (c_abi_check.c) against a real store.
#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "worker/kvtier_worker.h"

extern "C" int kvtier_c_abi_roundtrip(const char* store);

namespace kvtier {
namespace {

TEST(CAbi, AConnectorDrivenFromCRoundTrips) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  testing::ServerProcess store(KVTIER_STORE_BIN, dir.sub("store"),
                               {"--listen=127.0.0.1:0", "--ucx-listen=127.0.0.1:0",
                                "--data-dir=" + dir.sub("db"), "--hugepages=false",
                                "--ram-bytes=16MiB"});
  ASSERT_GT(store.port(), 0);
  EXPECT_EQ(kvtier_c_abi_roundtrip(store.address().c_str()), 0) << kvtier_last_error();
}

TEST(CAbi, AnAllocateBufferTooSmallClosesTheRequestInsteadOfHandingOutSomePages) {
  kvtier_connector_config cfg = {"small-buffer", "fp16", 1, 1, 8, 4, 16, "", "none", 0, 0,
                                 nullptr, nullptr, nullptr};
  kvtier_connector* c = kvtier_connector_create(&cfg);
  ASSERT_NE(c, nullptr) << kvtier_last_error();
  uint32_t tokens[16];
  for (uint32_t i = 0; i < 16; ++i) tokens[i] = i;
  uint64_t hashes[2 * 4];
  ASSERT_EQ(kvtier_hash_tokens(c, tokens, 16, hashes, 4), 4);
  uint64_t gpu = 0, store = 0;
  ASSERT_EQ(kvtier_get_num_matched_tokens(c, 1, hashes, 4, &gpu, &store), 0) << kvtier_last_error();
  uint32_t pages[4];
  EXPECT_EQ(kvtier_allocate(c, 1, pages, 2), -1);
  EXPECT_NE(std::string(kvtier_last_error()).find("holds 2 pages but request 1 needs 4"),
            std::string::npos) << kvtier_last_error();
  // Nothing of it was committed: the same prompt matches nothing, and all
  // 16 pages are free again for a request that fits.
  ASSERT_EQ(kvtier_get_num_matched_tokens(c, 2, hashes, 4, &gpu, &store), 0) << kvtier_last_error();
  EXPECT_EQ(gpu, 0u);
  EXPECT_EQ(kvtier_allocate(c, 2, pages, 4), 4) << kvtier_last_error();
  kvtier_request_finished(c, 2);
  kvtier_connector_destroy(c);
}

TEST(CAbi, BadConfigurationsReportWhy) {
  kvtier_connector_config cfg = {"m", "int4", 1, 1, 1, 1, 1, "", "none", 0, 0, nullptr, nullptr, nullptr};
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_NE(std::string(kvtier_last_error()).find("int4"), std::string::npos);
  cfg.dtype = "fp16";
  cfg.offload = "sometimes";
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_NE(std::string(kvtier_last_error()).find("sometimes"), std::string::npos);
  cfg.offload = "none";
  cfg.tls_ca = "/nonexistent/ca.pem";
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_NE(std::string(kvtier_last_error()).find("/nonexistent/ca.pem"), std::string::npos);
  cfg.tls_ca = nullptr;
  cfg.tls_cert = "/nonexistent/cert.pem";  // a certificate without its key
  EXPECT_EQ(kvtier_connector_create(&cfg), nullptr);
  EXPECT_NE(std::string(kvtier_last_error()).find("--tls-key"), std::string::npos);
}

}  // namespace
}  // namespace kvtier
