// kvtier._native.WorkerServer: kvtier.v1.SimWorker served for a Python
// engine, which publishes its KV events and heartbeats to routers.
#include <grpcpp/grpcpp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/router_fanout.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/grpc_status.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "python/src/native_common.h"

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
    } catch (const std::exception& e) {
      return FromException(e);
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
    } catch (const std::exception& e) {
      return FromException(e);
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

void BindWorkerServer(py::module_& m) {
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

}  // namespace kvtier::python
