// kvtier._native.StoreClient: the sharded store client (client/
// sharded_store_client.h) over Python buffers named by address.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/sharded_store_client.h"
#include "python/src/native_common.h"

namespace kvtier::python {
namespace {

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
  // Each chain's leading present blocks, one round trip per shard;
  // budget_ms > 0 bounds the wait (0: the client's deadline).
  std::vector<uint32_t> LookupMany(const NamespaceSpec& spec, const py::list& chains,
                                   double budget_ms) {
    if (!(budget_ms >= 0) || budget_ms > 3.6e6) {
      Invalid(absl::StrCat("budget_ms must be between 0 and 3600000 ms, not ", budget_ms));
    }
    std::vector<std::vector<BlockHash>> all;
    all.reserve(chains.size());
    for (const auto& c : chains) all.push_back(ChainFrom(py::cast<py::array>(c)));
    const uint64_t ns = NamespaceId(spec);
    std::optional<std::chrono::milliseconds> budget;
    if (budget_ms > 0) {
      budget = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(budget_ms)));
    }
    py::gil_scoped_release nogil;
    return Unwrap(client_.LookupMany(ns, all, budget));
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

}  // namespace

void BindStoreClient(py::module_& m) {
  py::class_<PyStoreClient>(m, "StoreClient")
      .def(py::init<std::vector<std::string>, int, const std::string&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("addresses"), py::arg("deadline_ms") = 10000, py::arg("shared_memory") = "auto",
           py::arg("tls_ca") = "", py::arg("tls_cert") = "", py::arg("tls_key") = "")
      .def("register_memory", &PyStoreClient::RegisterMemory)
      .def("register_namespace", &PyStoreClient::RegisterNamespace)
      .def("lookup", &PyStoreClient::Lookup)
      .def("lookup_many", &PyStoreClient::LookupMany, py::arg("spec"), py::arg("chains"),
           py::arg("budget_ms") = 0.0)
      .def("put", &PyStoreClient::Put)
      .def("get", &PyStoreClient::Get)
      .def("put_at", &PyStoreClient::PutAt)
      .def("get_at", &PyStoreClient::GetAt)
      .def("verify_blocks", &PyStoreClient::VerifyBlocks)
      .def_property_readonly("shards", &PyStoreClient::shards);
}

}  // namespace kvtier::python
