// The cheapest engine pod leaves first (docs/operations.md, "Scaling without
// losing the cache"): kvtier-frontend keeps each engine pod's
// controller.kubernetes.io/pod-deletion-cost annotation at the prompt tokens
// of the blocks only that engine holds (no other engine, no store shard: the
// router's sole blocks, router::SourceInfo::sole_blocks), so a Deployment
// scaled down removes the pod whose loss costs the fleet least.
//
// The plan (which pods need a new value) is pure and unit-tested; the
// updater runs it every interval against the Kubernetes API with the pod's
// service account (in-cluster: KUBERNETES_SERVICE_HOST/PORT, the account's
// token, CA and namespace), listing the engine pods by label selector and
// patching the annotation where it changed by more than a block's tokens
// and a tenth (Kubernetes asks that it not churn).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/rpc/metrics.h"
#include "router/source_messages.h"

namespace kvtier::frontend {

inline constexpr char kDeletionCostAnnotation[] = "controller.kubernetes.io/pod-deletion-cost";

// An engine pod as the Kubernetes API lists it.
struct EnginePod {
  std::string name;
  std::string ip;               // status.podIP ("" before it has one)
  std::optional<int64_t> cost;  // the annotation now, if set and a number
  bool terminating = false;     // metadata.deletionTimestamp set
};

// The pods of a PodList (GET /api/v1/namespaces/NS/pods). INVALID_ARGUMENT
// for a body that is not a PodList.
absl::StatusOr<std::vector<EnginePod>> ParsePodList(absl::string_view json);

struct CostPatch {
  std::string pod;
  int64_t cost = 0;
};

// Each live pod's cost: the sole blocks x block_tokens of the worker whose
// endpoint's host is the pod's IP (0 for a pod the router does not know:
// it holds nothing yet), at most INT32_MAX. A pod is patched when its
// annotation is missing or differs from the cost by at least block_tokens
// and a tenth of the larger; terminating pods and pods without an IP are
// left alone.
std::vector<CostPatch> PlanDeletionCosts(const std::vector<router::SourceInfo>& sources,
                                         uint32_t block_tokens, const std::vector<EnginePod>& pods);

// The merge patch that sets the annotation.
std::string DeletionCostPatchBody(int64_t cost);

struct DeletionCostOptions {
  std::string selector;       // label selector of the engine pods; "" : off
  std::string k8s_namespace;  // "" : the service account's
  uint64_t interval_ms = 30000;
};

class DeletionCostUpdater {
 public:
  using SourcesFn = std::function<std::vector<router::SourceInfo>()>;
  // Reads the in-cluster configuration now: FAILED_PRECONDITION naming
  // what is missing (not in a pod, no service account token mounted).
  static absl::StatusOr<std::unique_ptr<DeletionCostUpdater>> Start(DeletionCostOptions options,
                                                                    uint32_t block_tokens,
                                                                    SourcesFn sources);
  ~DeletionCostUpdater();  // stops its thread

  // Its series (patches made, rounds failed) added to `m`.
  void AddMetrics(MetricsBuilder& m) const;

 private:
  DeletionCostUpdater() = default;
  void Loop();
  absl::Status Round();
  absl::StatusOr<std::string> Call(const std::string& method, const std::string& target,
                                   const std::string& body, const std::string& content_type);

  static constexpr std::chrono::seconds kCallTimeout{10};
  static constexpr uint64_t kMaxAnswerBytes = 256 << 20;

  DeletionCostOptions options_;
  uint32_t block_tokens_ = 0;
  SourcesFn sources_;
  std::string host_, port_, token_file_, ca_file_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<uint64_t> patches_{0}, failed_rounds_{0};
  std::chrono::steady_clock::time_point last_logged_{};
  std::thread thread_;
};

}  // namespace kvtier::frontend
