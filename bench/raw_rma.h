// The data plane's own ceiling, for the benchmarks' "raw RMA" reference: a
// UCX RMA loop over the same kind of endpoint the data client uses
// (DataPlaneConnection, same transport choice) into the same store's
// registered arena, with no control plane in the loop. The blocks' arena
// addresses are taken once (a BeginGet pins them, a BeginPut reserves
// slots); then Get/Put only post RMA and wait, from and into distinct
// registered local buffers.
//
// Not thread-safe (one UCX worker). Statuses: the control RPCs' and UCX's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/data_client_types.h"
#include "client/store_client.h"

namespace kvtier {
class DataPlaneConnection;
namespace ucx {
class Context;
class MemoryRegion;
}  // namespace ucx
}  // namespace kvtier

namespace kvtier::bench {

class RawRma {
 public:
  static absl::StatusOr<std::unique_ptr<RawRma>> Connect(const std::string& store,
                                                         DataClientOptions options = {});
  ~RawRma();

  // Registers local memory for zero-copy RMA.
  absl::Status Register(void* addr, size_t length);
  // Pins the chain's present blocks in the store (one BeginGet, held until
  // destruction) and returns their arena addresses.
  absl::StatusOr<std::vector<uint64_t>> PinForGet(uint64_t ns, const std::vector<BlockHash>& chain);
  // Reserves slots for `count` fresh blocks (one BeginPut; aborted at
  // destruction, so nothing is stored) and returns their arena addresses.
  absl::StatusOr<std::vector<uint64_t>> ReserveForPut(uint64_t ns, uint64_t first_id, size_t count);
  // One RMA read of `length` bytes from each address into dest + i x length.
  absl::Status Get(const std::vector<uint64_t>& addrs, uint64_t length, uint8_t* dest);
  // One RMA write of each block, then a flush (remote completion).
  absl::Status Put(const std::vector<uint64_t>& addrs, uint64_t length, const uint8_t* src);

 private:
  RawRma(const std::string& store, DataClientOptions options);

  std::string address_;
  DataClientOptions options_;
  StoreClient control_;
  std::shared_ptr<ucx::Context> ctx_;
  std::vector<std::shared_ptr<ucx::MemoryRegion>> regions_;
  std::unique_ptr<DataPlaneConnection> conn_;
  std::vector<uint64_t> get_leases_, put_leases_;
};

}  // namespace kvtier::bench
