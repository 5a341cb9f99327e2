// A same-host store's RAM arena mapped into this process: the store offers
// its memfd as RemoteRegion.shm_path, and a client that uses shared memory
// maps it, so a transfer is a memcpy under the same leases and checksums as
// an RMA. The mapping belongs to one store instance (its instance id): a
// store that restarts has a new arena, and the old mapping means nothing.
//
// A process maps each store instance's arena once (with its page tables
// populated up front), and every lane and client shares that mapping.
//
// Thread-safe (immutable once made). Internal to kvtier_dataclient.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kvtier/v1/store.pb.h"

namespace kvtier {

class ArenaMapping {
 public:
  // Maps the region; FAILED_PRECONDITION when it offers no path, or the
  // open or mmap's error (another user's store, another container).
  static absl::StatusOr<std::shared_ptr<ArenaMapping>> Map(const v1::RemoteRegion& region,
                                                           uint64_t instance);
  ~ArenaMapping();
  ArenaMapping(const ArenaMapping&) = delete;
  ArenaMapping& operator=(const ArenaMapping&) = delete;

  // The mapped bytes of [remote_addr, remote_addr + length), or nullptr when
  // they are not all inside the region (a store's answer is never trusted
  // to stay in bounds).
  uint8_t* At(uint64_t remote_addr, size_t length) const;
  uint64_t instance() const { return instance_; }
  // The whole mapping, here.
  uint8_t* local() const { return local_; }
  size_t length() const { return length_; }

 private:
  ArenaMapping(uint8_t* local, uint64_t base, size_t length, uint64_t instance)
      : local_(local), base_(base), length_(length), instance_(instance) {}
  uint8_t* local_;
  uint64_t base_;  // the region's address in the store
  size_t length_;
  uint64_t instance_;
};

}  // namespace kvtier
