// The store's socket data plane (the default data plane; docs/dataplane.md,
// docs/security.md): the frames a client and a kvtier-store exchange over one
// TCP connection. The store drives every byte: it checks each transfer
// against a lease the caller's session holds before it reads from or writes
// into its arena, so a client names blocks by the addresses BeginGet and
// BeginPut handed out and can reach nothing else.
//
// A connection carries, in order:
//   store:  Reply{kChallengeMagic, data_bytes = kNonceBytes} + a fresh nonce;
//   client: Frame{kHello, length = kHelloBytes} + the session's id and its
//           proof for the nonce (common/data_hello.h: an HMAC with the key
//           ConnectDataPlane handed out with the id; the key itself never
//           crosses the data plane);
//   store:  Reply (code 0, or UNAUTHENTICATED for a session it does not
//           know or a proof that does not hold, then it closes: only callers
//           ConnectDataPlane authenticated hold connections).
// then any number of requests, each answered by one Reply, in order:
//   kCall  method, length = request bytes, then the request (a kvtier.v1
//          message; common/ucx/calls.h's methods). Reply: message = the
//          response message (code 0) or the error's text.
//   kGet   lease, addr, length. Reply: code 0 and data_bytes = length, then
//          the bytes; or an error code and its text, no bytes.
//   kPut   lease, addr, length, then `length` bytes. Reply once the bytes are
//          in the slot (code 0), or an error code and its text (the bytes
//          were read and dropped: nothing was written).
// Codes are google.rpc codes. A frame the store cannot parse (bad magic,
// unknown op, a length past the limits) is answered INVALID_ARGUMENT, and
// the connection closed. Both sides are little-endian hosts; the magic tells
// a peer of another layout or version apart.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier::wire {

constexpr uint32_t kFrameMagic = 0x3164766b;      // "kvd1"
constexpr uint32_t kReplyMagic = 0x3172766b;      // "kvr1"
constexpr uint32_t kChallengeMagic = 0x3163766b;  // "kvc1": the store's first message

enum Op : uint16_t {
  kHello = 1,
  kCall = 2,
  kGet = 3,
  kPut = 4,
};

// The most bytes one call request or reply message may have (a call names
// at most 8,192 blocks: a few hundred KiB), and one transfer (a block or a
// segment of one). The store holds one message per connection at a time.
constexpr uint64_t kMaxMessageBytes = 4ull << 20;
constexpr uint64_t kMaxTransferBytes = 1ull << 30;

struct Frame {
  uint32_t magic = kFrameMagic;
  uint16_t op = 0;
  uint16_t method = 0;  // kCall
  uint64_t lease = 0;   // kGet, kPut
  uint64_t addr = 0;    // kGet, kPut: as BeginGet / BeginPut gave it
  uint64_t length = 0;  // bytes that follow (kHello, kCall, kPut) or asked for (kGet)
};

struct Reply {
  uint32_t magic = kReplyMagic;
  int32_t code = 0;
  uint32_t message_bytes = 0;  // follow first: a call's response, or an error's text
  uint32_t reserved = 0;
  uint64_t data_bytes = 0;  // follow the message: a get's bytes
};

static_assert(sizeof(Frame) == 32 && sizeof(Reply) == 24, "wire layout");

}  // namespace kvtier::wire
