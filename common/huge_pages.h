// Host buffers that ask the kernel for transparent huge pages.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>

namespace kvtier {

// At least `bytes` bytes, 2 MiB-aligned and rounded up to 2 MiB, advised
// MADV_HUGEPAGE (taken where THP is "madvise" or "always"); nullptr if the
// allocation fails. Free with std::free. Copies that scatter over such a
// buffer miss the TLB once per 2 MiB instead of once per 4 KiB. Nothing is
// touched: the first touch places the pages.
inline void* AllocateHugePageBacked(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t rounded = bytes == 0 ? kHuge : (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, rounded);
  if (p != nullptr) madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

}  // namespace kvtier
