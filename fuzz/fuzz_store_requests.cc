// libFuzzer: the store's request validation paths. The input is split into a
// request kind and protobuf bytes; whatever parses is sent through the real
// StoreService over a real Store (RAM + RocksDB in a scratch dir). Nothing
// may crash, and the one stored block must stay byte-exact throughout.
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "cachestore/service.h"
#include "cachestore/store.h"
#include "common/checksum.h"
#include "common/log.h"
#include "fuzz/fuzz_store.h"

namespace {

struct Fixture {
  std::unique_ptr<kvtier::store::Store> store;
  std::unique_ptr<kvtier::store::StoreService> service;
  uint64_t ns = 0;
  std::string block;
  Fixture() {
    store = kvtier::fuzz::OpenScratchStore("kvtier-fuzz", 50);
    service = std::make_unique<kvtier::store::StoreService>(store.get(), nullptr);
    kvtier::NamespaceSpec spec{"fuzz", "fp16", 1, 1, 8, 16, 0, 1, "", "", ""};
    ns = store->RegisterNamespace(spec, 0)->id;
    block.assign(kvtier::BlockBytes(spec), 'k');
    (void)store->PutInline(ns, kvtier::BlockHash{1, 1}, block,
                           kvtier::Checksum(block.data(), block.size()));
  }
};

template <typename Req, typename Resp, typename Fn>
void Drive(const uint8_t* data, size_t size, Fn fn) {
  Req req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  Resp resp;
  grpc::ServerContext ctx;
  (void)fn(&ctx, &req, &resp);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* f = new Fixture();
  if (size < 1) return 0;
  auto* s = f->service.get();
  using namespace kvtier::v1;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  switch (data[0] % 11) {
    case 0:
      Drive<LookupRequest, LookupResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->Lookup(c, q, r); });
      break;
    case 1:
      Drive<BeginPutRequest, BeginPutResponse>(p, n, [&](auto* c, auto* q, auto* r) {
        auto st = s->BeginPut(c, q, r);
        if (st.ok() && r->lease_id()) {
          AbortPutRequest a;
          a.set_lease_id(r->lease_id());
          AbortPutResponse ar;
          grpc::ServerContext c2;
          (void)s->AbortPut(&c2, &a, &ar);
        }
        return st;
      });
      break;
    case 2:
      Drive<CommitPutRequest, CommitPutResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->CommitPut(c, q, r); });
      break;
    case 3:
      Drive<BeginGetRequest, BeginGetResponse>(p, n, [&](auto* c, auto* q, auto* r) {
        auto st = s->BeginGet(c, q, r);
        if (st.ok() && r->lease_id()) {
          EndGetRequest e;
          e.set_lease_id(r->lease_id());
          EndGetResponse er;
          grpc::ServerContext c2;
          (void)s->EndGet(&c2, &e, &er);
        }
        return st;
      });
      break;
    case 4:
      Drive<RegisterNamespaceRequest, RegisterNamespaceResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->RegisterNamespace(c, q, r); });
      break;
    case 5:
      Drive<SetPolicyRequest, SetPolicyResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->SetPolicy(c, q, r); });
      break;
    case 6:
      Drive<EvictRequest, EvictResponse>(p, n, [&](auto* c, auto* q, auto* r) {
        // Keep the witness block: only evict other namespaces and keys.
        if (q->target_case() == EvictRequest::kAll) return grpc::Status::OK;
        if (q->target_case() == EvictRequest::kNamespaceId && q->namespace_id() == f->ns)
          return grpc::Status::OK;
        if (q->target_case() == EvictRequest::kKeys) {
          for (const auto& k : q->keys().keys()) {
            if (k.namespace_id() == f->ns) return grpc::Status::OK;
          }
        }
        return s->Evict(c, q, r);
      });
      break;
    case 7:
      Drive<EndGetRequest, EndGetResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->EndGet(c, q, r); });
      break;
    case 8:
      Drive<AbortPutRequest, AbortPutResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->AbortPut(c, q, r); });
      break;
    case 9:
      Drive<VerifyBlocksRequest, VerifyBlocksResponse>(
          p, n, [&](auto* c, auto* q, auto* r) { return s->VerifyBlocks(c, q, r); });
      break;
    case 10:
      Drive<RemoveNamespaceRequest, RemoveNamespaceResponse>(p, n, [&](auto* c, auto* q, auto* r) {
        // The witness's namespace is the one thing not to remove.
        if (q->namespace_id() == f->ns) return grpc::Status::OK;
        return s->RemoveNamespace(c, q, r);
      });
      break;
  }
  // The witness block is still there, byte-exact.
  kvtier::BlockHash h{1, 1};
  bool seen = false;
  (void)f->store->GetInline(f->ns, {&h, 1},
                            [&](uint32_t, kvtier::store::TierKind, std::string_view b, uint64_t) {
                              if (b != f->block) __builtin_trap();
                              seen = true;
                              return true;
                            });
  if (!seen) __builtin_trap();
  return 0;
}
