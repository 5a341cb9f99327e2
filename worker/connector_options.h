// What a KvConnector is configured with (ConnectorOptions) and what it
// counts (ConnectorStats, LoadTimes); worker/connector.h has the connector.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "client/router_client.h"
#include "client/store_data_client.h"
#include "common/block_key.h"
#include "gpu/kv_layout.h"
#include "gpu/page_copier.h"
#include "worker/page_pool.h"

namespace kvtier::worker {

struct ConnectorOptions {
  NamespaceSpec spec;
  uint64_t num_pages = 1024;
  std::vector<std::string> stores;     // kvtier-store addresses; empty: no store tier
  std::string offload = "write-back";  // "write-back", "write-through" or "none"
  uint64_t staging_blocks = 64;        // staging bound per direction (offload, load), in blocks
  uint64_t offload_batch = 32;         // blocks per offload operation (at most)
  uint32_t offload_threads = 1;        // offload operations in flight at once
  // The offloading thread's nice value (0..19): 10 yields the CPU to loads
  // and to the engine; 0 for an engine whose saves another engine waits on
  // (a P/D prefill's: its decode's fence).
  int offload_nice = 10;
  // Pool mode, write-through: saved pages waiting for a staging slot stay
  // referenced in the pool, at most this many (0: every page); past it, or
  // when a request needs the pages, the oldest waiting save is dropped.
  uint64_t max_held_pages = 0;
  DataClientOptions data;  // deadlines, lanes, shared memory, ...
  // Set: the engine owns the KV cache (see above) and num_pages is its page
  // count. The memory must outlive the connector.
  std::optional<gpu::PageMemory> engine_memory;
  // Engine mode: how the connector reaches the engine's pages. Empty: they
  // are host memory it reads and writes itself (loads land in them by RMA).
  // "cuda" / "cuda:N": they are on that GPU; "host": host memory reached
  // the same way as a GPU's (gpu/page_copier.h). From a store whose arena
  // is mapped here, a load is copied into the pages in place (the arena is
  // registered with the copier on first use: pinned for a GPU); otherwise
  // it lands in the load half of the staging memory (registered with the
  // data plane and pinned for the GPU) and is copied into the pages layer
  // by layer as the layers arrive. Every save is copied from the pages into
  // the offload half before SaveFrom returns.
  std::string page_copier;
  // A save through a page copier to a store mapped here waits at most this
  // long for the store to reserve its slots (it goes through the staging
  // instead, which never waits for the store).
  int reserve_budget_ms = 50;
  // A save in place is committed with the store hashing the slots
  // (CommitPutRequest.store_checksums): one pass over the bytes instead of
  // this process's and the store's verification. false: this process sums
  // them (on kCommitSumThreads) and the store checks them (a store too old
  // to hash them refuses the commit).
  bool in_place_store_hashes = true;
};

// Where a load's time went, in milliseconds.
struct LoadTimes {
  TransferTimes transfer;  // pin round trip (control), lane wait, RMA, checksum
  double staging_ms = 0;   // waiting for load staging (int8 namespaces)
  double scatter_ms = 0;   // unpacking staged blocks into pages (int8 namespaces)
  LoadTimes& operator+=(const LoadTimes& o) {
    transfer += o.transfer;
    staging_ms += o.staging_ms;
    scatter_ms += o.scatter_ms;
    return *this;
  }
};

struct ConnectorStats {
  uint64_t loads = 0, loaded_blocks = 0, load_failures = 0;
  uint64_t offloaded_blocks = 0, offload_skipped_known = 0, offload_dropped_full = 0,
           offload_failures = 0;
  uint64_t offload_no_staging = 0;  // blocks a save dropped: no staging slot within its wait
  // Blocks an offload sent that the store did not write: no room for them,
  // or busy under another writer's reservation after the retries (not
  // failures: the put succeeded for the rest).
  uint64_t offload_no_space = 0, offload_busy = 0;
  // Offload operations, the waits on the store they took, and the block
  // bytes they sent; blocks computed into the pool (pool mode).
  uint64_t offload_batches = 0, offload_round_trips = 0, offloaded_bytes = 0, computed_blocks = 0;
  uint64_t staging_in_use = 0, staging_peak = 0, staging_blocks = 0;  // offload staging
  uint64_t offload_blocks_in_flight = 0;  // taken by the offloader, not yet written or failed
  uint64_t load_staging_peak = 0;         // load staging
  uint64_t corrupt_dropped = 0;           // blocks that failed their checksum and the store dropped
  // Of loaded_blocks, read by the page copier in place from a store's arena
  // mapped here (no staging).
  uint64_t in_place_blocks = 0;
  // Of offloaded_blocks, gathered by the page copier straight into a
  // mapped store's slots (no staging).
  uint64_t in_place_saved = 0;
  LoadTimes load_times;          // summed over loads
  TransferTimes offload_times;   // summed over offload batches
  double offload_gather_ms = 0;  // gathering (and packing) pages into staging
  PagePool::Counters pool;
};

}  // namespace kvtier::worker
