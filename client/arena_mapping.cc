// ArenaMapping (arena_mapping.h, which states its guarantees).
#include "client/arena_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<std::shared_ptr<ArenaMapping>> ArenaMapping::Map(const v1::RemoteRegion& region,
                                                               uint64_t instance) {
  if (region.shm_path().empty() || region.length() == 0) {
    return absl::FailedPreconditionError("the store offers no mapping of its arena");
  }
  int fd = open(region.shm_path().c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open ", region.shm_path(), ": ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, region.length(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", region.length(), " bytes of ", region.shm_path(), ": ",
                     std::strerror(err)));
  }
  return std::shared_ptr<ArenaMapping>(new ArenaMapping(
      static_cast<uint8_t*>(p), region.base_addr(), region.length(), instance));
}

ArenaMapping::~ArenaMapping() { munmap(local_, length_); }

uint8_t* ArenaMapping::At(uint64_t remote_addr, size_t length) const {
  if (remote_addr < base_ || remote_addr - base_ > length_ ||
      length > length_ - (remote_addr - base_)) {
    return nullptr;
  }
  return local_ + (remote_addr - base_);
}

}  // namespace kvtier
