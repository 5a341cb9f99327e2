#include "cachestore/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::store {

absl::StatusOr<std::unique_ptr<Arena>> Arena::Create(uint64_t bytes, uint64_t slab_bytes,
                                                     bool try_hugepages, bool prefault,
                                                     bool shareable) {
  if (slab_bytes == 0 || slab_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slab size ", slab_bytes, " must be a non-zero multiple of 4096"));
  }
  uint64_t size = bytes / slab_bytes * slab_bytes;
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("RAM tier of ", bytes,
                                                   " bytes holds no slab of ", slab_bytes,
                                                   " bytes; raise --ram-bytes"));
  }
  void* p = MAP_FAILED;
  bool huge = false;
  // A memfd mapped shared: same-host clients map it too (Arena::shm_path).
  int fd = -1;
  auto map_memfd = [&](unsigned flags) {
    if (!shareable) return;
    fd = memfd_create("kvtier-ram-tier", MFD_CLOEXEC | flags);
    if (fd < 0) return;
    if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (p == MAP_FAILED) {
      close(fd);
      fd = -1;
    }
  };
  if (try_hugepages && size % (2u << 20) == 0) {
    map_memfd(MFD_HUGETLB);
    if (p == MAP_FAILED) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1,
               0);
    }
    huge = p != MAP_FAILED;
  }
  if (p == MAP_FAILED) map_memfd(0);
  if (p == MAP_FAILED) {
    p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mmap of ", size, " bytes for the RAM tier failed: ", std::strerror(errno)));
    }
  }
  if (!huge) madvise(p, size, MADV_HUGEPAGE);
  if (prefault) {
    // Fault every page in now: a first touch on the data path can stall for
    // milliseconds (THP compaction), which shows up as transfers that crawl.
    volatile uint8_t* b = static_cast<uint8_t*>(p);
    for (uint64_t off = 0; off < size; off += 4096) b[off] = 0;
  }
  std::unique_ptr<Arena> a(new Arena(static_cast<uint8_t*>(p), size, slab_bytes, huge, fd));
  if (fd >= 0) a->shm_path_ = absl::StrCat("/proc/", getpid(), "/fd/", fd);
  return a;
}

Arena::~Arena() {
  munmap(base_, size_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace kvtier::store
