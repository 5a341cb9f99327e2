// libFuzzer: the on-disk block record decoder (outside input: the data dir).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "cachestore/record.h"
#include "common/checksum.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = kvtier::store::DecodeRecord(std::string_view(reinterpret_cast<const char*>(data), size));
  // Anything accepted must really carry a payload whose checksum matches.
  if (r.ok() && kvtier::Checksum(r->payload.data(), r->payload.size()) != r->checksum)
    __builtin_trap();
  return 0;
}
