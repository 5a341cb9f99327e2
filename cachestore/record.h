// The on-disk block record: a 32-byte header then the block's bytes.
//
//   offset  size  field
//   0       4     magic "KVTB" (0x4254564B little-endian)
//   4       2     format version (1)
//   6       2     flags (0)
//   8       8     payload length in bytes
//   16      8     XXH3-64 of the payload
//   24      8     reserved (0)
//
// Decoding verifies all of it; a record that fails is reported, never served.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvtier::store {

inline constexpr uint32_t kRecordMagic = 0x4254564B;
inline constexpr uint16_t kRecordVersion = 1;
inline constexpr size_t kRecordHeaderBytes = 32;

std::string EncodeRecord(const void* payload, uint64_t length, uint64_t checksum);

struct DecodedRecord {
  std::string_view payload;  // points into the input
  uint64_t checksum;
};

// DATA_LOSS naming what is wrong for a truncated, foreign or corrupt record.
absl::StatusOr<DecodedRecord> DecodeRecord(std::string_view record);

}  // namespace kvtier::store
