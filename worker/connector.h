// The worker library's connector: what an inference engine calls around
// each request, shaped after engines' KV-connector hooks.
//
//   Begin(request, chain)      -> blocks already on the GPU (pinned) and how
//                                 many more the store holds, pinned there by
//                                 the same single round trip (BeginGet)
//   StartLoad / WaitForLayer / -> onboard those: RMA straight into the pages,
//     WaitForLoad                 layer by layer (layer 0 of every block
//                                 first), so the engine may compute layer l
//                                 while l + 1 is in flight; each block is
//                                 then verified against its checksum and the
//                                 store's pin released without a round trip
//                                 on the request's path
//   AllocateForCompute         -> pages for the blocks the engine computes
//   Save / WaitForSave         -> make them matchable; write-through offload
//   Finished                   -> unpin everything of the request
//
// With kv_wire int8 in the namespace the store holds packed blocks: loads
// land in the load half of the staging memory and are unpacked into the
// pages layer by layer, offloads are gathered and packed in one pass.
//
// A layer reported in by WaitForLayer holds the store's bytes, not yet
// verified: WaitForLoad is the verdict, and an error there means the engine
// must compute the blocks (and discard what it computed from them), as with
// vLLM's load-error reporting.
//
// Offload: pages leaving the hot set (write-back) or freshly saved blocks
// (write-through) are copied into registered staging buffers at once (so
// the pages are free to go) and written to the store in batches (BeginPut,
// then the bytes with the commit behind them) by a background thread at
// low CPU priority. No request waits for the store: Save keeps the saved
// pages referenced until the offloader copies them out (a request short of
// pages takes them from the oldest waiting saves, dropped and counted in
// offload_dropped_full); an eviction's write-back is dropped when no staging
// slot is free; Finished does not wait for the request's saves (WaitForSave
// is there for engines that want to). SaveFrom (engine mode) copies the
// blocks out before it returns, since the engine reuses its pages: a save
// larger than the staging waits for slots as the offloader frees them.
// Staging is bounded: staging_blocks for offloads and as many for loads (so
// neither starves the other).
// In pool mode, blocks known to be in the store are not offloaded again (a
// store that forgets the namespace clears what is known). A store that
// fails makes loads return an error (the engine computes those blocks
// instead) and offloads count as failed; nothing blocks for longer than the
// configured deadlines. Thread-safe; one request id is used by one thread at
// a time.
//
// Two memory modes. By default the connector owns the paged KV cache (a
// PagePool: GPU prefix matching, page allocation, eviction and write-back;
// kvtier-sim-worker uses it). With ConnectorOptions::engine_memory the
// engine owns it, as vLLM and SGLang do: the engine registers its per-layer
// K and V memory (gpu::PageMemory), keeps its own prefix cache and chooses
// the pages, and every call names them:
//   Lookup(request, chain, skip)   -> blocks after the engine's own `skip`
//                                     that the store holds, pinned there
//   StartLoadInto(request, pages)  -> onboard them into those pages (then
//                                     WaitForLayer / WaitForLoad as above)
//   SaveFrom(request, first, pages)-> copy computed blocks out for the store
//   WaitForSave / Finished
// Begin, AllocateForCompute, Save and pool() are for the first mode only
// (FAILED_PRECONDITION otherwise), Lookup, StartLoadInto and SaveFrom for
// the second. Engine memory takes plain blocks only (kv_wire int8 needs the
// pool). It is host memory the connector reads and writes itself, or memory
// it reaches through a page copier (ConnectorOptions::page_copier: a GPU's).
// With a copier, a load from a same-host store whose arena is mapped here
// is read in place: the copier reads each block where the store holds it,
// other threads verify the checksums meanwhile, and the layers are reported
// in once all are verified; elsewhere it goes through the staging memory.
//
// Implementation, one concept per file: connector.cc (construction, the
// request table, matching), connector_load.cc (onboard), connector_offload.cc
// (save and offload), connector_in_place.cc (saves into a mapped store's
// slots), connector_drain.cc (Drain, SaveHot), connector_staging.cc (the
// staging memory both use). Options and counters: connector_options.h; the
// records of its requests and saves: connector_records.h.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "client/router_client.h"
#include "client/store_data_client.h"
#include "common/block_key.h"
#include "common/thread_cache.h"
#include "gpu/kv_layout.h"
#include "gpu/page_copier.h"
#include "worker/connector_options.h"
#include "worker/connector_records.h"
#include "worker/page_pool.h"

namespace kvtier::worker {

class KvConnector {
 public:
  struct Match {
    uint32_t gpu_blocks = 0;      // leading blocks on this worker's pages (now pinned)
    uint32_t store_blocks = 0;    // blocks after those the store holds
    absl::Status store_status;    // why the store could not be asked (then store_blocks is 0)
    bool lookup_skipped = false;  // the store was not asked (Begin's store_hint)
  };

  static absl::StatusOr<std::unique_ptr<KvConnector>> Create(ConnectorOptions options);
  // Routers' publishers that receive BlockStored / BlockRemoved for the
  // pages. May be set while requests run (a server learns its bound port,
  // which publishers announce, only once it serves).
  void SetPublishers(std::vector<BlockEventSink*> publishers) {
    std::lock_guard lk(publishers_mu_);
    publishers_ = std::move(publishers);
  }
  ~KvConnector();

  uint64_t namespace_id() const { return ns_; }
  uint64_t block_bytes() const { return layout_.block_bytes(); }
  // Bytes of a block in the store and on the wire (half for kv_wire int8).
  uint64_t wire_block_bytes() const { return wire_bytes_; }
  uint32_t block_tokens() const { return layout_.block_tokens; }
  // REQUIRES: the connector owns its pages (no engine_memory).
  PagePool& pool() { return *pool_; }
  bool engine_owned() const { return !pool_; }
  // Whether it has a store tier (any --store).
  bool has_store() const { return store_ != nullptr; }
  const gpu::PageMemory& memory() const { return memory_; }

  // `lookup_budget`: how long the store lookup may take at most (a lookup
  // is worth no more than the compute it can save; past it, or with the
  // store unreachable, store_status says why and the engine computes). The
  // store's shard is then skipped for a while (ShardedStoreClient), so a
  // stalled store costs one request its budget, not every request.
  // `store_hint`: the end of the deepest run of the chain's blocks the
  // stores hold, as a router knows them (RouteResponse.store_end_blocks);
  // when the pages hold at least that many the store is not asked
  // (lookup_skipped). A stale hint costs compute, never a wrong block.
  absl::StatusOr<Match> Begin(uint64_t request, std::vector<BlockHash> chain,
                              std::optional<std::chrono::milliseconds> lookup_budget = std::nullopt,
                              std::optional<uint32_t> store_hint = std::nullopt);

  // Engine mode. Opens the request over its chain, of which the engine has
  // the first skip_blocks itself, and pins in the store the blocks after
  // those that it holds (Match: gpu_blocks = skip_blocks, store_blocks).
  // A request open already whose load has not started is looked up afresh
  // (an engine's scheduler may ask again after failing to allocate).
  // INVALID_ARGUMENT for an empty chain or skip_blocks beyond it;
  // FAILED_PRECONDITION in pool mode or for an open request whose load
  // started.
  // budget: how long the store's pin may take (none: the client's
  // deadline); past it the lookup finds nothing in the store and says why.
  absl::StatusOr<Match> Lookup(uint64_t request, std::vector<BlockHash> chain, uint32_t skip_blocks,
                               std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // Engine mode. Starts loading the first pages.size() blocks Lookup pinned
  // into those pages (an engine may take fewer than were found); the pins of
  // the rest are released. INVALID_ARGUMENT for more pages than blocks
  // found, a page id out of range or named twice; otherwise as StartLoad.
  absl::Status StartLoadInto(uint64_t request, std::vector<uint32_t> pages);
  // Engine mode. Queues blocks chain[first_block + i], computed into
  // pages[i], for the store; their bytes are copied out before it returns,
  // so the engine may reuse the pages at once. Every block is offered to the
  // store, which takes only those it lacks (a hint of this process's is
  // never trusted alone: the store may have restarted or evicted them since),
  // unless skip_known: then blocks this process saw stored are skipped (a
  // drain sweeping the whole cache within a byte budget). INVALID_ARGUMENT for blocks beyond the
  // chain or a bad page id; RESOURCE_EXHAUSTED when a block got no staging within wait_ms (none:
  // the data plane's deadline): it and those after it are not saved, those before are queued.
  absl::Status SaveFrom(uint64_t request, uint32_t first_block, const std::vector<uint32_t>& pages,
                        bool skip_known = false, std::optional<int> wait_ms = std::nullopt);
  // Starts onboarding the blocks Begin found in the store. NOT_FOUND for an
  // unknown request, FAILED_PRECONDITION for one whose load already started.
  absl::Status StartLoad(uint64_t request);
  // Returns once layer `layer` of every block being loaded is in its page
  // (unverified; see above), or the load has ended (then the load's status
  // if it failed before the layer came). OK at once when no load runs.
  // INVALID_ARGUMENT for a layer outside the namespace, NOT_FOUND for an
  // unknown request.
  absl::Status WaitForLayer(uint64_t request, uint32_t layer);
  // Blocks loaded (they are cached and pinned for the request). An error
  // means none were: the engine computes them.
  absl::StatusOr<uint32_t> WaitForLoad(uint64_t request);
  // Where the request's load spent its time (zero before it ended).
  LoadTimes LoadTimesOf(uint64_t request);
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
  // Pool mode, before AllocateForCompute: blocks after the request's pages
  // (its GPU prefix and what it loaded) that the pool has cached since its
  // Begin (another request computed them meanwhile) are pinned for it too,
  // as an engine's scheduler matches a request when it runs it. Returns how
  // many; 0 once pages were allocated, or with a load in flight.
  uint32_t MatchMore(uint64_t request);
  // Of the blocks loaded for the request, how many came from the store's NVMe tier.
  uint32_t LoadedFromDisk(uint64_t request);

  // Waits until every queued offload has finished (tests, shutdown).
  void Drain() { Drain(std::chrono::steady_clock::time_point::max()); }
  // The same, until `deadline`: then what the offloader has not taken yet
  // is dropped (counted in offload_dropped_full; nothing is half-written:
  // a put commits whole blocks or none) and it returns once the batch in
  // flight ends, within one store operation's deadline. False if it
  // dropped anything or saves were still held or committing.
  bool Drain(std::chrono::steady_clock::time_point deadline);

  // What SaveHot did.
  struct HotSave {
    uint64_t cached = 0;  // blocks the pool held
    uint64_t known = 0;   // of those, known to be in the store already
    uint64_t queued = 0;  // copied out for the store, most valuable first
    uint64_t saved = 0;   // of those, in the store now (written, or found there)
    uint64_t bytes = 0;   // wire bytes queued
    // Why it stopped short of every block the store lacked: "" (it did
    // not), "bytes" (the byte budget), "time" (the deadline: what was
    // still queued was dropped), "store" (the store refused or failed
    // some), "no store".
    std::string stopped;
    double ms = 0;
  };
  // Pool mode, for an engine on its way out (docs/operations.md, "Scaling
  // without losing the cache"): copies the pool's cached blocks the store
  // is not known to hold to the store, most valuable first
  // (PagePool::CachedByValue), at most max_bytes of them, and waits for
  // them until `deadline`; what is still queued then is dropped (nothing
  // is half-written: a put commits whole blocks or none), so it returns by
  // the deadline plus one store operation's. Meant for an engine that
  // takes no more requests. FAILED_PRECONDITION in engine mode.
  absl::StatusOr<HotSave> SaveHot(uint64_t max_bytes,
                                  std::chrono::steady_clock::time_point deadline);
  ConnectorStats stats() const;

 private:
  using SaveState = connector_detail::SaveState;
  using Request = connector_detail::Request;
  using Staged = connector_detail::Staged;
  using Held = connector_detail::Held;
  using ReachedArena = connector_detail::ReachedArena;
  using InPlaceCommit = connector_detail::InPlaceCommit;

  KvConnector() = default;

  // Pins chain[r->gpu_blocks...] in the store; the store's error, if any.
  absl::Status PinRest(Request* r, std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // Looks up an open request; FAILED_PRECONDITION when the mode is wrong.
  absl::StatusOr<Request*> Find(uint64_t request, bool engine_mode);
  absl::Status CheckPages(const std::vector<uint32_t>& pages) const;

  // connector.cc: what is known about where blocks are.
  bool KnownStored(const BlockHash& h) const;
  void NoteStored(const BlockHash& h);
  void PublishStored(const std::vector<BlockHash>& hashes);
  void PublishRemoved(const BlockHash& h);

  // connector_load.cc
  // Runs r's load if `claim` is still unclaimed.
  void RunLoad(Request* r, const std::shared_ptr<std::atomic<bool>>& claim);
  absl::StatusOr<uint32_t> Load(Request* r);
  // Loads r's next n store blocks into `pages`: RMA straight into them, or
  // through staging for int8. Returns how many were loaded and verified.
  absl::StatusOr<uint32_t> LoadDirect(Request* r, const std::vector<uint32_t>& pages);
  // Through the load half of the staging memory, unpacked (int8) or copied
  // by the page copier into the pages as each layer lands.
  absl::StatusOr<uint32_t> LoadStaged(Request* r, const std::vector<uint32_t>& pages);
  // In place, where this process maps the store's arena: the page copier
  // reads each block where the store holds it (no staging, no copy on the
  // CPU) while other threads sum the blocks' checksums; the layers are
  // reported in once every block is verified. FAILED_PRECONDITION, with
  // nothing moved, when the store is not mapped here or the copier cannot
  // reach its arena: the caller loads staged instead.
  absl::StatusOr<uint32_t> LoadInPlace(Request* r, const std::vector<uint32_t>& pages);
  // Makes the arenas `views` lie in reachable by the copier (registered once
  // each), and lets go of arenas no longer mapped; FAILED_PRECONDITION for
  // one the copier refused (it is not tried again).
  absl::Status ReachArenas(const BlockViews& views);
  // page's bytes (all layers) into the staging slot at dst: packed, by the
  // page copier, or copied here.
  absl::Status GatherInto(uint32_t page, uint8_t* dst);
  // Layers [0, n) of every block of r's load are in.
  void LayersIn(Request* r, uint32_t n);
  // A load failed its checksums: the store checks its copies of `blocks`
  // and drops the corrupt ones (one round trip, on this error path only), so
  // later loads miss them instead of failing on them again.
  void ReportCorrupt(const std::vector<BlockHash>& blocks);

  // connector_offload.cc
  // One block's save is under way, or has ended, for `waiter` (null: none,
  // a write-back): WaitForSave waits until every one ended, and answers
  // the first error one ended with.
  void SaveStarted(const std::shared_ptr<SaveState>& waiter);
  void SaveEnded(const std::shared_ptr<SaveState>& waiter,
                 const absl::Status& s = absl::OkStatus());
  // An offload operation (`what`: "offload", "in-place commit") of `blocks`
  // blocks failed: counted, and logged at most once a second.
  void NoteOffloadFailed(size_t blocks, const char* what, const absl::Status& s);
  // The pool evicts page (holding h): write it back if the policy says so.
  void WriteBack(const BlockHash& h, uint32_t page);
  // Gathers page into a staging slot and queues it for the store, counted
  // in `waiter` (if any) until written. Waits up to wait_ms for a slot;
  // false (the offload dropped, counted) if none came.
  bool StageForOffload(const BlockHash& hash, uint32_t page,
                       const std::shared_ptr<SaveState>& waiter, int wait_ms);
  // Pool mode: queues a cached page for the store without copying it; the
  // page stays referenced (so not evicted) until the offloader has copied
  // it into staging. Past max_held_pages the oldest held save is dropped.
  // The caller wakes the offloader (offload_cv_) once it queued them all.
  void HoldForOffload(const BlockHash& hash, uint32_t page,
                      const std::shared_ptr<SaveState>& waiter);
  // Drops a held save of the oldest request that has one, the last of its
  // chain (its page unreferenced, counted in offload_dropped_full); false if
  // none is held.
  bool DropOldestHeld();
  // When the offloader is copying held pages out (a memcpy, never a wait on
  // the store), waits until it has let them go; false if none were.
  bool WaitForGathers();
  // SaveFrom through a page copier, where this process maps the store's
  // arena: in runs of offload_batch blocks, reserves the blocks' slots in
  // the store (BeginPut, within reserve_budget_ms), gathers the pages straight
  // into them and queues the run for CommitLoop. Returns how many leading
  // blocks it took (reserved and gathered, or found present); the caller
  // stages the rest (a store not mapped here, or slow to answer).
  size_t SaveInPlace(const std::vector<BlockHash>& hashes, const std::vector<uint32_t>& pages,
                     const std::shared_ptr<SaveState>& waiter);
  // Committer threads (a quarter of the cores, 2 to 4), and the threads
  // each sums a run's blocks on (a quarter of the cores, 8 at most: the
  // last run's sums are the save's tail, with nothing left to overlap).
  static inline const unsigned kCommitters =
      std::clamp(std::thread::hardware_concurrency() / 4, 2u, 4u);
  static inline const int kCommitSumThreads =
      static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 4, 1u, 8u));
  // The committers: sum each queued run's slots (on several threads) and
  // commit them; the waiter hears the outcome.
  void CommitLoop();
  // The offloader: copies held pages into `slots` (one each) and lets the
  // pages go. REQUIRES: slots.size() == held.size().
  std::vector<Staged> GatherHeld(std::vector<Held> held, const std::vector<uint32_t>& slots);
  void OffloadLoop();

  // connector_staging.cc
  // Allocates both halves of the staging memory and registers it with the
  // store (if any). REQUIRES: options_, layout_ and store_ set.
  absl::Status InitStaging();
  // REQUIRES: staging_mu_ held. Waits up to wait_ms for n slots of the
  // offload (or the load) half of the staging memory.
  bool AcquireStagingLocked(std::unique_lock<std::mutex>& lk, size_t n, int wait_ms,
                            std::vector<uint32_t>* slots, bool for_load = false);
  // REQUIRES: staging_mu_ held. An offload slot for a save: waits up to
  // wait_ms while the offloader makes progress; once it has had a put out
  // for kOffloadStalled without one finishing, the save does not wait: it
  // takes the slot of the oldest request's last queued block (that block
  // is dropped and returned in *dropped), or fails when nothing is queued
  // or the oldest is the saving request (`waiter`, not null) itself: a
  // chain keeps a prefix in the store. Drops are counted in
  // offload_dropped_full.
  bool AcquireSaveSlotLocked(std::unique_lock<std::mutex>& lk, int wait_ms, const SaveState* waiter,
                             uint32_t* slot, std::optional<Staged>* dropped);
  void ReleaseStaging(const std::vector<uint32_t>& slots);
  uint8_t* Slot(uint32_t slot) const { return staging_ + uint64_t{slot} * wire_bytes_; }

  ConnectorOptions options_;
  gpu::KvLayout layout_;
  uint64_t ns_ = 0;
  uint64_t wire_bytes_ = 0;         // BlockBytes(spec): what the store and staging hold per block
  bool packed_ = false;             // kv_wire int8
  std::unique_ptr<PagePool> pool_;  // null in engine mode
  gpu::PageMemory memory_;          // the pages: the pool's or the engine's
  std::unique_ptr<gpu::PageCopier> copier_;  // engine memory reached by copies (a GPU's)
  // Store arenas mapped here that copier_ reaches (registered with it), and
  // the ones it refused; each entry keeps its mapping alive. arenas_mu_.
  std::mutex arenas_mu_;
  std::vector<ReachedArena> arenas_;
  std::unique_ptr<ShardedStoreClient> store_;
  std::mutex publishers_mu_;  // publishers_
  std::vector<BlockEventSink*> publishers_;
  std::atomic<bool> registered_{false};
  // Registers the namespace with every shard unless that was done.
  absl::Status EnsureRegistered();
  // True when `s` says a store forgot the namespace (NOT_FOUND after a
  // restart) and registering it again worked: the caller retries once.
  bool ForgotNamespace(const absl::Status& s);

  std::mutex mu_;  // requests_
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;

  mutable std::mutex staging_mu_;
  std::condition_variable staging_cv_, offload_cv_, drained_cv_;
  std::condition_variable layers_cv_;  // with mu_: a load's layers came in, or it ended
  uint8_t* staging_ = nullptr;
  std::vector<uint32_t> free_slots_;       // offload half: [0, staging_blocks)
  std::vector<uint32_t> load_free_slots_;  // load half: [staging_blocks, 2 x staging_blocks)
  std::deque<Staged> offload_queue_;
  std::deque<Held> held_;  // pool-mode saves not yet copied out (their pages referenced)
  // Held pages the offloader took out of held_ and is copying into staging
  // (still referenced, no longer droppable); guarded by staging_mu_,
  // staging_cv_ told when it falls.
  uint64_t gathering_ = 0;
  uint64_t offloads_running_ = 0;
  // When a put last finished, or the offloader last went from idle to busy.
  std::chrono::steady_clock::time_point offload_progress_{};
  // A put out this long with none finishing: the store is stalled (a batch
  // of small blocks normally takes well under a millisecond,
  // docs/benchmarks.md), plus the time its bytes take at kOffloadSlowest:
  // a batch of 32 blocks of 2 MiB (a Llama-3-8B layer set) is no stall at
  // 200 ms. REQUIRES: staging_mu_ held.
  static constexpr std::chrono::milliseconds kOffloadStalled{50};
  static constexpr double kOffloadSlowest = 200e6;  // bytes a second
  std::chrono::steady_clock::duration StalledAfterLocked() const {
    return kOffloadStalled +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(double(offloads_running_) * double(wire_bytes_) /
                                             kOffloadSlowest));
  }
  bool stop_ = false;
  std::vector<std::thread> offloaders_;
  // Saves gathered in place into a mapped store's slots, waiting for their
  // checksums and CommitPut (CommitLoop); staging_mu_, with commit_cv_.
  std::deque<InPlaceCommit> commit_queue_;
  uint64_t commits_running_ = 0;  // queued or committing
  std::condition_variable commit_cv_;
  std::vector<std::thread> committers_;

  mutable std::mutex known_mu_;
  absl::flat_hash_set<BlockHash, BlockHashHasher> known_;

  mutable std::mutex stats_mu_;
  ConnectorStats stats_;
  std::chrono::steady_clock::time_point last_failure_logged_{};  // an offload's (stats_mu_)

  // Last: destroyed first, once ~KvConnector has waited for every load.
  ThreadCache load_threads_;
};

}  // namespace kvtier::worker
