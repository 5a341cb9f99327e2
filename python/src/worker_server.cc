// kvtier._native.WorkerServer: kvtier.v1.SimWorker served for a Python
// engine, which publishes its KV events and heartbeats to routers.
#include <grpcpp/grpcpp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/router_fanout.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/grpc_status.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "python/src/native_common.h"
#include "worker/worker_server.h"

namespace kvtier::python {
namespace {

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
// A KvtierError whose code or message a handler replaced with values of
// another type is INTERNAL with the exception's text: converting them must
// not throw out of a gRPC handler.
grpc::Status FromPython(py::error_already_set& e) {
  std::string message;
  grpc::StatusCode code = grpc::StatusCode::INTERNAL;
  try {
    message = py::str(e.value());
    py::object errors = py::module_::import("kvtier.errors");
    if (e.matches(errors.attr("KvtierError"))) {
      const int c = e.value().attr("code").cast<int>();
      message = e.value().attr("message").cast<std::string>();
      code = c > 0 && c <= 16 ? static_cast<grpc::StatusCode>(c) : grpc::StatusCode::UNKNOWN;
    } else if (e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError)) {
      code = grpc::StatusCode::INVALID_ARGUMENT;
    }
  } catch (const py::error_already_set& inner) {
    code = grpc::StatusCode::INTERNAL;
    message =
        absl::StrCat("the engine's handler raised an error that could not be read: ", inner.what());
  } catch (const std::exception& inner) {  // py::cast_error among them
    code = grpc::StatusCode::INTERNAL;
    message = absl::StrCat("the engine's handler raised an error of a malformed kind (", e.what(),
                           "): ", inner.what());
  }
  return grpc::Status(code, message);
}

// What any other C++ exception out of a handler becomes (it must not leave
// the gRPC handler: that would end the process).
grpc::Status FromException(const std::exception& e) {
  return grpc::Status(grpc::StatusCode::INTERNAL,
                      absl::StrCat("the engine's handler failed: ", e.what()));
}

// The engine behind worker::WorkerServer for a Python engine: each call
// runs the handler's submit(dict) -> dict / stats() -> dict with the GIL
// held, on a prompt the server checked and hashed.
class PyEngine final : public worker::WorkerEngine {
 public:
  explicit PyEngine(py::object handler) : handler_(std::move(handler)) {}
  ~PyEngine() override {
    py::gil_scoped_acquire gil;
    handler_ = py::object();
  }

  absl::Status Submit(const worker::SubmitPrompt& p, v1::SubmitResponse* resp) override {
    if (draining.load()) {
      return absl::UnavailableError(
          "this worker is draining (it is leaving the fleet): send the request to another worker");
    }
    py::gil_scoped_acquire gil;
    try {
      py::dict d;
      d["request_id"] = p.request_id;
      d["prompt_tokens"] = p.prompt.prompt_tokens;
      d["output_tokens"] = p.output_tokens;
      d["store_hint_blocks"] = p.store_hint_blocks ? py::cast(*p.store_hint_blocks) : py::none();
      d["tokens"] = py::none();
      d["hashes"] = py::none();
      if (!p.tokens.empty()) {
        // The shape constructor: array_t's strides come from sizeof(T).
        // The count constructor takes the item size from the dtype, which
        // pybind11 2.10 misreads under numpy 2 (stride 0: every element
        // read as the first).
        py::array_t<int64_t> t(std::vector<py::ssize_t>{static_cast<py::ssize_t>(p.tokens.size())});
        int64_t* out = t.mutable_data();
        for (size_t i = 0; i < p.tokens.size(); ++i) out[i] = p.tokens[i];
        d["tokens"] = t;
      } else if (p.hashed) {
        d["hashes"] = HashArray(p.prompt.chain);
      }
      py::object r = handler_.attr("submit")(d);
      if (!py::isinstance<py::dict>(r)) {
        return absl::InternalError("the engine's submit did not return a dict");
      }
      return FillMessage(r.cast<py::dict>(), resp);
    } catch (py::error_already_set& e) {
      return FromGrpc(FromPython(e));
    } catch (const std::exception& e) {
      return FromGrpc(FromException(e));
    }
  }

  absl::Status Stats(v1::GetWorkerStatsResponse* resp) override {
    py::gil_scoped_acquire gil;
    try {
      py::object r = handler_.attr("stats")();
      if (!py::isinstance<py::dict>(r)) {
        return absl::InternalError("the engine's stats did not return a dict");
      }
      return FillMessage(r.cast<py::dict>(), resp);
    } catch (py::error_already_set& e) {
      return FromGrpc(FromPython(e));
    } catch (const std::exception& e) {
      return FromGrpc(FromException(e));
    }
  }

  v1::Heartbeat Load() override {
    v1::Heartbeat h;
    std::lock_guard lk(load_mu);
    h.set_running_requests(running);
    h.set_queued_prefill_tokens(queued_tokens);
    h.set_free_gpu_pages(free_pages);
    h.mutable_arrived_request_ids()->Add(arrived.begin(), arrived.end());
    h.set_draining(draining.load());
    return h;
  }

  // Leaving: Submit answers UNAVAILABLE and heartbeats say draining (the
  // routers and frontends send nothing more).
  std::atomic<bool> draining{false};

  // The engine's last load report (WorkerServer::SetLoad), one snapshot.
  std::mutex load_mu;
  uint32_t running = 0;
  uint64_t queued_tokens = 0, free_pages = 0;
  std::vector<uint64_t> arrived;  // callers' ids, each counted in queued_tokens

 private:
  py::object handler_;
};

// Serves a Python engine on gRPC (worker::WorkerServer: the path
// kvtier-sim-worker takes) and tells routers about it.
class WorkerServer {
 public:
  WorkerServer(py::object handler, const std::string& listen, std::vector<std::string> routers,
               const std::string& worker_id, const std::string& endpoint, const NamespaceSpec& spec,
               uint64_t heartbeat_ms, const std::string& tls_cert, const std::string& tls_key,
               const std::string& tls_ca, bool tls_require_client_cert)
      : ns_(NamespaceId(spec)), engine_(std::make_unique<PyEngine>(std::move(handler))) {
    if (heartbeat_ms == 0) Invalid("heartbeat_ms must be positive");
    worker::WorkerServerOptions o;
    o.binary = "kvtier-torch-engine";
    o.id_prefix = "torch-engine";
    o.listen = listen;
    o.tls.cert_file = tls_cert;
    o.tls.key_file = tls_key;
    o.tls.ca_file = tls_ca;
    o.tls.require_client_cert = tls_require_client_cert;
    o.routers = std::move(routers);
    o.worker_id = worker_id;
    o.endpoint = endpoint;
    o.namespace_id = ns_;
    o.block_tokens = spec.block_tokens;
    o.heartbeat_ms = heartbeat_ms;
    py::gil_scoped_release nogil;
    server_ = Unwrap(worker::WorkerServer::Start(engine_.get(), std::move(o)));
  }
  ~WorkerServer() { Stop(); }

  void Stop() {
    py::gil_scoped_release nogil;  // handlers in flight need the GIL to finish
    if (server_) server_->Stop();
  }
  void SetLoad(uint32_t running, uint64_t queued_tokens, uint64_t free_pages,
               std::vector<uint64_t> arrived) {
    std::lock_guard lk(engine_->load_mu);
    engine_->running = running;
    engine_->queued_tokens = queued_tokens;
    engine_->free_pages = free_pages;
    engine_->arrived = std::move(arrived);
  }
  void SetDraining() { engine_->draining = true; }
  bool draining() const { return engine_->draining.load(); }
  void PublishStored(const py::array& hashes) {
    auto chain = ChainFrom(hashes);
    if (server_->events()) server_->events()->Stored(ns_, chain);
  }
  void PublishRemoved(const py::array& hashes) {
    auto chain = ChainFrom(hashes);
    if (server_->events()) server_->events()->Removed(ns_, chain);
  }
  std::string address() const { return server_->address(); }
  int port() const { return server_->port(); }
  const std::string& worker_id() const { return server_->worker_id(); }

 private:
  uint64_t ns_;
  std::unique_ptr<PyEngine> engine_;
  std::unique_ptr<worker::WorkerServer> server_;  // before the engine goes
};

}  // namespace

void BindWorkerServer(py::module_& m) {
  py::class_<WorkerServer>(m, "WorkerServer")
      .def(py::init<py::object, const std::string&, std::vector<std::string>, const std::string&,
                    const std::string&, const NamespaceSpec&, uint64_t, const std::string&,
                    const std::string&, const std::string&, bool>(),
           py::arg("handler"), py::arg("listen"), py::arg("routers"), py::arg("worker_id"),
           py::arg("endpoint"), py::arg("spec"), py::arg("heartbeat_ms"), py::arg("tls_cert") = "",
           py::arg("tls_key") = "", py::arg("tls_ca") = "",
           py::arg("tls_require_client_cert") = false)
      .def("stop", &WorkerServer::Stop)
      .def("set_load", &WorkerServer::SetLoad, py::arg("running"), py::arg("queued_tokens"),
           py::arg("free_pages"), py::arg("arrived") = std::vector<uint64_t>{})
      .def("set_draining", &WorkerServer::SetDraining)
      .def_property_readonly("draining", &WorkerServer::draining)
      .def("publish_stored", &WorkerServer::PublishStored)
      .def("publish_removed", &WorkerServer::PublishRemoved)
      .def_property_readonly("address", &WorkerServer::address)
      .def_property_readonly("port", &WorkerServer::port)
      .def_property_readonly("worker_id", &WorkerServer::worker_id);
}

}  // namespace kvtier::python
