// The engine pods' deletion costs (frontend/deletion_cost.h): a PodList
// read as the Kubernetes API answers it, each pod's cost from the blocks only
// its engine holds, and the merge patch. No cluster here: the API calls are
// not run (docs/operations.md says what was).
#include "frontend/deletion_cost.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace kvtier::frontend {
namespace {

router::SourceInfo Engine(const std::string& endpoint, uint64_t sole_blocks) {
  router::SourceInfo s;
  s.source_id = endpoint;
  s.kind = router::SourceKind::kWorker;
  s.endpoint = endpoint;
  s.sole_blocks = sole_blocks;
  return s;
}

TEST(DeletionCost, APodListIsReadWithEachPodsIpAnnotationAndState) {
  const char* list = R"({"kind":"PodList","apiVersion":"v1","items":[
    {"metadata":{"name":"engine-a","annotations":{
        "controller.kubernetes.io/pod-deletion-cost":"4096","other":"x"}},
     "status":{"podIP":"10.0.0.7"}},
    {"metadata":{"name":"engine-b"},"status":{"podIP":"10.0.0.8"}},
    {"metadata":{"name":"engine-c","deletionTimestamp":"2026-11-29T03:00:00Z",
        "annotations":{"controller.kubernetes.io/pod-deletion-cost":"not a number"}},
     "status":{}}]})";
  auto pods = ParsePodList(list);
  ASSERT_TRUE(pods.ok()) << pods.status();
  ASSERT_EQ(pods->size(), 3u);
  EXPECT_EQ((*pods)[0].name, "engine-a");
  EXPECT_EQ((*pods)[0].ip, "10.0.0.7");
  EXPECT_EQ((*pods)[0].cost, 4096);
  EXPECT_FALSE((*pods)[0].terminating);
  EXPECT_FALSE((*pods)[1].cost.has_value());
  EXPECT_TRUE((*pods)[2].terminating);
  EXPECT_FALSE((*pods)[2].cost.has_value());
  EXPECT_EQ((*pods)[2].ip, "");
  for (const char* bad : {"", "[]", R"({"kind":"Status"})", R"({"items":[{"status":{}}]})",
                          R"({"items":[{"metadata":{}}]})"}) {
    auto r = ParsePodList(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(DeletionCost, EachPodCostsThePromptTokensOnlyItsEngineHolds) {
  const std::vector<router::SourceInfo> sources = {
      Engine("10.0.0.7:8000", 100), Engine("10.0.0.8:8000", 3), Engine("10.0.0.9:8000", 0)};
  router::SourceInfo store;
  store.source_id = "store-0";
  store.kind = router::SourceKind::kStore;
  std::vector<router::SourceInfo> with_store = sources;
  with_store.push_back(store);
  std::vector<EnginePod> pods = {{"a", "10.0.0.7", std::nullopt, false},
                                 {"b", "10.0.0.8", std::nullopt, false},
                                 {"c", "10.0.0.9", std::nullopt, false},
                                 {"new", "10.0.0.10", std::nullopt, false},  // not yet an engine
                                 {"going", "10.0.0.11", std::nullopt, true},
                                 {"pending", "", std::nullopt, false}};
  auto plan = PlanDeletionCosts(with_store, 16, pods);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].pod, "a");
  EXPECT_EQ(plan[0].cost, 1600);
  EXPECT_EQ(plan[1].cost, 48);
  EXPECT_EQ(plan[2].cost, 0);
  EXPECT_EQ(plan[3].pod, "new");
  EXPECT_EQ(plan[3].cost, 0);
  // The cheapest pod is the one a scale-down removes first.
  // Set, the annotation changes only when it moved by a block's tokens and
  // a tenth: no churn on the API.
  pods[0].cost = 1590;  // within 10%
  pods[1].cost = 48;    // the same
  pods[2].cost = 10;    // within one block (16 tokens)
  pods[3].cost = 0;
  plan = PlanDeletionCosts(sources, 16, pods);
  EXPECT_TRUE(plan.empty());
  pods[0].cost = 1000;  // 1600 now: moved by more than a tenth
  plan = PlanDeletionCosts(sources, 16, pods);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].pod, "a");
  EXPECT_EQ(plan[0].cost, 1600);
  // Huge holdings stay within the annotation's int32.
  plan = PlanDeletionCosts({Engine("10.0.0.7:8000", uint64_t{1} << 40)}, 16,
                           {{"a", "10.0.0.7", std::nullopt, false}});
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].cost, 2147483647);
  // An IPv6 engine endpoint matches its pod's address.
  plan =
      PlanDeletionCosts({Engine("[fd00::7]:8000", 2)}, 16, {{"a", "fd00::7", std::nullopt, false}});
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].cost, 32);
}

TEST(DeletionCost, ThePatchSetsOnlyTheAnnotation) {
  const auto j = nlohmann::json::parse(DeletionCostPatchBody(1600));
  EXPECT_EQ(
      j,
      nlohmann::json::parse(
          R"({"metadata":{"annotations":{"controller.kubernetes.io/pod-deletion-cost":"1600"}}})"));
}

TEST(DeletionCost, OutsideAPodTheUpdaterRefusesToStartSayingWhy) {
  unsetenv("KUBERNETES_SERVICE_HOST");
  auto u = DeletionCostUpdater::Start({"app=engine", "", 1000}, 16,
                                      [] { return std::vector<router::SourceInfo>{}; });
  EXPECT_EQ(u.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(u.status().message().find("KUBERNETES_SERVICE_HOST"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::frontend
