#include "cachestore/record.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"

namespace kvtier::store {

std::string EncodeRecord(const void* payload, uint64_t length, uint64_t checksum) {
  std::string r(kRecordHeaderBytes + length, '\0');
  char* p = r.data();
  uint32_t magic = kRecordMagic;
  uint16_t version = kRecordVersion, flags = 0;
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &version, 2);
  std::memcpy(p + 6, &flags, 2);
  std::memcpy(p + 8, &length, 8);
  std::memcpy(p + 16, &checksum, 8);
  if (length > 0) std::memcpy(p + kRecordHeaderBytes, payload, length);
  return r;
}

absl::StatusOr<DecodedRecord> DecodeRecord(std::string_view r) {
  if (r.size() < kRecordHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("block record of ", r.size(), " bytes is shorter than its 32-byte header"));
  }
  uint32_t magic;
  uint16_t version;
  uint64_t length, checksum;
  std::memcpy(&magic, r.data(), 4);
  std::memcpy(&version, r.data() + 4, 2);
  std::memcpy(&length, r.data() + 8, 8);
  std::memcpy(&checksum, r.data() + 16, 8);
  if (magic != kRecordMagic) return absl::DataLossError("block record has a bad magic number");
  if (version != kRecordVersion) {
    return absl::DataLossError(absl::StrCat("block record version ", version, " is unknown"));
  }
  if (length != r.size() - kRecordHeaderBytes) {
    return absl::DataLossError(absl::StrCat("block record says ", length, " payload bytes but has ",
                                            r.size() - kRecordHeaderBytes));
  }
  std::string_view payload = r.substr(kRecordHeaderBytes);
  uint64_t actual = Checksum(payload.data(), payload.size());
  if (actual != checksum) {
    return absl::DataLossError(absl::StrCat("block record checksum mismatch: stored ", checksum,
                                            ", bytes hash to ", actual));
  }
  return DecodedRecord{payload, checksum};
}

std::string EncodeBlockKey(const BlockKey& k) {
  std::string s(24, '\0');
  const uint64_t v[3] = {k.ns, k.hash.hi, k.hash.lo};
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 8; ++b) s[i * 8 + b] = static_cast<char>(v[i] >> (56 - 8 * b));
  }
  return s;
}

bool DecodeBlockKey(std::string_view s, BlockKey* k) {
  if (s.size() != 24) return false;
  uint64_t v[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 8; ++b) v[i] = (v[i] << 8) | static_cast<uint8_t>(s[i * 8 + b]);
  }
  *k = BlockKey{v[0], BlockHash{v[1], v[2]}};
  return true;
}

std::string EncodeIndexEntry(const IndexEntry& e) {
  std::string s(24, '\0');
  std::memcpy(s.data(), &e.record_bytes, 8);
  std::memcpy(s.data() + 8, &e.checksum, 8);
  std::memcpy(s.data() + 16, &e.seq, 8);
  return s;
}

bool DecodeIndexEntry(std::string_view s, IndexEntry* e) {
  if (s.size() != 24) return false;
  std::memcpy(&e->record_bytes, s.data(), 8);
  std::memcpy(&e->checksum, s.data() + 8, 8);
  std::memcpy(&e->seq, s.data() + 16, 8);
  return true;
}

}  // namespace kvtier::store
