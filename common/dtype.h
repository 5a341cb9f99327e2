// Element types of KV tensors, and the one parser of their names.
//
// Names accepted (namespace specs, the C ABI, flags): "fp16", "bf16", "fp8",
// "fp8_e4m3", "fp8_e5m2" (the two fp8 encodings are stored alike: one byte).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace kvtier {

enum class Dtype : uint8_t { kFp16, kBf16, kFp8 };

// The dtype a name stands for. INVALID_ARGUMENT naming the name and the
// accepted ones otherwise.
absl::StatusOr<Dtype> ParseDtype(absl::string_view name);

// Bytes per element: 2 for fp16/bf16, 1 for fp8.
constexpr uint32_t ElementBytes(Dtype d) { return d == Dtype::kFp8 ? 1 : 2; }

}  // namespace kvtier
