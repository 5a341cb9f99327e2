// TLS for the socket data plane (common/data_wire.h), through OpenSSL, over
// non-blocking sockets: the store's event loops and its clients' channels
// read and write through a TlsStream as they would through recv/sendmsg.
//
// TLS 1.3 only. Kernel TLS (kTLS) is asked for on every connection: where
// the kernel has its `tls` module, OpenSSL hands the record layer to the
// kernel after the handshake (TlsStream::KernelSend says so);
// elsewhere OpenSSL encrypts in user space. Either way the bytes on the wire
// are the same. A connection holds its record buffers only while it moves
// bytes (SSL_MODE_RELEASE_BUFFERS): an idle one keeps OpenSSL's connection
// state alone.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace kvtier::net {

// An OpenSSL context: a server's (its certificate and key) or a client's
// (the CA bundle servers are verified against, and optionally a
// certificate it presents). Thread-safe, shared by every stream made from it.
class TlsContext {
 public:
  // Errors (INVALID_ARGUMENT) name the file OpenSSL refused and why.
  static absl::StatusOr<std::shared_ptr<TlsContext>> Server(const std::string& cert_file,
                                                            const std::string& key_file);
  static absl::StatusOr<std::shared_ptr<TlsContext>> Client(const std::string& ca_file,
                                                            const std::string& cert_file = "",
                                                            const std::string& key_file = "");
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  bool server() const { return server_; }
  SSL_CTX* get() const { return ctx_; }

 private:
  TlsContext(SSL_CTX* ctx, bool server) : ctx_(ctx), server_(server) {}
  SSL_CTX* ctx_;
  bool server_;
};

// One connection's TLS on a non-blocking socket the caller owns (and
// closes after this is gone). Not thread-safe.
//
// Recv, Send and Peek behave as recv/sendmsg on a non-blocking socket:
// > 0 bytes moved; 0 the peer closed (Recv, Peek); -1 with errno EAGAIN when
// the socket must become readable or writable first, or another errno when
// the connection failed (error() then says why). A Send that returned -1
// with EAGAIN, or fewer bytes than given, must be called again from the
// first byte it did not count, with the same bytes after it (more may
// follow them): a record of them may be half sent. Send writes one record
// per OpenSSL call and tries a blocked one again with exactly its bytes,
// so every byte that reached the peer has been counted by the call that
// sent it (a peer cannot answer a request its sender has not counted).
class TlsStream {
 public:
  // The server side of an accepted socket.
  static std::unique_ptr<TlsStream> Accept(const TlsContext& ctx, int fd);
  // The client side of a connected socket; the server's certificate must
  // name `name` (an IP address, bracketed or not, or a DNS name).
  static std::unique_ptr<TlsStream> Connect(const TlsContext& ctx, int fd, const std::string& name);
  ~TlsStream();
  TlsStream(const TlsStream&) = delete;
  TlsStream& operator=(const TlsStream&) = delete;

  enum class Step { kDone, kWantRead, kWantWrite, kFailed };
  // Advances the handshake: kDone once it is complete (error() says why it
  // failed).
  Step Handshake();
  // The handshake to its end, polling the socket until `deadline`:
  // UNAVAILABLE for a peer that failed it (a certificate that does not
  // verify, not TLS), DEADLINE_EXCEEDED past the deadline.
  absl::Status HandshakeBy(std::chrono::steady_clock::time_point deadline);

  ssize_t Recv(void* to, size_t n);
  // Writes iov[0..k) in order until one would block; the bytes written.
  ssize_t Send(const iovec* iov, size_t k);
  // Whether a byte can be read without reading the socket: 1 yes, 0 the
  // peer closed, -1 (errno EAGAIN) not yet.
  ssize_t Peek();
  // Whether decrypted bytes wait here, which a poll of the socket would
  // not show. (A part of a record read ahead is not: its rest comes by the
  // socket. A whole record read ahead stays only behind bytes a reader
  // did not ask for, since Recv goes on to it before it says EAGAIN.)
  bool Pending() const;
  // Sends the close alert if the socket takes it now (no wait).
  void Shutdown();

  // Whether the kernel encrypts (kTLS) what is sent on this connection.
  bool KernelSend() const;
  const std::string& error() const { return error_; }

 private:
  explicit TlsStream(SSL* ssl) : ssl_(ssl) {}
  // The result of an SSL call that returned `r` <= 0, as recv's.
  ssize_t Fail(int r);

  // The most plaintext one TLS record carries.
  static constexpr size_t kRecordBytes = 16384;

  SSL* ssl_;
  std::string error_;
  // Short pieces gathered into one record (Send). Kept, and not moved,
  // while a write of it is blocked: with kernel TLS, OpenSSL 3.0 sends a
  // blocked record's rest from the first call's buffer.
  std::unique_ptr<char[]> stage_;
  size_t blocked_ = 0;           // bytes of the write that blocked (0: none)
  bool blocked_staged_ = false;  // whether it was of stage_
};

}  // namespace kvtier::net
