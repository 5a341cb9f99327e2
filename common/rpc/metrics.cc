#include "common/rpc/metrics.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

namespace {

class FunctionCollectable final : public prometheus::Collectable {
 public:
  explicit FunctionCollectable(std::function<std::vector<prometheus::MetricFamily>()> f)
      : f_(std::move(f)) {}
  std::vector<prometheus::MetricFamily> Collect() const override { return f_(); }

 private:
  std::function<std::vector<prometheus::MetricFamily>()> f_;
};

prometheus::ClientMetric WithLabels(const MetricsBuilder::Labels& l) {
  prometheus::ClientMetric m;
  for (const auto& [k, v] : l) m.label.push_back({k, v});
  return m;
}

}  // namespace

prometheus::MetricFamily& MetricsBuilder::Family(const std::string& name, const std::string& help,
                                                 prometheus::MetricType type) {
  auto it = index_.find(name);
  if (it != index_.end()) return families_[it->second];
  index_[name] = families_.size();
  families_.push_back(prometheus::MetricFamily{name, help, type, {}});
  return families_.back();
}

void MetricsBuilder::Gauge(const std::string& name, const std::string& help, double value,
                           const Labels& l) {
  auto m = WithLabels(l);
  m.gauge.value = value;
  Family(name, help, prometheus::MetricType::Gauge).metric.push_back(std::move(m));
}

void MetricsBuilder::Counter(const std::string& name, const std::string& help, double value,
                             const Labels& l) {
  auto m = WithLabels(l);
  m.counter.value = value;
  Family(name, help, prometheus::MetricType::Counter).metric.push_back(std::move(m));
}

void MetricsBuilder::Histogram(const std::string& name, const std::string& help,
                               const LatencyHistogram::Snapshot& s, const Labels& l) {
  auto m = WithLabels(l);
  m.histogram.sample_count = s.count;
  m.histogram.sample_sum = static_cast<double>(s.sum_us) / 1e6;
  uint64_t cumulative = 0;
  for (size_t b = 0; b < s.counts.size(); ++b) {
    cumulative += s.counts[b];
    double upper = s.upper_us[b] == 0 ? std::numeric_limits<double>::infinity()
                                      : static_cast<double>(s.upper_us[b]) / 1e6;
    m.histogram.bucket.push_back({cumulative, upper});
  }
  Family(name, help, prometheus::MetricType::Histogram).metric.push_back(std::move(m));
}

std::vector<prometheus::MetricFamily> MetricsBuilder::Take() { return std::move(families_); }

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::vector<prometheus::MetricFamily>()> collect) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  try {
    s->exposer_ = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  s->collectable_ = std::make_shared<FunctionCollectable>(std::move(collect));
  s->exposer_->RegisterCollectable(s->collectable_);
  auto ports = s->exposer_->GetListeningPorts();
  s->port_ = ports.empty() ? 0 : ports[0];
  return s;
}

}  // namespace kvtier
