// AdminGate's decision alone: the token (absent, of another length, one
// byte off, right), the admin identity (no certificate, another name, the
// name among several), both together, and neither configured.
#include "common/rpc/admin_gate.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

const std::vector<std::string> kNoCert;

TEST(AdminGate, WithNothingConfiguredEveryoneMay) {
  AdminGate g;
  EXPECT_TRUE(g.Check(kNoCert, nullptr, "Evict").ok());
}

TEST(AdminGate, TheTokenMustMatchExactly) {
  AdminGate g;
  g.set_token("s3cret-token");
  const std::string_view right = "s3cret-token", off = "s3cret-tokem", shorter = "s3cret",
                         longer = "s3cret-token!", empty = "";
  EXPECT_TRUE(g.Check(kNoCert, &right, "Evict").ok());
  for (const std::string_view* t : {&off, &shorter, &longer, &empty}) {
    grpc::Status s = g.Check(kNoCert, t, "Evict");
    EXPECT_EQ(s.error_code(), grpc::PERMISSION_DENIED) << *t;
    EXPECT_NE(s.error_message().find("Evict is an admin RPC"), std::string::npos);
    EXPECT_NE(s.error_message().find("x-kvtier-admin-token"), std::string::npos);
    // The message never carries the token.
    EXPECT_EQ(s.error_message().find("s3cret"), std::string::npos);
  }
  grpc::Status none = g.Check(kNoCert, nullptr, "SetPolicy");
  EXPECT_EQ(none.error_code(), grpc::PERMISSION_DENIED);
  EXPECT_NE(none.error_message().find("SetPolicy"), std::string::npos);
}

TEST(AdminGate, TheIdentityMustBeAmongTheCertificatesNames) {
  AdminGate g;
  g.set_identity("kvtier-admin");
  grpc::Status none = g.Check(kNoCert, nullptr, "Evict");
  EXPECT_EQ(none.error_code(), grpc::PERMISSION_DENIED);
  EXPECT_NE(none.error_message().find("presented none"), std::string::npos) << none.error_message();
  grpc::Status other = g.Check({"worker-3", "worker-3.kvtier"}, nullptr, "Evict");
  EXPECT_EQ(other.error_code(), grpc::PERMISSION_DENIED);
  EXPECT_NE(other.error_message().find("\"worker-3\", \"worker-3.kvtier\""), std::string::npos)
      << other.error_message();
  EXPECT_TRUE(g.Check({"ops.example", "kvtier-admin"}, nullptr, "Evict").ok());
}

TEST(AdminGate, WithBothConfiguredBothAreNeeded) {
  AdminGate g;
  g.set_identity("kvtier-admin");
  g.set_token("t0ken");
  const std::string_view right = "t0ken", wrong = "t0kex";
  EXPECT_TRUE(g.Check({"kvtier-admin"}, &right, "Evict").ok());
  EXPECT_EQ(g.Check({"kvtier-admin"}, &wrong, "Evict").error_code(), grpc::PERMISSION_DENIED);
  EXPECT_EQ(g.Check({"kvtier-admin"}, nullptr, "Evict").error_code(), grpc::PERMISSION_DENIED);
  EXPECT_EQ(g.Check({"someone"}, &right, "Evict").error_code(), grpc::PERMISSION_DENIED);
}

}  // namespace
}  // namespace kvtier
