// kvtier.v1.SimWorker served for an engine behind it, the one path both
// kvtier-sim-worker and Python's kvtier.WorkerServer (the PyTorch reference
// engine) take: the server (TLS as the flags say), a Submit's prompt
// checked and hashed once (common/prompt_chain.h: the prompt limits, the
// namespace's block size), every handler fenced until the server stops, and
// the engine's hello, heartbeats and block events published to every
// router replica (client/router_fanout.h).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/router_fanout.h"
#include "common/prompt_chain.h"
#include "common/rpc/grpc_server.h"
#include "common/rpc/tls.h"
#include "kvtier/v1/worker.pb.h"

namespace kvtier::worker {

// A Submit, checked: its prompt as the chain the namespace keys blocks by.
struct SubmitPrompt {
  uint64_t request_id = 0;  // 0: the engine picks one
  PromptChain prompt;
  std::vector<uint32_t> tokens;  // the token ids, when the request gave them
  bool hashed = false;           // the request gave its own chain instead
  uint32_t output_tokens = 0;
  std::optional<double> arrival_ms;
  std::optional<uint32_t> store_hint_blocks;  // SubmitRequest.store_hint_blocks
};

// The engine behind the server. Its methods may run on several gRPC
// threads at once; an error status is answered as the gRPC one.
class WorkerEngine {
 public:
  virtual ~WorkerEngine() = default;
  virtual absl::Status Submit(const SubmitPrompt& p, v1::SubmitResponse* resp) = 0;
  virtual absl::Status Stats(v1::GetWorkerStatsResponse* resp) = 0;
  // For heartbeats (called on the publishers' threads).
  virtual v1::Heartbeat Load() = 0;
};

struct WorkerServerOptions {
  std::string binary;     // names the server in messages
  std::string id_prefix;  // the default worker id is ID_PREFIX@ADDRESS
  std::string listen;     // HOST:PORT (port 0: a free one)
  TlsFlags tls;           // serving (cert, key, client certificates) and dialling routers
  std::vector<std::string> routers;
  std::string worker_id;  // towards routers [default: ID_PREFIX@ADDRESS]
  std::string endpoint;   // where routers send requests [default: the bound address]
  uint64_t namespace_id = 0;
  uint32_t block_tokens = 0;
  uint64_t heartbeat_ms = 1000;
  uint64_t router_refresh_ms = 5000;
};

class WorkerServer {
 public:
  // Serves `engine` (which must outlive the server). INVALID_ARGUMENT for
  // bad TLS files or options, UNAVAILABLE if it cannot listen.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(WorkerEngine* engine,
                                                             WorkerServerOptions options);
  ~WorkerServer();  // Stop()

  // Shuts the server down (5 s grace), waits for every handler, then stops
  // the publishers. Idempotent.
  void Stop();
  // Publishes the engine's block events; nullptr without routers.
  BlockEventSink* events() { return fanout_.get(); }
  const StartedServer& started() const { return started_; }
  std::string address() const { return started_.address(); }
  int port() const { return started_.port; }
  const std::string& worker_id() const { return worker_id_; }

 private:
  class Service;
  WorkerServer() = default;
  std::unique_ptr<Service> service_;
  StartedServer started_;
  std::string worker_id_;
  std::unique_ptr<RouterFanout> fanout_;
};

}  // namespace kvtier::worker
