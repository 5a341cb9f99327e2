#include "common/dtype.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<Dtype> ParseDtype(absl::string_view name) {
  if (name == "fp16") return Dtype::kFp16;
  if (name == "bf16") return Dtype::kBf16;
  if (name == "fp8" || name == "fp8_e4m3" || name == "fp8_e5m2") return Dtype::kFp8;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not one of fp16, bf16, fp8, fp8_e4m3, fp8_e5m2"));
}

}  // namespace kvtier
