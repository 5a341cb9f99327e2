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

// The names engines give a KV cache's element type (vLLM's cache_dtype and
// model dtype, torch's dtype names, SGLang's pool dtypes), each with the
// kvtier name its blocks are stored under: the one table every integration
// reads (Python: kvtier.dtypes, from the extension). An engine's fp8 format
// keeps its own name, so two formats of equal geometry never share blocks.
struct DtypeSpelling {
  const char* engine;
  const char* kvtier;
};
inline constexpr DtypeSpelling kDtypeSpellings[] = {
    {"float16", "fp16"},      {"half", "fp16"},
    {"fp16", "fp16"},         {"bfloat16", "bf16"},
    {"bf16", "bf16"},         {"fp8", "fp8"},
    {"fp8_e4m3", "fp8_e4m3"}, {"float8_e4m3fn", "fp8_e4m3"},
    {"fp8_e5m2", "fp8_e5m2"}, {"float8_e5m2", "fp8_e5m2"},
    {"uint8", "fp8"},
};

}  // namespace kvtier
