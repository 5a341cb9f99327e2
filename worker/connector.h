// The worker library's connector: what an inference engine calls around
// each request, shaped after engines' KV-connector hooks.
//
//   Begin(request, chain)      -> blocks already on the GPU (pinned) and how
//                                 many more the store holds
//   StartLoad / WaitForLoad    -> onboard those from the store: BeginGet, RMA
//                                 into staging, checksum, scatter into pages
//   AllocateForCompute         -> pages for the blocks the engine computes
//   Save / WaitForSave         -> make them matchable; write-through offload
//   Finished                   -> unpin everything of the request
//
// Offload: pages leaving the hot set (write-back) or freshly saved blocks
// (write-through) are gathered into registered staging buffers and written
// to the store in batches (BeginPut / RMA / CommitPut) by a background
// thread. Staging is bounded: staging_blocks for offloads and as many for
// loads (so neither starves the other); when the offload half is full an
// eviction waits up to offload_wait_ms for room, then gives up that offload
// (counted).
// Blocks known to be in the store are not offloaded again. A store that
// fails makes loads return an error (the engine computes those blocks
// instead) and offloads count as failed; nothing blocks for longer than the
// configured deadlines. Thread-safe; one request id is used by one thread at
// a time.
//
// Implementation, one concept per file: connector.cc (construction, the
// request table, matching), connector_load.cc (onboard), connector_offload.cc
// (save and offload), connector_staging.cc (the staging memory both use).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "common/block_key.h"
#include "client/router_client.h"
#include "client/store_data_client.h"
#include "gpu/kv_layout.h"
#include "worker/page_pool.h"

namespace kvtier::worker {

struct ConnectorOptions {
  NamespaceSpec spec;
  uint64_t num_pages = 1024;
  std::vector<std::string> stores;       // kvtier-store addresses; empty: no store tier
  std::string offload = "write-back";    // "write-back", "write-through" or "none"
  uint64_t staging_blocks = 64;          // staging bound per direction (offload, load), in blocks
  uint64_t offload_batch = 32;           // blocks per offload operation (at most)
  int offload_wait_ms = 50;              // how long an eviction waits for staging room
  DataClientOptions data;                // deadlines, lanes, shared memory, ...
};

struct ConnectorStats {
  uint64_t loads = 0, loaded_blocks = 0, load_failures = 0;
  uint64_t offloaded_blocks = 0, offload_skipped_known = 0, offload_dropped_full = 0,
           offload_failures = 0;
  uint64_t staging_in_use = 0, staging_peak = 0, staging_blocks = 0;  // offload staging
  uint64_t load_staging_peak = 0;                                     // load staging
  PagePool::Counters pool;
};

class KvConnector {
 public:
  struct Match {
    uint32_t gpu_blocks = 0;    // leading blocks on this worker's pages (now pinned)
    uint32_t store_blocks = 0;  // blocks after those the store holds
    absl::Status store_status;  // why the store could not be asked (then store_blocks is 0)
  };

  static absl::StatusOr<std::unique_ptr<KvConnector>> Create(ConnectorOptions options);
  // Routers' publishers that receive BlockStored / BlockRemoved for the
  // pages. May be set while requests run (a server learns its bound port,
  // which publishers announce, only once it serves).
  void SetPublishers(std::vector<EventPublisher*> publishers) {
    std::lock_guard lk(publishers_mu_);
    publishers_ = std::move(publishers);
  }
  ~KvConnector();

  uint64_t namespace_id() const { return ns_; }
  uint64_t block_bytes() const { return layout_.block_bytes(); }
  uint32_t block_tokens() const { return layout_.block_tokens; }
  PagePool& pool() { return *pool_; }

  absl::StatusOr<Match> Begin(uint64_t request, std::vector<BlockHash> chain);
  void StartLoad(uint64_t request);
  // Blocks loaded (they are cached and pinned for the request). An error
  // means none were: the engine computes them.
  absl::StatusOr<uint32_t> WaitForLoad(uint64_t request);
  // Pages for the request's blocks that are neither on the GPU nor loaded, in
  // chain order; RESOURCE_EXHAUSTED if the pool has no unpinned page.
  absl::StatusOr<std::vector<uint32_t>> AllocateForCompute(uint64_t request);
  // The computed pages hold their blocks now.
  absl::Status Save(uint64_t request);
  absl::Status WaitForSave(uint64_t request);
  void Finished(uint64_t request);
  // Whether the request is open: between Begin and Finished.
  bool IsOpen(uint64_t request);
  // The request's pages in chain order: its GPU prefix, the loaded blocks,
  // then the pages from AllocateForCompute.
  std::vector<uint32_t> Pages(uint64_t request);
  // Of the blocks loaded for the request, how many came from the store's NVMe tier.
  uint32_t LoadedFromDisk(uint64_t request);

  // Waits until every queued offload has finished (tests, shutdown).
  void Drain();
  ConnectorStats stats() const;

 private:
  struct Request {
    std::vector<BlockHash> chain;
    std::vector<uint32_t> pages;  // pinned pages, chain order, for the first pages.size() blocks
    uint32_t gpu_blocks = 0, store_blocks = 0, loaded = 0, loaded_from_disk = 0;
    std::vector<uint32_t> computed;  // pages from AllocateForCompute
    std::future<absl::StatusOr<uint32_t>> load;
    uint64_t pending_saves = 0;
    absl::Status save_status;
  };
  struct Staged {
    BlockHash hash;
    uint32_t slot;
    uint64_t request;  // 0 for write-back
  };

  KvConnector() = default;

  // connector.cc: what is known about where blocks are.
  bool KnownStored(const BlockHash& h) const;
  void NoteStored(const BlockHash& h);
  void PublishStored(const std::vector<BlockHash>& hashes);
  void PublishRemoved(const BlockHash& h);

  // connector_load.cc
  absl::StatusOr<uint32_t> Load(uint64_t request);

  // connector_offload.cc
  // The pool evicts page (holding h): write it back if the policy says so.
  void WriteBack(const BlockHash& h, uint32_t page);
  // Gathers page into a staging slot and queues it for the store.
  bool StageForOffload(const BlockHash& hash, uint32_t page, uint64_t request, int wait_ms);
  void OffloadLoop();

  // connector_staging.cc
  // Allocates both halves of the staging memory and registers it with the
  // store (if any). REQUIRES: options_, layout_ and store_ set.
  absl::Status InitStaging();
  // REQUIRES: staging_mu_ held. Waits up to wait_ms for n slots of the
  // offload (or the load) half of the staging memory.
  bool AcquireStagingLocked(std::unique_lock<std::mutex>& lk, size_t n, int wait_ms,
                            std::vector<uint32_t>* slots, bool for_load = false);
  void ReleaseStaging(const std::vector<uint32_t>& slots);
  uint8_t* Slot(uint32_t slot) const { return staging_ + uint64_t{slot} * layout_.block_bytes(); }

  ConnectorOptions options_;
  gpu::KvLayout layout_;
  uint64_t ns_ = 0;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<ShardedStoreClient> store_;
  std::mutex publishers_mu_;  // publishers_
  std::vector<EventPublisher*> publishers_;
  std::atomic<bool> registered_{false};

  std::mutex mu_;  // requests_
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;

  mutable std::mutex staging_mu_;
  std::condition_variable staging_cv_, offload_cv_, drained_cv_;
  uint8_t* staging_ = nullptr;
  std::vector<uint32_t> free_slots_;       // offload half: [0, staging_blocks)
  std::vector<uint32_t> load_free_slots_;  // load half: [staging_blocks, 2 x staging_blocks)
  std::deque<Staged> offload_queue_;
  uint64_t offloads_running_ = 0;
  bool stop_ = false;
  std::thread offloader_;

  mutable std::mutex known_mu_;
  absl::flat_hash_set<BlockHash, BlockHashHasher> known_;

  mutable std::mutex stats_mu_;
  ConnectorStats stats_;
};

}  // namespace kvtier::worker
