// kvtier._native: the C++ side of the kvtier Python package (pybind11).
//
// It binds the library directly (not the C ABI): the namespace and block
// hashing (here), the sharded store client (store_client.cc), the worker
// connector over engine-registered memory (connector.cc), and a gRPC server
// that serves kvtier.v1.SimWorker for a Python engine and publishes its KV
// events and heartbeats to routers (worker_server.cc); native_common.h holds
// what they share.
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
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/block_key.h"
#include "common/dtype.h"
#include "common/engine_key.h"
#include "common/limits.h"
#include "common/version.h"
#include "python/src/native_common.h"

PYBIND11_MODULE(_native, m) {
  using namespace kvtier;
  using namespace kvtier::python;
  m.doc() = "kvtier's C++ library (use the kvtier package, not this module, directly)";
  m.attr("__version__") = Version();
  // The protocol's limits (common/limits.h), for the Python side's checks.
  m.attr("MAX_BLOCK_TOKENS") = limits::kMaxBlockTokens;
  m.attr("MAX_BLOCKS_PER_REQUEST") = limits::kMaxBlocksPerRequest;
  m.attr("MAX_PROMPT_TOKENS") = limits::kMaxPromptTokens;
  // Engine dtype names -> kvtier's (common/dtype.h), and each kvtier
  // name's bytes per element.
  py::dict spellings, element_bytes;
  for (const auto& s : kDtypeSpellings) {
    spellings[s.engine] = s.kvtier;
    element_bytes[s.kvtier] = ElementBytes(*ParseDtype(s.kvtier));
  }
  m.attr("DTYPE_SPELLINGS") = spellings;
  m.attr("DTYPE_ELEMENT_BYTES") = element_bytes;
  // The block hash of each engine key (bytes or str, UTF-8): uint64 [n, 2].
  m.def("engine_key_hashes", [](const py::list& keys) {
    std::vector<BlockHash> out;
    out.reserve(keys.size());
    for (const auto& k : keys) {
      std::string bytes;
      if (py::isinstance<py::bytes>(k)) {
        bytes = std::string(py::cast<py::bytes>(k));
      } else if (py::isinstance<py::str>(k)) {
        bytes = py::cast<std::string>(k);
      } else {
        throw py::type_error("engine keys are bytes or str, not " +
                             std::string(py::str(py::type::of(k))));
      }
      out.push_back(EngineKeyHash(bytes));
    }
    return HashArray(out);
  });

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

  BindStoreClient(m);

  BindEngineConnector(m);

  BindWorkerServer(m);
}
