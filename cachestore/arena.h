// The RAM arena: one anonymous mapping (2 MiB hugepages when the kernel has
// them reserved, else normal pages with transparent-hugepage advice), carved
// into fixed-size slabs. Each slab serves one size class. The arena is
// registered once with the data plane; slot addresses are stable for the
// life of the process. Thread-safe (it is immutable after construction).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvtier::store {

class Arena {
 public:
  // bytes is rounded down to a whole number of slabs. prefault touches every
  // page at once, so the data path never takes a page fault. shareable: the
  // memory is a memfd mapped shared, so clients on this host can map it too
  // (shm_path); otherwise, or where memfd is not available, it is private
  // anonymous memory.
  static absl::StatusOr<std::unique_ptr<Arena>> Create(uint64_t bytes, uint64_t slab_bytes,
                                                       bool try_hugepages, bool prefault = false,
                                                       bool shareable = false);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  uint64_t slab_bytes() const { return slab_bytes_; }
  uint64_t num_slabs() const { return size_ / slab_bytes_; }
  bool hugepages() const { return hugepages_; }
  uint8_t* at(uint64_t offset) const { return base_ + offset; }
  // "/proc/PID/fd/N" of the memory's memfd; empty when it has none.
  const std::string& shm_path() const { return shm_path_; }

 private:
  Arena(uint8_t* base, uint64_t size, uint64_t slab_bytes, bool huge, int fd)
      : base_(base), size_(size), slab_bytes_(slab_bytes), hugepages_(huge), fd_(fd) {}
  uint8_t* base_;
  uint64_t size_;
  uint64_t slab_bytes_;
  bool hugepages_;
  int fd_;  // the memfd, or -1
  std::string shm_path_;
};

}  // namespace kvtier::store
