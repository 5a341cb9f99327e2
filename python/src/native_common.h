// What kvtier._native's bindings share (python/src/*.cc): the one C++
// exception that crosses into Python (StatusError, translated once in
// native.cc), argument conversions and checks, and the binders each file
// defines.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/store_data_client.h"
#include "common/block_key.h"

namespace kvtier::python {

namespace py = pybind11;

// The C++ exception for a failed status; translated to KvtierError.
struct StatusError : std::exception {
  explicit StatusError(absl::Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return "kvtier status error"; }
  absl::Status status;
};

inline void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <typename T>
T Unwrap(absl::StatusOr<T> s) {
  Check(s.status());
  return *std::move(s);
}
// Throws INVALID_ARGUMENT with `message`.
[[noreturn]] void Invalid(const std::string& message);

// The Python exception for a status (kvtier.errors.from_status).
py::object PyError(const absl::Status& s);

// Hashes from a uint64 array of shape [n, 2] (hi, lo).
std::vector<BlockHash> ChainFrom(const py::array& hashes);
py::array_t<uint64_t> HashArray(const std::vector<BlockHash>& chain);

// A 1-D integer sequence or array whose values each fit uint32 ("tokens",
// "pages": named in the error).
std::vector<uint32_t> Uint32sFrom(const py::handle& values, const char* what);

NamespaceSpec SpecFrom(const std::string& model, const std::string& dtype, uint32_t layers,
                       uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens,
                       uint32_t tp_rank, uint32_t tp_size, const std::string& cache_salt,
                       const std::string& kv_wire, const std::string& layout);

// TLS towards the stores' control plane: PEM file paths, "" each: unused
// (tls_ca set: TLS; with tls_cert and tls_key too: mutual TLS).
struct Tls {
  std::string ca, cert, key;
};

DataClientOptions DataOptions(int deadline_ms, const std::string& shared_memory,
                              const Tls& tls = {});

py::dict TimesDict(const TransferTimes& t);

// The classes each file binds.
void BindStoreClient(py::module_& m);      // store_client.cc
void BindEngineConnector(py::module_& m);  // connector.cc
void BindWorkerServer(py::module_& m);     // worker_server.cc

}  // namespace kvtier::python
