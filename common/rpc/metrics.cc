#include "common/rpc/metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

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

void AddProcessMetrics(MetricsBuilder& m) {
  // /proc/self/stat: fields after the command's closing parenthesis; utime
  // and stime (clock ticks) are fields 14 and 15, starttime (ticks after
  // boot) 22, vsize (bytes) 23, rss (pages) 24.
  std::ifstream stat("/proc/self/stat");
  std::string line;
  if (std::getline(stat, line)) {
    std::istringstream rest(line.substr(line.rfind(')') + 2));
    std::vector<std::string> f;
    for (std::string x; rest >> x;) f.push_back(x);  // f[0] is field 3
    const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
    if (f.size() > 21 && tick > 0) {
      m.Counter("process_cpu_seconds_total", "User and system CPU time spent in seconds",
                (std::stod(f[11]) + std::stod(f[12])) / tick);
      m.Gauge("process_virtual_memory_bytes", "Virtual memory size in bytes", std::stod(f[20]));
      m.Gauge("process_resident_memory_bytes", "Resident memory size in bytes",
              std::stod(f[21]) * static_cast<double>(sysconf(_SC_PAGESIZE)));
      std::ifstream boot("/proc/stat");
      for (std::string key; boot >> key;) {
        if (key == "btime") {
          double btime = 0;
          boot >> btime;
          m.Gauge("process_start_time_seconds",
                  "Start time of the process since unix epoch in seconds",
                  btime + std::stod(f[19]) / tick);
          break;
        }
      }
    }
  }
  std::error_code ec;
  size_t fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  if (!ec) m.Gauge("process_open_fds", "Number of open file descriptors", static_cast<double>(fds));
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    m.Gauge("process_max_fds", "Maximum number of open file descriptors",
            static_cast<double>(lim.rlim_cur));
  }
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::vector<prometheus::MetricFamily>()> collect) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  try {
    s->exposer_ = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  // Every server also exports Prometheus's standard process metrics.
  s->collectable_ = std::make_shared<FunctionCollectable>([collect = std::move(collect)] {
    std::vector<prometheus::MetricFamily> families = collect();
    MetricsBuilder process;
    AddProcessMetrics(process);
    for (auto& f : process.Take()) families.push_back(std::move(f));
    return families;
  });
  s->exposer_->RegisterCollectable(s->collectable_);
  auto ports = s->exposer_->GetListeningPorts();
  s->port_ = ports.empty() ? 0 : ports[0];
  return s;
}

}  // namespace kvtier
