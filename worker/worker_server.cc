#include "worker/worker_server.h"

#include <grpcpp/grpcpp.h>

#include "common/limits.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/proto_convert.h"
#include "kvtier/v1/worker.grpc.pb.h"

namespace kvtier::worker {

class WorkerServer::Service final : public v1::SimWorker::Service {
 public:
  Service(WorkerEngine* engine, uint64_t ns, uint32_t block_tokens)
      : engine_(engine), ns_(ns), block_tokens_(block_tokens) {}

  grpc::Status Submit(grpc::ServerContext*, const v1::SubmitRequest* req,
                      v1::SubmitResponse* resp) override {
    auto done = fence_.Enter();
    auto prompt = PromptFromRequest(*req, ns_, block_tokens_, "submit");
    if (!prompt.ok()) return ToGrpc(prompt.status());
    SubmitPrompt p;
    p.request_id = req->request_id();
    p.prompt = *std::move(prompt);
    if (req->prompt_case() == v1::SubmitRequest::kTokens) {
      p.tokens.assign(req->tokens().ids().begin(), req->tokens().ids().end());
    }
    p.hashed = req->prompt_case() == v1::SubmitRequest::kHashes;
    p.output_tokens = req->output_tokens();
    if (req->has_arrival_ms()) p.arrival_ms = req->arrival_ms();
    if (req->has_store_hint_blocks()) p.store_hint_blocks = req->store_hint_blocks();
    return ToGrpc(engine_->Submit(p, resp));
  }

  grpc::Status GetWorkerStats(grpc::ServerContext*, const v1::GetWorkerStatsRequest*,
                              v1::GetWorkerStatsResponse* resp) override {
    auto done = fence_.Enter();
    return ToGrpc(engine_->Stats(resp));
  }

  // After the server stopped: returns once every handler has.
  void Quiesce() const { fence_.Quiesce(); }

 private:
  WorkerEngine* engine_;
  const uint64_t ns_;
  const uint32_t block_tokens_;
  HandlerFence fence_;
};

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(WorkerEngine* engine,
                                                                  WorkerServerOptions o) {
  if (o.block_tokens < limits::kMinBlockTokens || o.block_tokens > limits::kMaxBlockTokens) {
    return absl::InvalidArgumentError("worker server: block_tokens out of range");
  }
  if (!o.routers.empty() && o.heartbeat_ms == 0) {
    return absl::InvalidArgumentError("the heartbeat period towards routers must be positive");
  }
  auto credentials = ServerCredentials(o.tls);
  if (!credentials.ok()) return credentials.status();
  auto security = ClientSecurity(o.tls);
  if (!security.ok()) return security.status();
  std::unique_ptr<WorkerServer> s(new WorkerServer());
  s->service_ = std::make_unique<Service>(engine, o.namespace_id, o.block_tokens);
  auto started = StartGrpcServer({o.binary, o.listen, *credentials, {s->service_.get()}, 64 << 20});
  if (!started.ok()) return started.status();
  s->started_ = std::move(*started);
  s->worker_id_ = o.worker_id.empty() ? o.id_prefix + "@" + s->started_.address() : o.worker_id;
  if (!o.routers.empty()) {
    PublisherOptions po;
    po.hello.set_source_id(s->worker_id_);
    po.hello.set_kind(v1::SOURCE_WORKER);
    po.hello.set_endpoint(o.endpoint.empty() ? s->started_.address() : o.endpoint);
    po.hello.set_namespace_id(o.namespace_id);
    po.hello.set_block_tokens(o.block_tokens);
    po.heartbeat_ms = o.heartbeat_ms;
    po.security = *security;
    s->fanout_ = std::make_unique<RouterFanout>(
        o.routers, po, [engine] { return engine->Load(); }, o.router_refresh_ms);
  }
  return s;
}

void WorkerServer::Stop() {
  if (started_.server) {
    started_.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    started_.server->Wait();
    service_->Quiesce();
    started_.server.reset();
  }
  if (fanout_) fanout_->Stop();
}

WorkerServer::~WorkerServer() { Stop(); }

}  // namespace kvtier::worker
