// kvtier._native.EngineConnector: KvConnector (worker/connector.h) over
// memory an engine registered (its KV pages).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/native_common.h"
#include "worker/connector.h"

namespace kvtier::python {
namespace {

// KvConnector over engine-registered memory (worker/connector.h).
class EngineConnector {
 public:
  EngineConnector(const NamespaceSpec& spec, std::vector<std::string> stores,
                  std::vector<uintptr_t> k, std::vector<uintptr_t> v, uint64_t page_stride,
                  uint64_t num_pages, uint64_t staging_blocks, int deadline_ms,
                  const std::string& shared_memory, const std::string& tls_ca,
                  const std::string& tls_cert, const std::string& tls_key,
                  const std::string& page_copier, int offload_nice) {
    worker::ConnectorOptions o;
    o.page_copier = page_copier;
    o.offload_nice = offload_nice;
    o.spec = spec;
    o.num_pages = num_pages;
    o.stores = std::move(stores);
    o.offload = "write-through";
    if (staging_blocks == 0) Invalid("staging_blocks must be at least 1");
    o.staging_blocks = staging_blocks;
    o.data = DataOptions(deadline_ms, shared_memory, Tls{tls_ca, tls_cert, tls_key});
    gpu::PageMemory m;
    for (uintptr_t p : k) m.k.push_back(reinterpret_cast<uint8_t*>(p));
    for (uintptr_t p : v) m.v.push_back(reinterpret_cast<uint8_t*>(p));
    m.page_stride = page_stride;
    o.engine_memory = std::move(m);
    py::gil_scoped_release nogil;  // registers memory, may reach the store
    c_ = std::shared_ptr<worker::KvConnector>(Unwrap(worker::KvConnector::Create(std::move(o))));
  }
  ~EngineConnector() { Close(); }

  // Drops this handle's reference; the connector waits for queued saves and
  // goes once no call on another thread still holds it (idempotent).
  void Close() {
    std::shared_ptr<worker::KvConnector> last;
    {
      std::lock_guard lk(mu_);
      last = std::move(c_);
    }
    py::gil_scoped_release nogil;
    last.reset();
  }

  // The connector for one call: held until the call returns, so a Close()
  // on another thread (the GIL is released while calls wait) cannot free it
  // underneath.
  std::shared_ptr<worker::KvConnector> c() {
    std::lock_guard lk(mu_);
    if (!c_) throw StatusError(absl::FailedPreconditionError("the connector is closed"));
    return c_;
  }

  py::tuple Lookup(uint64_t request, const py::array& hashes, uint32_t skip_blocks,
                   std::optional<double> budget_ms) {
    auto chain = ChainFrom(hashes);
    std::optional<std::chrono::milliseconds> budget;
    if (budget_ms) {
      if (!(*budget_ms > 0 && *budget_ms < 1e9)) {
        Check(absl::InvalidArgumentError(
            absl::StrCat("budget_ms must be a positive number of milliseconds, not ", *budget_ms)));
      }
      budget = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*budget_ms)));
    }
    auto held = c();
    worker::KvConnector& k = *held;
    absl::StatusOr<worker::KvConnector::Match> m;
    {
      py::gil_scoped_release nogil;
      m = k.Lookup(request, std::move(chain), skip_blocks, budget);
    }
    Check(m.status());
    py::object store_error = py::none();
    if (!m->store_status.ok()) store_error = PyError(m->store_status);
    return py::make_tuple(m->store_blocks, store_error);
  }
  void StartLoad(uint64_t request, const py::handle& pages) {
    auto p = Uint32sFrom(pages, "pages");
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    Check(k.StartLoadInto(request, std::move(p)));
  }
  void WaitForLayer(uint64_t request, uint32_t layer) {
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    Check(k.WaitForLayer(request, layer));
  }
  uint32_t WaitForLoad(uint64_t request) {
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    return Unwrap(k.WaitForLoad(request));
  }
  void Save(uint64_t request, uint32_t first_block, const py::handle& pages, bool skip_known,
            std::optional<double> wait_ms) {
    auto p = Uint32sFrom(pages, "pages");
    std::optional<int> wait;
    if (wait_ms) {
      if (!(*wait_ms >= 0 && *wait_ms < 1e9)) {
        Check(absl::InvalidArgumentError(
            absl::StrCat("wait_ms must be a number of milliseconds >= 0, not ", *wait_ms)));
      }
      wait = static_cast<int>(std::ceil(*wait_ms));
    }
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    Check(k.SaveFrom(request, first_block, p, skip_known, wait));
  }
  void WaitForSave(uint64_t request) {
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    Check(k.WaitForSave(request));
  }
  void Finished(uint64_t request) {
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    k.Finished(request);
  }
  uint32_t LoadedFromDisk(uint64_t request) { return c()->LoadedFromDisk(request); }
  py::dict LoadTimes(uint64_t request) {
    worker::LoadTimes t = c()->LoadTimesOf(request);
    py::dict d = TimesDict(t.transfer);
    d["staging_ms"] = t.staging_ms;
    d["scatter_ms"] = t.scatter_ms;
    return d;
  }
  py::dict Stats() {
    worker::ConnectorStats s = c()->stats();
    py::dict d;
    d["loads"] = s.loads;
    d["loaded_blocks"] = s.loaded_blocks;
    d["load_failures"] = s.load_failures;
    d["offloaded_blocks"] = s.offloaded_blocks;
    d["offload_skipped_known"] = s.offload_skipped_known;
    d["offload_dropped_full"] = s.offload_dropped_full;
    d["offload_no_staging"] = s.offload_no_staging;
    d["offload_failures"] = s.offload_failures;
    d["offload_no_space"] = s.offload_no_space;
    d["offload_busy"] = s.offload_busy;
    d["staging_peak"] = s.staging_peak;
    d["staging_in_use"] = s.staging_in_use;
    d["offload_blocks_in_flight"] = s.offload_blocks_in_flight;
    d["staging_blocks"] = s.staging_blocks;
    d["corrupt_dropped"] = s.corrupt_dropped;
    d["in_place_blocks"] = s.in_place_blocks;
    d["in_place_saved"] = s.in_place_saved;
    d["offload_batches"] = s.offload_batches;
    d["offload_round_trips"] = s.offload_round_trips;
    d["offloaded_bytes"] = s.offloaded_bytes;
    d["computed_blocks"] = s.computed_blocks;
    return d;
  }
  // Where offloading spent its time, summed over offload operations.
  py::dict OffloadTimes() {
    worker::ConnectorStats s = c()->stats();
    py::dict d = TimesDict(s.offload_times);
    d["gather_ms"] = s.offload_gather_ms;
    return d;
  }
  bool Drain(std::optional<double> timeout_s) {
    if (timeout_s && !(*timeout_s >= 0 && *timeout_s < 1e9)) {
      throw py::value_error(absl::StrCat("timeout_s must be >= 0 seconds, not ", *timeout_s));
    }
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    if (!timeout_s) {
      k.Drain();
      return true;
    }
    return k.Drain(std::chrono::steady_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(*timeout_s * 1e6)));
  }

  // The bench's C++ side (python -m kvtier.bench): `reps` loads, the same
  // calls in the same order as the Python loop makes, alternating between
  // the chains, from C++ on this connector, each after one untimed control
  // round trip to `control` (as the Python loop and kvtier-bench worker do);
  // each load's milliseconds.
  std::vector<double> LoadLoop(const std::vector<py::array>& chains_in, const py::handle& pages_in,
                               int reps, uint64_t first_id, const std::string& control_store) {
    std::vector<std::vector<BlockHash>> chains;
    for (const auto& a : chains_in) chains.push_back(ChainFrom(a));
    if (chains.empty()) Invalid("no chains");
    const std::vector<uint32_t> pages = Uint32sFrom(pages_in, "pages");
    auto held = c();
    worker::KvConnector& k = *held;
    std::vector<double> ms;
    py::gil_scoped_release nogil;
    StoreClient control(control_store);
    for (int r = 0; r < reps; ++r) {
      const uint64_t id = first_id + static_cast<uint64_t>(r);
      Check(control.Lookup(k.namespace_id(), {chains[0][0]}).status());
      const auto t = std::chrono::steady_clock::now();
      auto load = [&]() -> absl::Status {
        auto m = k.Lookup(id, chains[r % chains.size()], 0);
        if (!m.ok()) return m.status();
        if (m->store_blocks < pages.size()) {
          return absl::InternalError("the store lost blocks during the bench");
        }
        if (auto s = k.StartLoadInto(id, pages); !s.ok()) return s;
        if (auto s = k.WaitForLayer(id, 0); !s.ok()) return s;
        return k.WaitForLoad(id).status();
      };
      const absl::Status s = load();
      const double elapsed =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      k.Finished(id);  // on every path: no request or pin left open
      Check(s);
      ms.push_back(elapsed);
    }
    return ms;
  }

 private:
  std::mutex mu_;  // c_
  std::shared_ptr<worker::KvConnector> c_;
};

}  // namespace

void BindEngineConnector(py::module_& m) {
  py::class_<EngineConnector>(m, "EngineConnector")
      .def(py::init<const NamespaceSpec&, std::vector<std::string>, std::vector<uintptr_t>,
                    std::vector<uintptr_t>, uint64_t, uint64_t, uint64_t, int, const std::string&,
                    const std::string&, const std::string&, const std::string&, const std::string&,
                    int>(),
           py::arg("spec"), py::arg("stores"), py::arg("k"), py::arg("v"), py::arg("page_stride"),
           py::arg("num_pages"), py::arg("staging_blocks") = 64, py::arg("deadline_ms") = 10000,
           py::arg("shared_memory") = "auto", py::arg("tls_ca") = "", py::arg("tls_cert") = "",
           py::arg("tls_key") = "", py::arg("page_copier") = "", py::arg("offload_nice") = 10)
      .def("close", &EngineConnector::Close)
      .def("lookup", &EngineConnector::Lookup, py::arg("request"), py::arg("hashes"),
           py::arg("skip_blocks"), py::arg("budget_ms") = py::none())
      .def("start_load", &EngineConnector::StartLoad)
      .def("wait_for_layer", &EngineConnector::WaitForLayer)
      .def("wait_for_load", &EngineConnector::WaitForLoad)
      .def("save", &EngineConnector::Save, py::arg("request"), py::arg("first_block"),
           py::arg("pages"), py::arg("skip_known") = false, py::arg("wait_ms") = py::none())
      .def("wait_for_save", &EngineConnector::WaitForSave)
      .def("finished", &EngineConnector::Finished)
      .def("loaded_from_disk", &EngineConnector::LoadedFromDisk)
      .def("load_times", &EngineConnector::LoadTimes)
      .def("stats", &EngineConnector::Stats)
      .def("offload_times", &EngineConnector::OffloadTimes)
      .def("drain", &EngineConnector::Drain, py::arg("timeout_s") = py::none())
      .def("_load_loop", &EngineConnector::LoadLoop);
}

}  // namespace kvtier::python
