// The disk tier's on-disk format, in one place: block records, their keys,
// and index entries.
//
// Key (24 bytes, both the blocks and the index column): big-endian
// (namespace, hash.hi, hash.lo), so a namespace's blocks are contiguous.
//
// Index entry (24 bytes, little-endian): record bytes, checksum, write
// sequence.
//
// Block record: a 32-byte header then the block's bytes.
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
#include "common/block_key.h"

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

std::string EncodeBlockKey(const BlockKey& key);
// False if s is not 24 bytes.
bool DecodeBlockKey(std::string_view s, BlockKey* key);

struct IndexEntry {
  uint64_t record_bytes;
  uint64_t checksum;
  uint64_t seq;  // write order
};
std::string EncodeIndexEntry(const IndexEntry& e);
// False if s is not 24 bytes.
bool DecodeIndexEntry(std::string_view s, IndexEntry* e);

}  // namespace kvtier::store
