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
