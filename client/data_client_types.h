// What callers hand to the data-plane clients and get back: the options
// shared by StoreDataClient and ShardedStoreClient, the blocks of one put or
// get, and their outcomes. A header of its own so that the sharded client's
// header needs only these, not the one-store client's.
//
// Plain values; no status codes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/block_key.h"
#include "common/rpc/tls.h"

namespace kvtier {

struct DataClientOptions {
  std::string client_id = "kvtier-client";
  // Lanes that run loads and offloads (loads first); each lane has its own
  // UCX worker and endpoint.
  int lanes = 2;
  // Further lanes that run loads only, so that a load never waits behind an
  // offload (transfer_lanes.h). Lanes in all: lanes + load_lanes.
  int load_lanes = 1;
  // How long a finished load's lease waits for the next pin to carry its
  // release before it is sent on its own (ReleaseGets).
  int release_delay_ms = 2;
  // Send pins (BeginGet), releases (ReleaseGets) and reservations (BeginPut)
  // as control calls on the data plane's UCX endpoint (common/ucx/calls.h) rather than as gRPC
  // calls, where the store takes them: a load then costs one UCX round trip
  // before its transfers. Stores that do not take them get gRPC.
  bool data_plane_calls = true;
  // Connections (each with its own UCX worker) those calls travel on: calls
  // in flight at once. Each is made on first use.
  int call_lanes = 4;
  // Connect through the store's sockaddr listener (RDMA-CM / TCP) instead of
  // its worker address. Sockaddr endpoints use network transports only.
  bool use_sockaddr = false;
  // Use shared memory when client and store share a host: map the store's
  // arena when it offers it (RemoteRegion.shm_path; transfers are then
  // memcpys), and let UCX use its shared-memory transports otherwise
  // (connects to the worker address without peer-failure handling, which
  // UCX 1.13's shared-memory transports need; a dead store then fails
  // operations at their deadline instead of at once). kAuto: on when the
  // store's address is a loopback one.
  enum class SharedMemory { kAuto, kOn, kOff };
  SharedMemory shared_memory = SharedMemory::kAuto;
  int deadline_ms = 10000;                     // per operation, RPCs and transfers together
  uint64_t max_inflight_bytes = 256ull << 20;  // queued + running operations
  uint64_t backoff_min_ms = 50;
  uint64_t backoff_max_ms = 5000;
  // ShardedStoreClient: a shard whose call failed UNAVAILABLE or
  // DEADLINE_EXCEEDED is skipped (UNAVAILABLE at once, no wait) for this
  // long, doubling while it keeps failing, up to the max; then one call
  // probes it. 0: never skipped.
  uint64_t shard_skip_min_ms = 200;
  uint64_t shard_skip_max_ms = 1000;
  ChannelSecurity security;  // of the gRPC control channel (plaintext unless set)
  // StoreClientOptions::tenant_token (empty: KVTIER_TENANT_TOKEN, if set).
  std::string tenant_token;
};

struct PutBlock {
  BlockHash hash;
  const void* data;  // block_bytes bytes, valid until the operation completes
};

struct GetBlock {
  BlockHash hash;
  void* dest;  // block_bytes bytes, written by the operation
};

// Where one operation's time went, in milliseconds (the replay's and the
// worker bench's breakdown). Summed over the operations of a sharded call.
struct TransferTimes {
  double control_ms = 0;   // control RPCs on the operation's path (pin / begin, commit)
  double queue_ms = 0;     // waiting for a lane: back-pressure and jobs ahead
  double rma_ms = 0;       // posting the transfers until the last one completed
  double checksum_ms = 0;  // checksums not overlapped with the transfers
  TransferTimes& operator+=(const TransferTimes& o) {
    control_ms += o.control_ms;
    queue_ms += o.queue_ms;
    rma_ms += o.rma_ms;
    checksum_ms += o.checksum_ms;
    return *this;
  }
};

// The leading present blocks of a chain, pinned in one store under one
// lease by a single control call (StoreDataClient::Pin): what a load needs
// to move bytes with no further round trip before them.
struct PinnedBlocks {
  struct Source {
    uint64_t remote_addr = 0;  // in the store's registered arena
    uint64_t checksum = 0;     // XXH3-64 of the block's bytes
    bool from_disk = false;    // promoted from the store's NVMe tier for this pin
  };
  uint64_t lease = 0;     // 0: nothing pinned
  uint64_t instance = 0;  // the store process that pinned them (0: it did not say)
  std::chrono::steady_clock::time_point expires{};  // the pins drop on their own then
  std::vector<Source> sources;                      // chain order
  double control_ms = 0;                            // the pin's round trip
};

// How a read lays each block's bytes out locally, and its progress. The
// block is cut at `bounds` into segments (a layer-wise load cuts it per
// layer or layer group): segment s is [bounds[s], bounds[s + 1]).
struct ReadPlan {
  // Empty: one segment, the whole block. Otherwise strictly increasing,
  // from 0 to the block's bytes (else the read is INVALID_ARGUMENT).
  std::vector<uint64_t> bounds;
  // Where segment s of block i goes (bounds[s + 1] - bounds[s] bytes).
  std::function<void*(size_t block, size_t segment)> dest;
  // Optional: called once per segment, in segment order, when that segment
  // of every block has landed (before the blocks' checksums are verified:
  // the read's outcome is the verdict).
  std::function<void(size_t segment)> on_segment;
};

struct PutOutcome {
  uint32_t written = 0;          // sent and committed
  uint32_t already_present = 0;  // the store had them: not sent
  uint32_t busy = 0;             // another writer had them in flight: not sent
  uint32_t no_space = 0;         // the store had no free slot: not sent
  uint32_t round_trips = 0;      // waits on the store (BeginPut; the commit behind the bytes)
  uint64_t bytes_sent = 0;       // block bytes that travelled
  TransferTimes times;
};

struct GetOutcome {
  uint32_t blocks = 0;     // leading blocks fetched and verified
  uint32_t from_disk = 0;  // of those, promoted from the store's NVMe tier
  TransferTimes times;
};

// Pinned blocks where they lie in a same-host store's arena mapped into this
// process (StoreDataClient::View): read in place, with no copy. The bytes
// stay as pinned until the pin is released or expires; nothing here has
// been verified (VerifyViews does that).
struct BlockViews {
  std::vector<const uint8_t*> blocks;  // each block_bytes bytes, in chain order
  std::vector<uint64_t> checksums;     // each block's XXH3-64, as the store has it
  uint32_t from_disk = 0;              // promoted from the store's NVMe tier for the pin
  // The mapped arenas the views lie in, each whole (for registering them
  // with a device that reads them): they stay mapped while `keep` is held.
  struct Region {
    uint8_t* base = nullptr;
    size_t length = 0;
    std::shared_ptr<const void> keep;
  };
  std::vector<Region> regions;
};

// A put whose writer fills the store's slots itself, where this process
// maps the store's arena (StoreDataClient::Reserve): the writer copies each
// reserved block's bytes into its slot, then commits them (with their
// checksums) or aborts. Slots stay reserved until then, or until the
// store's lease on them expires.
struct Reservation {
  // Per block asked for, in order: where its bytes go, or nullptr (not
  // reserved: the store has it, another writer has it in flight, or the
  // store had no room).
  std::vector<uint8_t*> slots;
  uint32_t already_present = 0, busy = 0, no_space = 0;
  struct Lease {
    size_t shard = 0;
    uint64_t id = 0;
    std::vector<size_t> blocks;  // the reserved blocks' indices, in commit order
  };
  std::vector<Lease> leases;                // one per store that reserved any
  std::vector<BlockViews::Region> regions;  // the mapped arenas the slots lie in
  double control_ms = 0;                    // BeginPut's round trip (the slowest store's)
};

// XXH3-64 of each block (block_bytes each), on up to `threads` threads at
// once (the caller's among them).
std::vector<uint64_t> SumBlocks(const std::vector<const uint8_t*>& blocks, uint64_t block_bytes,
                                int threads);

// The leading blocks of `views` whose bytes (block_bytes each) match their
// checksums, summed on up to `threads` threads at once (the caller's among
// them): a large view is read at memory speed by each. Every block is
// summed, the ones after a bad one too.
size_t VerifyViews(const BlockViews& views, uint64_t block_bytes, int threads);

}  // namespace kvtier
