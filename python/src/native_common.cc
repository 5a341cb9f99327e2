#include "python/src/native_common.h"

#include "absl/strings/str_cat.h"
#include "common/rpc/tls.h"

namespace kvtier::python {

void Invalid(const std::string& message) { throw StatusError(absl::InvalidArgumentError(message)); }

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

DataClientOptions DataOptions(int deadline_ms, const std::string& shared_memory, const Tls& tls) {
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

}  // namespace kvtier::python
