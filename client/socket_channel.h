// One lane's connection to a store's socket data plane (common/data_wire.h):
// transfers and control calls posted in order and answered in order. Posts
// only queue; Progress writes what is queued (a put's bytes straight from
// the caller's memory) and reads the answers (a get's bytes straight into
// the caller's memory) until an operation has completed. The store checks
// every transfer against the lease it names, so the addresses a client
// holds name slots, not memory.
//
// With a TLS context (a store serving --data-tls), the channel speaks TLS
// 1.3 from its first byte and verifies the store's certificate before it
// sends anything (common/tls_stream.h).
//
// Not thread-safe: a channel belongs to its lane's thread. Internal to
// kvtier_dataclient.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/data_wire.h"
#include "common/tls_stream.h"

namespace kvtier {

class SocketChannel {
 public:
  using Clock = std::chrono::steady_clock;

  // Connects to host:port and, answering the store's challenge, proves
  // `session` (ConnectDataPlane's: id and key; the key is never sent).
  // With `tls`, over TLS: the store's certificate must verify against it
  // and name `tls_name` (empty: `host`).
  // UNAVAILABLE if the store cannot be reached or its certificate does not
  // verify, the store's code (such as UNAUTHENTICATED) if it refuses the
  // session, DEADLINE_EXCEEDED past the deadline.
  static absl::StatusOr<std::unique_ptr<SocketChannel>> Connect(
      const std::string& host, int port, const std::string& session, Clock::time_point deadline,
      const net::TlsContext* tls = nullptr, const std::string& tls_name = "");
  ~SocketChannel();
  SocketChannel(const SocketChannel&) = delete;
  SocketChannel& operator=(const SocketChannel&) = delete;

  // Queue an operation; the returned number (> 0) names it to Wait. The
  // memory must stay until it completes (or the channel goes).
  uint64_t PostGet(void* dest, uint64_t length, uint64_t addr, uint64_t lease);
  uint64_t PostPut(const void* src, uint64_t length, uint64_t addr, uint64_t lease);
  // Completes once everything posted before it has.
  uint64_t PostMark();

  // Moves bytes until operation `seq` (and all before it) completed. Returns
  // the first error any completed operation met since the last call: the
  // store's status for a refused transfer, UNAVAILABLE when the connection
  // failed (then the channel is failed() for good), DEADLINE_EXCEEDED.
  absl::Status Wait(uint64_t seq, Clock::time_point deadline);

  // A control call (posted after everything queued, waited for): the
  // store's answer, or its status.
  absl::StatusOr<std::string> Call(uint16_t method, const std::string& request,
                                   Clock::time_point deadline);

  bool failed() const { return !failure_.ok(); }
  // With nothing in flight: whether the store has closed the connection
  // (it closes one idle past its --data-idle-timeout); then the channel is
  // failed(). A caller checks before reusing a pooled channel, so an idle
  // close costs a reconnect, not an operation.
  bool PeerClosed();

 private:
  struct Op {
    uint64_t seq;
    wire::Frame frame;
    uint8_t* dest = nullptr;       // get: where the bytes go
    const uint8_t* src = nullptr;  // put: the bytes; call: the request
    bool mark = false;
    uint64_t sent = 0;  // bytes of frame + payload written
  };
  explicit SocketChannel(int fd) : fd_(fd) {}
  uint64_t Post(Op op);
  // The socket's bytes, through TLS when the channel has it.
  ssize_t Recv(void* to, size_t n);
  ssize_t Send(const iovec* iov, size_t k);
  // Whether a byte waits (1), the peer closed (0), or neither yet (-1).
  ssize_t Peek();
  // Why the last Recv/Send failed.
  std::string IoError() const;
  // Whole reads and writes (the handshake's), polling until the deadline.
  absl::Status ReadFully(void* to, size_t n, Clock::time_point deadline);
  absl::Status WriteFully(iovec* iov, size_t k, Clock::time_point deadline);
  // One round of writing and reading; false after a failure.
  absl::Status Step(Clock::time_point deadline);
  absl::Status Fail(absl::Status s);
  absl::Status HandleReadable();

  int fd_;
  std::unique_ptr<net::TlsStream> tls_;  // null: plaintext
  uint64_t next_seq_ = 1;
  uint64_t done_seq_ = 0;     // every op up to this one has completed
  std::deque<Op> ops_;        // not yet completed, in order
  size_t unsent_ = 0;         // index in ops_ of the first not wholly written
  absl::Status failure_;      // the connection's, for good
  absl::Status first_error_;  // the first refused op since the last Wait
  // The answer being read: its header, then its message, then its data.
  wire::Reply reply_{};
  uint64_t reply_got_ = 0;  // bytes of header + message + data read so far
  std::string message_;
  // The last call answered: its number, status and answer.
  uint64_t call_seq_ = 0;
  absl::Status call_status_;
  std::string call_reply_;
};

}  // namespace kvtier
