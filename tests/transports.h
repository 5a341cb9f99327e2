// The transports the data-plane tests run over, by the name a parameterized
// test takes: "socket" (the store's socket data plane, its default), "ucx"
// (UCX RMA over TCP, --data-plane ucx) and "mapped" (the client maps the
// store's arena and copies with memcpy).
#pragma once

#include <string>
#include <vector>

#include "client/data_client_types.h"

namespace kvtier::testing {

// The store's flags for `transport`, after `extra`.
inline std::vector<std::string> StoreFlagsFor(const std::string& transport,
                                              std::vector<std::string> extra = {}) {
  if (transport == "ucx") extra.push_back("--data-plane=ucx");
  return extra;
}

// A data client's options for `transport` (5 s deadlines).
inline DataClientOptions ClientOptionsFor(const std::string& transport) {
  DataClientOptions o;
  o.deadline_ms = 5000;
  o.shared_memory = transport == "mapped" ? DataClientOptions::SharedMemory::kOn
                                          : DataClientOptions::SharedMemory::kOff;
  return o;
}

}  // namespace kvtier::testing
