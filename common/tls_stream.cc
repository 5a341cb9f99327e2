// TlsContext and TlsStream (tls_stream.h, which states their contracts).
#include "common/tls_stream.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::net {

namespace {

// Bytes read from the socket at once (while a connection moves bytes; an
// idle one releases the buffer): several records per system call.
constexpr size_t kReadAheadBytes = 128 << 10;

// What OpenSSL's error queue says, oldest first (and clears it).
std::string QueueText() {
  std::string out;
  for (unsigned long e; (e = ERR_get_error()) != 0;) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "no detail from OpenSSL" : out;
}

SSL_CTX* NewContext(bool server) {
  SSL_CTX* ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) return nullptr;
  SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
  // AES-128-GCM first: the kernel's TLS offloads it everywhere it has kTLS.
  SSL_CTX_set_ciphersuites(ctx,
                           "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                           "TLS_CHACHA20_POLY1305_SHA256");
  uint64_t options = SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION;
#ifdef SSL_OP_ENABLE_KTLS
  options |= SSL_OP_ENABLE_KTLS;
#endif
  SSL_CTX_set_options(ctx, options);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER |
                            SSL_MODE_RELEASE_BUFFERS);
  // A record's header and body in one read, and the records after it as
  // far as the buffer goes (readers ask for more while it holds bytes:
  // TlsStream::Pending).
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, kReadAheadBytes);
  return ctx;
}

}  // namespace

absl::StatusOr<std::shared_ptr<TlsContext>> TlsContext::Server(const std::string& cert_file,
                                                               const std::string& key_file) {
  ERR_clear_error();
  SSL_CTX* ctx = NewContext(true);
  if (ctx == nullptr) return absl::InternalError("TLS: " + QueueText());
  std::shared_ptr<TlsContext> out(new TlsContext(ctx, true));
  if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS certificate \"", cert_file, "\": ", QueueText()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("TLS key \"", key_file, "\": ", QueueText()));
  }
  // No resumption: a data-plane connection lives long, and tickets would be
  // records a kernel-TLS receiver has to hand back to OpenSSL.
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  return out;
}

absl::StatusOr<std::shared_ptr<TlsContext>> TlsContext::Client(const std::string& ca_file,
                                                               const std::string& cert_file,
                                                               const std::string& key_file) {
  ERR_clear_error();
  SSL_CTX* ctx = NewContext(false);
  if (ctx == nullptr) return absl::InternalError("TLS: " + QueueText());
  std::shared_ptr<TlsContext> out(new TlsContext(ctx, false));
  if (SSL_CTX_load_verify_locations(ctx, ca_file.c_str(), nullptr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS CA bundle \"", ca_file, "\": ", QueueText()));
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (!cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS certificate \"", cert_file, "\": ", QueueText()));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("TLS key \"", key_file, "\": ", QueueText()));
    }
  }
  return out;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

std::unique_ptr<TlsStream> TlsStream::Accept(const TlsContext& ctx, int fd) {
  SSL* ssl = SSL_new(ctx.get());
  if (ssl == nullptr) return nullptr;
  SSL_set_fd(ssl, fd);
  SSL_set_accept_state(ssl);
  return std::unique_ptr<TlsStream>(new TlsStream(ssl));
}

std::unique_ptr<TlsStream> TlsStream::Connect(const TlsContext& ctx, int fd,
                                              const std::string& name) {
  // An IPv6 address as a URL host: [::1].
  const std::string verify_name = name.size() > 2 && name.front() == '[' && name.back() == ']'
                                      ? name.substr(1, name.size() - 2)
                                      : name;
  SSL* ssl = SSL_new(ctx.get());
  if (ssl == nullptr) return nullptr;
  std::unique_ptr<TlsStream> s(new TlsStream(ssl));
  SSL_set_fd(ssl, fd);
  SSL_set_connect_state(ssl);
  unsigned char addr[16];
  const bool ip = inet_pton(AF_INET, verify_name.c_str(), addr) == 1 ||
                  inet_pton(AF_INET6, verify_name.c_str(), addr) == 1;
  if (ip) {
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), verify_name.c_str());
  } else {
    SSL_set1_host(ssl, verify_name.c_str());
    SSL_set_tlsext_host_name(ssl, verify_name.c_str());
  }
  return s;
}

TlsStream::~TlsStream() { SSL_free(ssl_); }

TlsStream::Step TlsStream::Handshake() {
  ERR_clear_error();
  errno = 0;
  const int r = SSL_do_handshake(ssl_);
  if (r == 1) return Step::kDone;
  switch (SSL_get_error(ssl_, r)) {
    case SSL_ERROR_WANT_READ:
      return Step::kWantRead;
    case SSL_ERROR_WANT_WRITE:
      return Step::kWantWrite;
    case SSL_ERROR_SYSCALL:
      error_ = absl::StrCat("the peer went during the TLS handshake",
                            errno != 0 ? absl::StrCat(" (", std::strerror(errno), ")") : "");
      ERR_clear_error();
      return Step::kFailed;
    default: {
      error_ = absl::StrCat("TLS handshake failed: ", QueueText());
      const long v = SSL_get_verify_result(ssl_);
      if (v != X509_V_OK) {
        absl::StrAppend(&error_, " (certificate: ", X509_verify_cert_error_string(v), ")");
      }
      return Step::kFailed;
    }
  }
}

absl::Status TlsStream::HandshakeBy(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const Step s = Handshake();
    if (s == Step::kDone) return absl::OkStatus();
    if (s == Step::kFailed) return absl::UnavailableError(error_);
    pollfd p{SSL_get_fd(ssl_), static_cast<short>(s == Step::kWantRead ? POLLIN : POLLOUT), 0};
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError("the TLS handshake did not end in time");
    }
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30))) < 0 &&
        errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
    }
  }
}

ssize_t TlsStream::Fail(int r) {
  const int saved = errno;
  switch (SSL_get_error(ssl_, r)) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
      errno = EAGAIN;
      return -1;
    case SSL_ERROR_ZERO_RETURN:
      return 0;
    case SSL_ERROR_SYSCALL:
      ERR_clear_error();
      if (saved == 0) return 0;  // the peer closed without a close alert
      error_ = std::strerror(saved);
      errno = saved;
      return -1;
    default:
      error_ = QueueText();
      errno = EPROTO;
      return -1;
  }
}

ssize_t TlsStream::Recv(void* to, size_t n) {
  ERR_clear_error();
  errno = 0;
  size_t got = 0;
  if (SSL_read_ex(ssl_, to, n, &got) == 1) return static_cast<ssize_t>(got);
  return Fail(0);
}

ssize_t TlsStream::Send(const iovec* iov, size_t k) {
  size_t total = 0;
  size_t i = 0, at = 0;  // the next byte: iov[i], `at` into it
  while (i < k) {
    if (at == iov[i].iov_len) {
      ++i;
      at = 0;
      continue;
    }
    // One record per call: a call that blocks holds exactly one record
    // back, and its retry (exactly its bytes) ends with all of them
    // counted. A short piece (a frame, a reply's header) goes into one
    // record with what follows it instead of a record, and a system call,
    // of its own.
    const char* from = static_cast<const char*>(iov[i].iov_base) + at;
    size_t n = std::min(iov[i].iov_len - at, kRecordBytes);
    const bool stage = blocked_ > 0 ? blocked_staged_ : n < kRecordBytes;
    if (blocked_ > 0) n = blocked_;
    if (stage) {
      if (!stage_) stage_ = std::make_unique<char[]>(kRecordBytes);
      const size_t want = blocked_ > 0 ? blocked_ : kRecordBytes;
      size_t got = 0;
      for (size_t j = i, off = at; j < k && got < want; ++j, off = 0) {
        const size_t take = std::min(iov[j].iov_len - off, want - got);
        std::memcpy(stage_.get() + got, static_cast<const char*>(iov[j].iov_base) + off, take);
        got += take;
      }
      from = stage_.get();
      n = got;
    }
    ERR_clear_error();
    errno = 0;
    size_t wrote = 0;
    if (SSL_write_ex(ssl_, from, n, &wrote) != 1) {
      const ssize_t r = Fail(0);
      if (r < 0 && errno == EAGAIN) {
        blocked_ = n;
        blocked_staged_ = stage;
        if (total > 0) return static_cast<ssize_t>(total);
        errno = EAGAIN;
        return -1;
      }
      if (r == 0) {
        errno = EPIPE;  // a close alert while sending: the peer is gone
        return -1;
      }
      return r;
    }
    blocked_ = 0;
    total += wrote;
    for (size_t left = wrote; left > 0;) {  // past what was written
      const size_t take = std::min(left, iov[i].iov_len - at);
      at += take;
      left -= take;
      if (at == iov[i].iov_len && i + 1 < k) {
        ++i;
        at = 0;
      }
    }
  }
  stage_.reset();  // nothing of it is held back
  return static_cast<ssize_t>(total);
}

ssize_t TlsStream::Peek() {
  ERR_clear_error();
  errno = 0;
  char byte;
  size_t got = 0;
  if (SSL_peek_ex(ssl_, &byte, 1, &got) == 1) return 1;
  return Fail(0);
}

bool TlsStream::Pending() const { return SSL_pending(ssl_) > 0; }

void TlsStream::Shutdown() {
  ERR_clear_error();
  SSL_shutdown(ssl_);
  ERR_clear_error();
}

bool TlsStream::KernelSend() const {
#ifdef BIO_CTRL_GET_KTLS_SEND
  return BIO_ctrl(SSL_get_wbio(ssl_), BIO_CTRL_GET_KTLS_SEND, 0, nullptr) > 0;
#else
  return false;
#endif
}

}  // namespace kvtier::net
