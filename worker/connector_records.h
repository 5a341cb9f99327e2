// The records KvConnector (worker/connector.h) keeps of its requests, their
// loads and saves, and of the store arenas its page copier reaches. Internal
// to the connector's implementation files.
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/sharded_store_client.h"
#include "common/block_key.h"
#include "worker/connector_options.h"

namespace kvtier::worker::connector_detail {

// A request's offloads in flight. "mu_" below is KvConnector::mu_.
struct SaveState {
  uint64_t pending = 0;
  absl::Status status;  // the first failure
};
struct Request {
  std::vector<BlockHash> chain;
  std::vector<uint32_t> pages;  // pinned pages, chain order, for the first pages.size() blocks
  uint32_t gpu_blocks = 0, store_blocks = 0, loaded = 0, loaded_from_disk = 0;
  std::vector<uint32_t> computed;    // pages from AllocateForCompute
  std::vector<uint32_t> load_pages;  // engine mode: the engine's pages to load into
  ShardedPin pin;                    // the store's pin of the blocks after the GPU prefix
  // The load runs once, on a cached thread or on the thread that waits for
  // it first (whichever claims it): a caller that waits at once pays no
  // hand-off. Shared, so a cached thread that comes late never touches a
  // finished request.
  std::shared_ptr<std::atomic<bool>> load_claim;
  std::promise<absl::StatusOr<uint32_t>> load_promise;
  std::future<absl::StatusOr<uint32_t>> load;
  bool load_started = false, load_ended = false;  // guarded by mu_
  uint32_t layers_in = 0;                         // guarded by mu_
  absl::Status load_status;                       // guarded by mu_, once load_ended
  LoadTimes load_times;
  // Its saves, shared with the staged blocks: they outlive a request
  // finished before its saves are written.
  std::shared_ptr<SaveState> saves = std::make_shared<SaveState>();
};
struct Staged {
  BlockHash hash;
  uint32_t slot;
  std::shared_ptr<SaveState> waiter;  // the request's saves; none for write-back
};
// A save waiting for a staging slot, its page held (referenced) until the
// offloader has copied it out.
struct Held {
  BlockHash hash;
  uint32_t page;
  std::shared_ptr<SaveState> waiter;
};

// A store arena mapped here that the page copier reaches (registered with
// it), or refused; it keeps the mapping alive.
struct ReachedArena {
  uint8_t* base;
  std::shared_ptr<const void> keep;
  bool refused;
};

// Saves gathered in place into a mapped store's slots, waiting for their
// checksums and CommitPut (KvConnector::CommitLoop).
struct InPlaceCommit {
  Reservation reservation;
  std::vector<BlockHash> hashes;  // per block asked for
  std::shared_ptr<SaveState> waiter;
};

}  // namespace kvtier::worker::connector_detail
