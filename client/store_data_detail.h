// What StoreDataClient's files share (store_data_client.cc, store_data_put.cc,
// store_data_read.cc): an operation's deadline, control calls, mapped reads
// and error prefixes. Internal to client/store_data_*.cc.
#pragma once

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/arena_mapping.h"
#include "client/store_data_client.h"
#include "common/rpc/grpc_status.h"
#include "common/ucx/ucx.h"

namespace kvtier {

struct StoreDataClient::Deadline {
  std::chrono::steady_clock::time_point transfers;  // UCX waits
  std::chrono::system_clock::time_point rpcs;       // gRPC contexts
};

namespace store_data_detail {

// One control RPC that ends by the operation's deadline.
template <typename Request, typename Response>
absl::Status Call(StoreClient& control,
                  grpc::Status (v1::Store::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                       Response*),
                  const Request& request, Response* response,
                  std::chrono::system_clock::time_point deadline) {
  auto ctx = control.Context(deadline);
  return FromGrpc((control.stub().*rpc)(ctx.get(), request, response));
}

// Reads through a mapped arena, shaped like a lane's DataPlaneConnection for
// ReadVia: a "post" is the copy itself, a wait only reports copies that fell
// outside the arena.
struct MappedReads {
  const ArenaMapping& arena;
  void* PostGet(void* dest, size_t length, uint64_t remote_addr, uint64_t /*lease*/) {
    const uint8_t* from = arena.At(remote_addr, length);
    if (from == nullptr) return UCS_STATUS_PTR(UCS_ERR_INVALID_ADDR);
    std::memcpy(dest, from, length);
    return nullptr;
  }
  absl::Status Wait(std::vector<void*>& requests, ucx::Clock::time_point) {
    absl::Status s = absl::OkStatus();
    for (void*& r : requests) {
      if (r != nullptr && s.ok()) {
        s = absl::InternalError("the store answered an address outside its arena");
      }
      r = nullptr;
    }
    return s;
  }
  bool CopiesAtPost() const { return true; }
  absl::Status EnsureInstance(uint64_t instance, std::chrono::system_clock::time_point) {
    if (instance == arena.instance()) return absl::OkStatus();
    return absl::UnavailableError("the store restarted since the pin; pin the blocks again");
  }
};

}  // namespace store_data_detail

template <typename Request, typename Response>
absl::Status StoreDataClient::ControlCall(
    uint16_t method,
    grpc::Status (v1::Store::Stub::*rpc)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, Response* response, std::chrono::system_clock::time_point deadline) {
  auto answer = CallOnDataPlane(method, request, deadline);
  if (!answer) return store_data_detail::Call(control_, rpc, request, response, deadline);
  if (!answer->ok()) return answer->status();
  if (!response->ParseFromString(**answer)) {
    return absl::InternalError(absl::StrCat("store answered a data-plane call with no ",
                                            response->GetDescriptor()->name()));
  }
  return absl::OkStatus();
}

}  // namespace kvtier
