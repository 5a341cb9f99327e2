// The fuzzers' store: a real Store (4 MiB of RAM in 1 MiB slabs, a RocksDB
// NVMe tier of 64 MiB in a scratch directory named after `name` and the
// process), with logging quiet. Aborts if it cannot open.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "cachestore/store.h"
#include "common/log.h"

namespace kvtier::fuzz {

inline std::unique_ptr<store::Store> OpenScratchStore(const std::string& name, uint64_t lease_ms) {
  SetLogQuiet(true);
  const std::string dir =
      std::filesystem::temp_directory_path() / (name + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  store::StoreOptions o;
  o.ram.bytes = 4 << 20;
  o.ram.slab_bytes = 1 << 20;
  o.ram.try_hugepages = false;
  o.disk.dir = dir;
  o.disk.bytes = 64 << 20;
  o.lease_ms = lease_ms;
  auto s = store::Store::Open(o);
  if (!s.ok()) std::abort();
  return std::move(*s);
}

}  // namespace kvtier::fuzz
