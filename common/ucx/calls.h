// Control calls over the data plane: a store's BeginGet, ReleaseGets and
// BeginPut carried as UCX active messages on the endpoint a client already holds for
// RMA, instead of as gRPC calls. A load is then one UCX round trip (tens of
// microseconds over TCP, a few over shared memory) where a gRPC call costs
// hundreds on a loaded host (docs/dataplane.md, "Control calls").
//
// Wire format (both sides are little-endian hosts; the magic tells a peer of
// another layout or version apart):
//   call   AM id kCallAmId,  header CallHeader,  data: the request message
//          (kvtier.v1 protobuf), sent eager with UCP_AM_SEND_FLAG_REPLY;
//   reply  AM id kReplyAmId, header ReplyHeader, data: the response message
//          when code is 0 (OK), else the error's text; code is a
//          google.rpc.Code (the gRPC / absl status codes).
// The session is the one ConnectDataPlane handed out: it carries the
// caller's identity (tenant, lease holder) from the authenticated gRPC call
// to the data plane. A store that does not know it answers UNAUTHENTICATED
// and changes nothing; the client connects again.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier::ucx {

constexpr uint16_t kCallAmId = 0x6b76;
constexpr uint16_t kReplyAmId = 0x6b77;
constexpr uint32_t kCallMagic = 0x3174766b;  // "kvt1"
constexpr size_t kSessionBytes = 16;

enum CallMethod : uint16_t {
  kCallBeginGet = 1,     // v1.BeginGetRequest -> v1.BeginGetResponse
  kCallReleaseGets = 2,  // v1.ReleaseGetsRequest -> v1.ReleaseGetsResponse
  kCallBeginPut = 3,     // v1.BeginPutRequest -> v1.BeginPutResponse
  // v1.CommitPutRequest -> v1.CommitPutResponse. On the socket data plane a
  // client sends it right behind the lease's puts on the same connection
  // (the store serves a connection's frames in order), so the commit rides
  // with the bytes instead of costing a round trip of its own.
  kCallCommitPut = 4,
};

struct CallHeader {
  uint32_t magic = kCallMagic;
  uint16_t method = 0;
  uint16_t reserved = 0;
  uint64_t call_id = 0;  // echoed in the reply
  uint8_t session[kSessionBytes] = {};
};

struct ReplyHeader {
  uint32_t magic = kCallMagic;
  int32_t code = 0;
  uint64_t call_id = 0;
};

static_assert(sizeof(CallHeader) == 32 && sizeof(ReplyHeader) == 16, "wire layout");

}  // namespace kvtier::ucx
