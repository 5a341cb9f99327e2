// SourceAuth and the --source-identities file on their own: who may speak
// for which source once hellos are bound to client certificates.
#include <gtest/gtest.h>

#include "router/source_auth.h"

namespace kvtier::router {
namespace {

v1::Hello Hello(const std::string& id, v1::SourceKind kind) {
  v1::Hello h;
  h.set_source_id(id);
  h.set_kind(kind);
  return h;
}

TEST(SourceIdentities, ParsesLinesAndNamesTheLineOfEachMistake) {
  auto ok = ParseSourceIdentities(
      "# who may publish\n"
      "engine-a worker\n"
      "\n"
      "stores store kvtier-store-* other-store   # a prefix and a name\n");
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].identity, "engine-a");
  EXPECT_EQ((*ok)[0].kind, v1::SOURCE_WORKER);
  EXPECT_EQ((*ok)[0].ids, std::vector<std::string>{"engine-a"}) << "its own name by default";
  EXPECT_EQ((*ok)[1].ids, (std::vector<std::string>{"kvtier-store-*", "other-store"}));
  struct Case {
    const char* text;
    const char* says;
  };
  for (const Case& c : {Case{"a worker\nb\n", "line 2: expected IDENTITY KIND"},
                        Case{"a router\n", "kind \"router\""}, Case{"a store *\n", "\"*\" alone"},
                        Case{"a worker\na store\n", "line 2: identity a is listed twice"}}) {
    auto r = ParseSourceIdentities(c.text);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status();
  }
}

TEST(SourceAuth, WithoutMutualTlsEveryHelloIsTakenAtItsWord) {
  SourceAuth open;
  EXPECT_FALSE(open.authenticates());
  EXPECT_TRUE(open.Check({}, Hello("anyone", v1::SOURCE_STORE)).ok());
  // A list of identities means nothing without client certificates.
  auto r = SourceAuth::Make(false, *ParseSourceIdentities("a worker\n"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--tls-require-client-cert"), std::string::npos);
}

TEST(SourceAuth, ByDefaultTheCertificateMustNameTheSourceItClaims) {
  auto auth = SourceAuth::Make(true, {});
  ASSERT_TRUE(auth.ok());
  EXPECT_TRUE(auth->authenticates());
  EXPECT_TRUE(auth->Check({"cn-x", "worker-7"}, Hello("worker-7", v1::SOURCE_WORKER)).ok());
  auto forged = auth->Check({"worker-7"}, Hello("worker-8", v1::SOURCE_WORKER));
  EXPECT_EQ(forged.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(forged.message().find("\"worker-8\""), std::string::npos) << forged;
  EXPECT_NE(forged.message().find("\"worker-7\""), std::string::npos) << forged;
}

TEST(SourceAuth, TheIdentitiesFileDecidesKindsIdsAndPrefixes) {
  auto auth = SourceAuth::Make(
      true, *ParseSourceIdentities("shared-store-cert store kvtier-store-*\nengine worker\n"));
  ASSERT_TRUE(auth.ok());
  EXPECT_TRUE(auth->Check({"shared-store-cert"}, Hello("kvtier-store-3", v1::SOURCE_STORE)).ok());
  // The prefix does not match another id, nor the right id as another kind.
  EXPECT_EQ(auth->Check({"shared-store-cert"}, Hello("evil-3", v1::SOURCE_STORE)).code(),
            absl::StatusCode::kPermissionDenied);
  auto kind = auth->Check({"shared-store-cert"}, Hello("kvtier-store-3", v1::SOURCE_WORKER));
  EXPECT_EQ(kind.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(kind.message().find("worker"), std::string::npos) << kind;
  EXPECT_TRUE(auth->Check({"engine"}, Hello("engine", v1::SOURCE_WORKER)).ok());
  // A certificate the file does not list may not publish at all, even for
  // the id it names.
  auto unlisted = auth->Check({"kvtier-store-9"}, Hello("kvtier-store-9", v1::SOURCE_STORE));
  EXPECT_EQ(unlisted.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(unlisted.message().find("none of which --source-identities lists"), std::string::npos)
      << unlisted;
}

}  // namespace
}  // namespace kvtier::router
