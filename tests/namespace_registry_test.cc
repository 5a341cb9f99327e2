// NamespaceRegistry on its own, over a real RocksDB-backed disk tier:
// registration and its refusals, persistence across a restart, the limit on
// how many are registered, removal.
#include <gtest/gtest.h>

#include "cachestore/disk_tier.h"
#include "cachestore/namespace_registry.h"
#include "common/block_key.h"
#include "tests/test_util.h"

namespace kvtier::store {
namespace {

NamespaceSpec Spec(const std::string& model) {
  // 2 x 2 layers x 2 heads x 64 dim x 2 bytes x 16 tokens = 16 KiB blocks.
  return NamespaceSpec{model, "fp16", 2, 2, 64, 16, 0, 1, "", "", ""};
}
constexpr uint64_t kMaxBlock = 1 << 20;

std::unique_ptr<DiskTier> OpenDisk(const std::string& dir) {
  DiskTierOptions o;
  o.dir = dir;
  o.bytes = 64 << 20;
  auto t = DiskTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(NamespaceRegistry, RegistersFindsListsAndRemoves) {
  testing::TempDir dir;
  auto disk = OpenDisk(dir.path());
  auto reg = NamespaceRegistry::Load(disk.get());
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto a = (*reg)->Register(Spec("a"), 0, kMaxBlock);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->id, NamespaceId(Spec("a")));
  EXPECT_EQ(a->block_bytes, 16u << 10);
  EXPECT_EQ(a->client_id, a->id) << "without tenants the client names the store's id";
  // Registering again is the same namespace, not a second one.
  auto again = (*reg)->Register(Spec("a"), a->id, kMaxBlock);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id, a->id);
  ASSERT_TRUE((*reg)->Register(Spec("b"), 0, kMaxBlock).ok());
  EXPECT_EQ((*reg)->List().size(), 2u);
  EXPECT_TRUE((*reg)->Find(a->id).ok());
  auto gone = (*reg)->Remove(a->id);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ((*reg)->Find(a->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE((*reg)->Find(a->id).status().message().find(NamespaceName(a->id)), std::string::npos)
      << (*reg)->Find(a->id).status();
  EXPECT_EQ((*reg)->Remove(a->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*reg)->List().size(), 1u);
}

TEST(NamespaceRegistry, RefusesBadSpecsWrongIdsAndBlocksTooLarge) {
  testing::TempDir dir;
  auto disk = OpenDisk(dir.path());
  auto reg = NamespaceRegistry::Load(disk.get());
  ASSERT_TRUE(reg.ok());
  NamespaceSpec bad = Spec("m");
  bad.layers = 0;
  EXPECT_EQ((*reg)->Register(bad, 0, kMaxBlock).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto wrong = (*reg)->Register(Spec("m"), 12345, kMaxBlock);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
  auto big = (*reg)->Register(Spec("m"), 0, 8 << 10);  // 16 KiB blocks, 8 KiB slots
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument) << big.status();
  EXPECT_NE(big.status().message().find("--ram-slab-bytes"), std::string::npos) << big.status();
  EXPECT_TRUE((*reg)->List().empty()) << "a refused namespace is not registered";
}

TEST(NamespaceRegistry, SurvivesARestartAndCountsItsLimitAcrossIt) {
  testing::TempDir dir;
  uint64_t a_id = 0;
  {
    auto disk = OpenDisk(dir.path());
    auto reg = NamespaceRegistry::Load(disk.get(), /*max_namespaces=*/2);
    ASSERT_TRUE(reg.ok());
    a_id = (*reg)->Register(Spec("a"), 0, kMaxBlock)->id;
    ASSERT_TRUE((*reg)->Register(Spec("b"), 0, kMaxBlock).ok());
    auto full = (*reg)->Register(Spec("c"), 0, kMaxBlock);
    EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
    EXPECT_NE(full.status().message().find("--max-namespaces"), std::string::npos) << full.status();
  }
  auto disk = OpenDisk(dir.path());
  auto reg = NamespaceRegistry::Load(disk.get(), 2);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ((*reg)->List().size(), 2u) << "both came back";
  EXPECT_EQ((*reg)->Find(a_id)->spec.model, "a");
  EXPECT_EQ((*reg)->Register(Spec("c"), 0, kMaxBlock).status().code(),
            absl::StatusCode::kResourceExhausted)
      << "the loaded namespaces count against the limit";
  ASSERT_TRUE((*reg)->Remove(a_id).ok());
  EXPECT_TRUE((*reg)->Register(Spec("c"), 0, kMaxBlock).ok()) << "removal frees a place";
  EXPECT_EQ((*reg)->skipped_records(), 0u);
}

}  // namespace
}  // namespace kvtier::store
