// vLLM's own KV events, fed to the router (docs/router.md, "vLLM's KV
// events"). A vLLM engine started with --kv-events-config publishes, on a
// ZeroMQ PUB socket, one message per engine step: [topic, seq (8 bytes,
// big-endian), msgpack KVEventBatch], where the batch is [ts, events,
// data_parallel_rank] and each event a BlockStored, BlockRemoved or
// AllBlocksCleared -- a positional array (tag first) up to vLLM 0.23, a map
// with "type" since. Its ROUTER replay socket answers [empty, start seq]
// with the batches it still holds from that seq and an end marker (seq -1,
// empty payload).
//
// The parts: the engines' specs (router/vllm_source_spec.h), a batch's
// decoding (router/vllm_batch.h), the hash map (router/vllm_chain_map.h) and
// the subscriber here, which feeds the router core in-process.
#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include "router/source_messages.h"
#include "router/vllm_batch.h"
#include "router/vllm_chain_map.h"
#include "router/vllm_source_spec.h"

namespace kvtier::router {

class RouterCore;

// Subscribes to one engine and feeds `core` as a worker source: a hello and
// an empty snapshot, then its events with the source's own sequence
// numbers, and a heartbeat a second (vLLM's events carry no load: the router
// counts what it routed there since, and a caller may add what it knows
// with SetLoad). A gap in vLLM's sequence is filled
// from the replay socket; when it cannot be (no replay socket, the batches
// gone, a malformed message) the source resyncs: the router forgets the
// engine's blocks and replays what the engine's buffer holds. A sequence
// back at 0, one that goes back after the connection to the engine dropped,
// or one over 10,000 behind the last applied is an engine restart: its old
// blocks are forgotten and what the new engine published is replayed.
// Nothing a peer sends can crash it.
class VllmEventSource {
 public:
  VllmEventSource(VllmSourceSpec spec, RouterCore* core);
  ~VllmEventSource();  // stops the thread
  VllmSourceStats stats() const;
  // The engine's load as its caller sees it (a frontend: the prompt tokens
  // it sent there and vLLM's own /metrics), told to the router now and with
  // each heartbeat after (only then, without tell_now), in place of the
  // router's own count alone.
  void SetLoad(const SourceLoad& load, bool tell_now = true);
  const VllmSourceSpec& spec() const { return spec_; }

 private:
  struct Impl;
  VllmSourceSpec spec_;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
};

}  // namespace kvtier::router
