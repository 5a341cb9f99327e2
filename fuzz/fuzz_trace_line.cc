// libFuzzer: the Mooncake trace line parser (outside input: trace files).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "bench/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = kvtier::ParseTraceLine(std::string_view(reinterpret_cast<const char*>(data), size));
  if (r.ok() && r->hash_ids.size() != (r->input_length + 511) / 512) __builtin_trap();
  return 0;
}
