// Prometheus exposition for kvtier's servers (prometheus-cpp's pull
// exposer). Metrics are built at scrape time from the server's own
// counters, so nothing is counted twice. Names follow Prometheus
// conventions: kvtier_<component>_..., base units (bytes, seconds),
// counters end in _total.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/histogram.h"

namespace kvtier {

// Builds metric families; each Add* call appends one sample.
class MetricsBuilder {
 public:
  using Labels = std::map<std::string, std::string>;
  void Gauge(const std::string& name, const std::string& help, double value, const Labels& l = {});
  void Counter(const std::string& name, const std::string& help, double value,
               const Labels& l = {});
  // A LatencyHistogram (microsecond buckets) as a histogram in seconds.
  void Histogram(const std::string& name, const std::string& help,
                 const LatencyHistogram::Snapshot& s, const Labels& l = {});
  std::vector<prometheus::MetricFamily> Take();

 private:
  prometheus::MetricFamily& Family(const std::string& name, const std::string& help,
                                   prometheus::MetricType type);
  std::vector<prometheus::MetricFamily> families_;
  std::map<std::string, size_t> index_;
};

// Prometheus's standard process metrics of this process (from /proc):
// process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_start_time_seconds,
// process_open_fds, process_max_fds.
void AddProcessMetrics(MetricsBuilder& m);

// Serves GET /metrics on HOST:PORT; collect() is called on every scrape,
// and the process metrics are added to what it returns.
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& listen, std::function<std::vector<prometheus::MetricFamily>()> collect);
  int port() const { return port_; }

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Collectable> collectable_;
  int port_ = 0;
};

}  // namespace kvtier
