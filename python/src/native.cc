// kvtier._native: the C++ side of the kvtier Python package (pybind11).
//
// It binds the library directly (not the C ABI): the namespace and block
// hashing, the sharded store client, the worker connector over
// engine-registered memory, and a gRPC server that serves kvtier.v1.SimWorker
// for a Python engine and publishes its KV events and heartbeats to routers.
// The Python modules in python/kvtier wrap these with tensors and types.
//
// Rules kept everywhere here:
//  - arguments are converted (and checked) while the GIL is held; every call
//    that can wait on the network or on staging memory then releases it;
//  - an absl::Status error becomes kvtier.errors.KvtierError (the subclass
//    for its code) carrying the gRPC code and message: StatusError below is
//    the one C++ exception that crosses into Python, translated once;
//  - memory is named by address (an int): the Python side takes it from a
//    tensor, a buffer or a DLPack capsule and keeps that object alive.
#include <grpcpp/grpcpp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/router_client.h"
#include "client/router_fanout.h"
#include "client/store_client.h"
#include "client/store_data_client.h"
#include "common/block_key.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/tls.h"
#include "common/version.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "worker/connector.h"

namespace py = pybind11;

namespace kvtier::python {
namespace {

// The C++ exception for a failed status; translated to KvtierError.
struct StatusError : std::exception {
  explicit StatusError(absl::Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return "kvtier status error"; }
  absl::Status status;
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <typename T>
T Unwrap(absl::StatusOr<T> s) {
  Check(s.status());
  return *std::move(s);
}
[[noreturn]] void Invalid(const std::string& message) {
  throw StatusError(absl::InvalidArgumentError(message));
}

// The Python exception for a status (kvtier.errors.from_status).
py::object PyError(const absl::Status& s) {
  return py::module_::import("kvtier.errors")
      .attr("from_status")(static_cast<int>(s.code()), std::string(s.message()));
}

// Hashes from a uint64 array of shape [n, 2] (hi, lo).
std::vector<BlockHash> ChainFrom(const py::array& hashes) {
  if (hashes.ndim() != 2 || hashes.shape(1) != 2) {
    Invalid("hashes must be an array of shape [n, 2] (hi, lo), one row per block");
  }
  auto a = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(hashes);
  if (!a) Invalid("hashes must be unsigned 64-bit integers");
  std::vector<BlockHash> chain(static_cast<size_t>(a.shape(0)));
  const uint64_t* p = a.data();
  for (size_t i = 0; i < chain.size(); ++i) chain[i] = BlockHash{p[2 * i], p[2 * i + 1]};
  return chain;
}

py::array_t<uint64_t> HashArray(const std::vector<BlockHash>& chain) {
  py::array_t<uint64_t> out({static_cast<py::ssize_t>(chain.size()), py::ssize_t{2}});
  uint64_t* p = out.mutable_data();
  for (size_t i = 0; i < chain.size(); ++i) {
    p[2 * i] = chain[i].hi;
    p[2 * i + 1] = chain[i].lo;
  }
  return out;
}

// A 1-D integer sequence or array whose values each fit uint32 ("tokens",
// "pages": named in the error).
std::vector<uint32_t> Uint32sFrom(const py::handle& values, const char* what) {
  auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(values);
  if (!a || a.ndim() != 1) Invalid(absl::StrCat(what, " must be a 1-D sequence of integers"));
  std::vector<uint32_t> out(static_cast<size_t>(a.shape(0)));
  const int64_t* p = a.data();
  for (size_t i = 0; i < out.size(); ++i) {
    if (p[i] < 0 || p[i] > int64_t{UINT32_MAX}) {
      Invalid(absl::StrCat(what, "[", i, "] = ", p[i], " is negative or not a uint32"));
    }
    out[i] = static_cast<uint32_t>(p[i]);
  }
  return out;
}

NamespaceSpec SpecFrom(const std::string& model, const std::string& dtype, uint32_t layers,
                       uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens,
                       uint32_t tp_rank, uint32_t tp_size, const std::string& cache_salt,
                       const std::string& kv_wire, const std::string& layout) {
  NamespaceSpec s{model,   dtype,   layers,     kv_heads, head_dim, block_tokens,
                  tp_rank, tp_size, cache_salt, kv_wire,  layout};
  Check(ValidateNamespace(s));
  return s;
}

// TLS towards the stores' control plane: PEM file paths, "" each: unused
// (tls_ca set: TLS; with tls_cert and tls_key too: mutual TLS).
struct Tls {
  std::string ca, cert, key;
};

DataClientOptions DataOptions(int deadline_ms, const std::string& shared_memory,
                              const Tls& tls = {}) {
  DataClientOptions o;
  TlsFlags flags;
  flags.ca_file = tls.ca;
  flags.cert_file = tls.cert;
  flags.key_file = tls.key;
  o.security = Unwrap(ClientSecurity(flags));
  if (deadline_ms <= 0) Invalid("deadline_ms must be positive");
  o.deadline_ms = deadline_ms;
  if (shared_memory == "auto") {
    o.shared_memory = DataClientOptions::SharedMemory::kAuto;
  } else if (shared_memory == "on") {
    o.shared_memory = DataClientOptions::SharedMemory::kOn;
  } else if (shared_memory == "off") {
    o.shared_memory = DataClientOptions::SharedMemory::kOff;
  } else {
    Invalid("shared_memory must be \"auto\", \"on\" or \"off\", not \"" + shared_memory + "\"");
  }
  return o;
}

py::dict TimesDict(const TransferTimes& t) {
  py::dict d;
  d["control_ms"] = t.control_ms;
  d["queue_ms"] = t.queue_ms;
  d["rma_ms"] = t.rma_ms;
  d["checksum_ms"] = t.checksum_ms;
  return d;
}

// ---------------------------------------------------------------- store

class PyStoreClient {
 public:
  PyStoreClient(std::vector<std::string> addresses, int deadline_ms,
                const std::string& shared_memory, const std::string& tls_ca,
                const std::string& tls_cert, const std::string& tls_key)
      : client_(CheckAddresses(std::move(addresses)),
                DataOptions(deadline_ms, shared_memory, Tls{tls_ca, tls_cert, tls_key})) {}

  void RegisterMemory(uintptr_t addr, size_t length) {
    py::gil_scoped_release nogil;
    Check(client_.RegisterMemory(reinterpret_cast<void*>(addr), length));
  }
  uint64_t RegisterNamespace(const NamespaceSpec& spec) {
    py::gil_scoped_release nogil;
    return Unwrap(client_.RegisterNamespace(spec)).id;
  }
  uint32_t Lookup(const NamespaceSpec& spec, const py::array& hashes) {
    auto chain = ChainFrom(hashes);
    py::gil_scoped_release nogil;
    return Unwrap(client_.Lookup(NamespaceId(spec), chain));
  }
  py::dict Put(const NamespaceSpec& spec, const py::array& hashes, uintptr_t addr, size_t length) {
    auto chain = ChainFrom(hashes);
    const uint64_t bb = BlockBytes(spec);
    if (length < chain.size() * bb) {
      Invalid(absl::StrCat("the data holds ", length, " bytes; ", chain.size(), " blocks need ",
                           chain.size() * bb));
    }
    std::vector<PutBlock> blocks;
    for (size_t i = 0; i < chain.size(); ++i) {
      blocks.push_back({chain[i], reinterpret_cast<const uint8_t*>(addr) + i * bb});
    }
    return PutResult(NamespaceId(spec), bb, std::move(blocks));
  }
  uint32_t Get(const NamespaceSpec& spec, const py::array& hashes, uintptr_t addr, size_t length) {
    auto chain = ChainFrom(hashes);
    const uint64_t bb = BlockBytes(spec);
    if (length < chain.size() * bb) {
      Invalid(absl::StrCat("the destination holds ", length, " bytes; ", chain.size(),
                           " blocks need ", chain.size() * bb));
    }
    std::vector<GetBlock> blocks;
    for (size_t i = 0; i < chain.size(); ++i) {
      blocks.push_back({chain[i], reinterpret_cast<uint8_t*>(addr) + i * bb});
    }
    py::gil_scoped_release nogil;
    return Unwrap(client_.Get(NamespaceId(spec), bb, blocks)).blocks;
  }
  // Blocks at scattered addresses (an engine tier's rows): block i at
  // addresses[i]. The same outcomes as Put and Get.
  py::dict PutAt(const NamespaceSpec& spec, const py::array& hashes,
                 const std::vector<uintptr_t>& addresses) {
    auto chain = ChainFrom(hashes);
    CheckAddressCount(chain.size(), addresses.size());
    std::vector<PutBlock> blocks;
    for (size_t i = 0; i < chain.size(); ++i) {
      blocks.push_back({chain[i], reinterpret_cast<const uint8_t*>(addresses[i])});
    }
    return PutResult(NamespaceId(spec), BlockBytes(spec), std::move(blocks));
  }
  uint32_t GetAt(const NamespaceSpec& spec, const py::array& hashes,
                 const std::vector<uintptr_t>& addresses) {
    auto chain = ChainFrom(hashes);
    CheckAddressCount(chain.size(), addresses.size());
    std::vector<GetBlock> blocks;
    for (size_t i = 0; i < chain.size(); ++i) {
      blocks.push_back({chain[i], reinterpret_cast<uint8_t*>(addresses[i])});
    }
    py::gil_scoped_release nogil;
    return Unwrap(client_.Get(NamespaceId(spec), BlockBytes(spec), blocks)).blocks;
  }
  // Asks each block's shard to check its copy against the committed
  // checksum and drop it if corrupt; the number dropped.
  uint32_t VerifyBlocks(const NamespaceSpec& spec, const py::array& hashes) {
    auto chain = ChainFrom(hashes);
    py::gil_scoped_release nogil;
    return Unwrap(client_.VerifyBlocks(NamespaceId(spec), chain));
  }
  size_t shards() const { return client_.shards(); }

 private:
  static void CheckAddressCount(size_t blocks, size_t addresses) {
    if (blocks != addresses) {
      Invalid(absl::StrCat(blocks, " block hashes but ", addresses, " addresses"));
    }
  }
  py::dict PutResult(uint64_t ns, uint64_t block_bytes, std::vector<PutBlock> blocks) {
    PutOutcome o;
    {
      py::gil_scoped_release nogil;
      o = Unwrap(client_.Put(ns, block_bytes, blocks));
    }
    py::dict d;
    d["written"] = o.written;
    d["already_present"] = o.already_present;
    d["busy"] = o.busy;
    d["no_space"] = o.no_space;
    d["times"] = TimesDict(o.times);
    return d;
  }
  static std::vector<std::string> CheckAddresses(std::vector<std::string> a) {
    if (a.empty()) Invalid("at least one store address is needed");
    for (const auto& s : a) {
      if (s.empty() || s.find(':') == std::string::npos) {
        Invalid("store address \"" + s + "\" is not HOST:PORT");
      }
    }
    return a;
  }
  ShardedStoreClient client_;
};

// ------------------------------------------------------------ connector

// KvConnector over engine-registered memory (worker/connector.h).
class EngineConnector {
 public:
  EngineConnector(const NamespaceSpec& spec, std::vector<std::string> stores,
                  std::vector<uintptr_t> k, std::vector<uintptr_t> v, uint64_t page_stride,
                  uint64_t num_pages, uint64_t staging_blocks, int deadline_ms,
                  const std::string& shared_memory, const std::string& tls_ca,
                  const std::string& tls_cert, const std::string& tls_key) {
    worker::ConnectorOptions o;
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

  py::tuple Lookup(uint64_t request, const py::array& hashes, uint32_t skip_blocks) {
    auto chain = ChainFrom(hashes);
    auto held = c();
    worker::KvConnector& k = *held;
    absl::StatusOr<worker::KvConnector::Match> m;
    {
      py::gil_scoped_release nogil;
      m = k.Lookup(request, std::move(chain), skip_blocks);
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
  void Save(uint64_t request, uint32_t first_block, const py::handle& pages) {
    auto p = Uint32sFrom(pages, "pages");
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    Check(k.SaveFrom(request, first_block, p));
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
    d["offload_failures"] = s.offload_failures;
    d["staging_peak"] = s.staging_peak;
    d["staging_blocks"] = s.staging_blocks;
    d["corrupt_dropped"] = s.corrupt_dropped;
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
  void Drain() {
    auto held = c();
    worker::KvConnector& k = *held;
    py::gil_scoped_release nogil;
    k.Drain();
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

// ---------------------------------------------------------------- server

// Sets the fields of a message named by a dict's keys (numbers and strings);
// INVALID_ARGUMENT naming a key the message does not have.
absl::Status FillMessage(const py::dict& d, google::protobuf::Message* m) {
  const auto* desc = m->GetDescriptor();
  const auto* refl = m->GetReflection();
  for (auto item : d) {
    const std::string key = py::str(item.first);
    const auto* f = desc->FindFieldByName(key);
    if (f == nullptr || f->is_repeated()) {
      return absl::InvalidArgumentError(absl::StrCat(desc->name(), " has no field \"", key, "\""));
    }
    py::handle v = item.second;
    using FD = google::protobuf::FieldDescriptor;
    // A value of another type raises py::cast_error, which must not leave
    // a gRPC handler: it becomes this field's error.
    try {
      switch (f->cpp_type()) {
        case FD::CPPTYPE_DOUBLE:
          refl->SetDouble(m, f, v.cast<double>());
          break;
        case FD::CPPTYPE_FLOAT:
          refl->SetFloat(m, f, v.cast<float>());
          break;
        case FD::CPPTYPE_UINT64:
          refl->SetUInt64(m, f, v.cast<uint64_t>());
          break;
        case FD::CPPTYPE_UINT32:
          refl->SetUInt32(m, f, v.cast<uint32_t>());
          break;
        case FD::CPPTYPE_INT64:
          refl->SetInt64(m, f, v.cast<int64_t>());
          break;
        case FD::CPPTYPE_INT32:
          refl->SetInt32(m, f, v.cast<int32_t>());
          break;
        case FD::CPPTYPE_BOOL:
          refl->SetBool(m, f, v.cast<bool>());
          break;
        case FD::CPPTYPE_STRING:
          refl->SetString(m, f, v.cast<std::string>());
          break;
        case FD::CPPTYPE_MESSAGE: {
          if (!py::isinstance<py::dict>(v)) {
            return absl::InvalidArgumentError(absl::StrCat("field \"", key, "\" needs a dict"));
          }
          if (auto s = FillMessage(v.cast<py::dict>(), refl->MutableMessage(m, f)); !s.ok())
            return s;
          break;
        }
        default:
          return absl::InvalidArgumentError(absl::StrCat("field \"", key, "\" cannot be set here"));
      }
    } catch (const py::cast_error&) {
      return absl::InvalidArgumentError(
          absl::StrCat(desc->name(), ".", key, " must be a ", f->cpp_type_name(), ", not ",
                       std::string(py::str(py::type::of(v).attr("__name__")))));
    }
  }
  return absl::OkStatus();
}

// The status a Python exception from a handler becomes: a KvtierError's own
// code, INVALID_ARGUMENT for ValueError / TypeError, INTERNAL otherwise.
grpc::Status FromPython(py::error_already_set& e) {
  py::object errors = py::module_::import("kvtier.errors");
  std::string message = py::str(e.value());
  grpc::StatusCode code = grpc::StatusCode::INTERNAL;
  if (e.matches(errors.attr("KvtierError"))) {
    code = static_cast<grpc::StatusCode>(e.value().attr("code").cast<int>());
    message = e.value().attr("message").cast<std::string>();
  } else if (e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError)) {
    code = grpc::StatusCode::INVALID_ARGUMENT;
  }
  return grpc::Status(code, message);
}

// kvtier.v1.SimWorker for a Python engine: each call runs the handler's
// submit(dict) -> dict / stats() -> dict with the GIL held.
class PyWorkerService final : public v1::SimWorker::Service {
 public:
  explicit PyWorkerService(py::object handler) : handler_(std::move(handler)) {}
  ~PyWorkerService() override {
    py::gil_scoped_acquire gil;
    handler_ = py::object();
  }

  grpc::Status Submit(grpc::ServerContext*, const v1::SubmitRequest* req,
                      v1::SubmitResponse* resp) override {
    auto done = fence_.Enter();
    py::gil_scoped_acquire gil;
    try {
      py::dict d;
      d["request_id"] = req->request_id();
      d["prompt_tokens"] = req->prompt_tokens();
      d["output_tokens"] = req->output_tokens();
      d["tokens"] = py::none();
      d["hashes"] = py::none();
      if (req->prompt_case() == v1::SubmitRequest::kTokens) {
        const auto& ids = req->tokens().ids();
        py::array_t<int64_t> t(ids.size());
        int64_t* p = t.mutable_data();
        for (int i = 0; i < ids.size(); ++i) p[i] = ids[i];
        d["tokens"] = t;
      } else if (req->prompt_case() == v1::SubmitRequest::kHashes) {
        std::vector<BlockHash> chain;
        for (const auto& h : req->hashes().hashes()) chain.push_back({h.hi(), h.lo()});
        d["hashes"] = HashArray(chain);
      }
      py::object r = handler_.attr("submit")(d);
      if (!py::isinstance<py::dict>(r)) {
        return grpc::Status(grpc::StatusCode::INTERNAL,
                            "the engine's submit did not return a dict");
      }
      return ToGrpc(FillMessage(r.cast<py::dict>(), resp));
    } catch (py::error_already_set& e) {
      return FromPython(e);
    }
  }

  grpc::Status GetWorkerStats(grpc::ServerContext*, const v1::GetWorkerStatsRequest*,
                              v1::GetWorkerStatsResponse* resp) override {
    auto done = fence_.Enter();
    py::gil_scoped_acquire gil;
    try {
      py::object r = handler_.attr("stats")();
      if (!py::isinstance<py::dict>(r)) {
        return grpc::Status(grpc::StatusCode::INTERNAL, "the engine's stats did not return a dict");
      }
      return ToGrpc(FillMessage(r.cast<py::dict>(), resp));
    } catch (py::error_already_set& e) {
      return FromPython(e);
    }
  }

  void Quiesce() const { fence_.Quiesce(); }

 private:
  py::object handler_;
  HandlerFence fence_;
};

// Serves a Python engine on gRPC and tells routers about it.
class WorkerServer {
 public:
  WorkerServer(py::object handler, const std::string& listen, std::vector<std::string> routers,
               const std::string& worker_id, const std::string& endpoint, const NamespaceSpec& spec,
               uint64_t heartbeat_ms)
      : ns_(NamespaceId(spec)), service_(std::make_unique<PyWorkerService>(std::move(handler))) {
    if (heartbeat_ms == 0) Invalid("heartbeat_ms must be positive");
    {
      py::gil_scoped_release nogil;
      started_ = Unwrap(StartGrpcServer({"kvtier-torch-engine",
                                         listen,
                                         grpc::InsecureServerCredentials(),
                                         {service_.get()},
                                         64 << 20}));
    }
    worker_id_ = worker_id.empty() ? "torch-engine@" + started_.address() : worker_id;
    if (!routers.empty()) {
      // Every replica each router name resolves to (client/router_fanout.h).
      PublisherOptions po;
      po.hello.set_source_id(worker_id_);
      po.hello.set_kind(v1::SOURCE_WORKER);
      po.hello.set_endpoint(endpoint.empty() ? started_.address() : endpoint);
      po.hello.set_namespace_id(ns_);
      po.hello.set_block_tokens(spec.block_tokens);
      po.heartbeat_ms = heartbeat_ms;
      fanout_ = std::make_unique<RouterFanout>(routers, po, [this] {
        v1::Heartbeat h;
        h.set_running_requests(running_.load());
        h.set_queued_prefill_tokens(queued_tokens_.load());
        h.set_free_gpu_pages(free_pages_.load());
        return h;
      });
    }
  }
  ~WorkerServer() { Stop(); }

  void Stop() {
    py::gil_scoped_release nogil;  // handlers in flight need the GIL to finish
    if (started_.server) {
      started_.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
      started_.server->Wait();
      service_->Quiesce();
      started_.server.reset();
    }
    if (fanout_) fanout_->Stop();
  }
  void SetLoad(uint32_t running, uint64_t queued_tokens, uint64_t free_pages) {
    running_ = running;
    queued_tokens_ = queued_tokens;
    free_pages_ = free_pages;
  }
  void PublishStored(const py::array& hashes) {
    auto chain = ChainFrom(hashes);
    if (fanout_) fanout_->Stored(ns_, chain);
  }
  void PublishRemoved(const py::array& hashes) {
    auto chain = ChainFrom(hashes);
    if (fanout_) fanout_->Removed(ns_, chain);
  }
  std::string address() const { return started_.address(); }
  int port() const { return started_.port; }
  const std::string& worker_id() const { return worker_id_; }

 private:
  uint64_t ns_;
  std::unique_ptr<PyWorkerService> service_;
  StartedServer started_;
  std::string worker_id_;
  std::atomic<uint32_t> running_{0};
  std::atomic<uint64_t> queued_tokens_{0}, free_pages_{0};
  std::unique_ptr<RouterFanout> fanout_;  // after the load figures its heartbeats read
};

}  // namespace
}  // namespace kvtier::python

PYBIND11_MODULE(_native, m) {
  using namespace kvtier;
  using namespace kvtier::python;
  m.doc() = "kvtier's C++ library (use the kvtier package, not this module, directly)";
  m.attr("__version__") = Version();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = PyError(e.status);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<NamespaceSpec>(m, "NamespaceSpec")
      .def(py::init(&SpecFrom), py::arg("model"), py::arg("dtype"), py::arg("layers"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("block_tokens"),
           py::arg("tp_rank") = 0, py::arg("tp_size") = 1, py::arg("cache_salt") = "",
           py::arg("kv_wire") = "", py::arg("layout") = "")
      .def_readonly("model", &NamespaceSpec::model)
      .def_readonly("dtype", &NamespaceSpec::dtype)
      .def_readonly("layers", &NamespaceSpec::layers)
      .def_readonly("kv_heads", &NamespaceSpec::kv_heads)
      .def_readonly("head_dim", &NamespaceSpec::head_dim)
      .def_readonly("block_tokens", &NamespaceSpec::block_tokens)
      .def_readonly("tp_rank", &NamespaceSpec::tp_rank)
      .def_readonly("tp_size", &NamespaceSpec::tp_size)
      .def_readonly("cache_salt", &NamespaceSpec::cache_salt)
      .def_readonly("kv_wire", &NamespaceSpec::kv_wire)
      .def_readonly("layout", &NamespaceSpec::layout)
      .def_property_readonly("id", [](const NamespaceSpec& s) { return NamespaceId(s); })
      .def_property_readonly("block_bytes", [](const NamespaceSpec& s) { return BlockBytes(s); })
      .def("hash_tokens", [](const NamespaceSpec& s, const py::handle& tokens) {
        auto t = Uint32sFrom(tokens, "tokens");
        return HashArray(ChainHashes(NamespaceId(s), t, s.block_tokens));
      });

  py::class_<PyStoreClient>(m, "StoreClient")
      .def(py::init<std::vector<std::string>, int, const std::string&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("addresses"), py::arg("deadline_ms") = 10000, py::arg("shared_memory") = "auto",
           py::arg("tls_ca") = "", py::arg("tls_cert") = "", py::arg("tls_key") = "")
      .def("register_memory", &PyStoreClient::RegisterMemory)
      .def("register_namespace", &PyStoreClient::RegisterNamespace)
      .def("lookup", &PyStoreClient::Lookup)
      .def("put", &PyStoreClient::Put)
      .def("get", &PyStoreClient::Get)
      .def("put_at", &PyStoreClient::PutAt)
      .def("get_at", &PyStoreClient::GetAt)
      .def("verify_blocks", &PyStoreClient::VerifyBlocks)
      .def_property_readonly("shards", &PyStoreClient::shards);

  py::class_<EngineConnector>(m, "EngineConnector")
      .def(py::init<const NamespaceSpec&, std::vector<std::string>, std::vector<uintptr_t>,
                    std::vector<uintptr_t>, uint64_t, uint64_t, uint64_t, int, const std::string&,
                    const std::string&, const std::string&, const std::string&>(),
           py::arg("spec"), py::arg("stores"), py::arg("k"), py::arg("v"), py::arg("page_stride"),
           py::arg("num_pages"), py::arg("staging_blocks") = 64, py::arg("deadline_ms") = 10000,
           py::arg("shared_memory") = "auto", py::arg("tls_ca") = "", py::arg("tls_cert") = "",
           py::arg("tls_key") = "")
      .def("close", &EngineConnector::Close)
      .def("lookup", &EngineConnector::Lookup)
      .def("start_load", &EngineConnector::StartLoad)
      .def("wait_for_layer", &EngineConnector::WaitForLayer)
      .def("wait_for_load", &EngineConnector::WaitForLoad)
      .def("save", &EngineConnector::Save)
      .def("wait_for_save", &EngineConnector::WaitForSave)
      .def("finished", &EngineConnector::Finished)
      .def("loaded_from_disk", &EngineConnector::LoadedFromDisk)
      .def("load_times", &EngineConnector::LoadTimes)
      .def("stats", &EngineConnector::Stats)
      .def("offload_times", &EngineConnector::OffloadTimes)
      .def("drain", &EngineConnector::Drain)
      .def("_load_loop", &EngineConnector::LoadLoop);

  py::class_<WorkerServer>(m, "WorkerServer")
      .def(py::init<py::object, const std::string&, std::vector<std::string>, const std::string&,
                    const std::string&, const NamespaceSpec&, uint64_t>(),
           py::arg("handler"), py::arg("listen"), py::arg("routers"), py::arg("worker_id"),
           py::arg("endpoint"), py::arg("spec"), py::arg("heartbeat_ms"))
      .def("stop", &WorkerServer::Stop)
      .def("set_load", &WorkerServer::SetLoad)
      .def("publish_stored", &WorkerServer::PublishStored)
      .def("publish_removed", &WorkerServer::PublishRemoved)
      .def_property_readonly("address", &WorkerServer::address)
      .def_property_readonly("port", &WorkerServer::port)
      .def_property_readonly("worker_id", &WorkerServer::worker_id);
}
