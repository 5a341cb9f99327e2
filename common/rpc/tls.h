// TLS and mutual TLS for kvtier's gRPC channels.
//
// Every binary takes the same flags (AddTlsFlags): a certificate and key it
// serves with (and presents as a client), the CA that signs the cluster's
// certificates, and whether its server demands a client certificate (mTLS).
// With none of them given, channels are plaintext. A client's CA also
// verifies a store's socket data plane when the store serves it over TLS
// (--data-tls; common/tls_stream.h). The UCX data plane is not covered:
// RDMA and shared-memory transfers carry block bytes only, after the gRPC
// control plane (which is) has granted the slots.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

class FlagSet;
namespace net {
class TlsContext;
}

struct TlsFlags {
  std::string cert_file;             // PEM certificate chain this process presents
  std::string key_file;              // its private key
  std::string ca_file;               // PEM CA bundle peers are verified against
  bool require_client_cert = false;  // server: refuse clients without a CA-signed certificate
  std::string server_name;           // client: name to verify in servers' certificates
};

// --tls-cert, --tls-key, --tls-ca, --tls-require-client-cert (servers only)
// and --tls-server-name (processes that dial out).
void AddTlsFlags(FlagSet& flags, TlsFlags* dst, bool serves, bool dials);
// How a client reaches a server. Default: plaintext.
struct ChannelSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: plaintext
  std::string server_name;  // overrides the host name verified in the server's certificate
  // The same trust for a socket data plane served over TLS (null: plaintext).
  std::shared_ptr<net::TlsContext> data_plane;
  bool tls() const { return credentials != nullptr; }
};

// TLS when ca_file is set: the server is verified against it, and cert/key,
// when given, are presented (mTLS). Plaintext otherwise. Both factories
// first check that the flags go together (cert with key; mTLS needs a CA and
// a server certificate), then read the files; an error names the flag.
absl::StatusOr<ChannelSecurity> ClientSecurity(const TlsFlags& tls);
// TLS when cert_file and key_file are set; plaintext otherwise.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFlags& tls);

// Process-wide gRPC settings, set before gRPC initializes (it reads them
// once, from the environment; a value the user set is kept). Now one: a
// client channel that lost its server is looked at every 100 ms, not 5 s, so
// calls that fail fast while a store or router restarts (as every kvtier
// call does) find it again as soon as it listens, not up to 5 s later (gRPC's
// GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS). OpenChannel calls it; mains
// call it first, before a server of theirs starts gRPC. Idempotent.
void PrepareGrpcProcess();

// A channel to address with the given security and arguments.
std::shared_ptr<grpc::Channel> OpenChannel(const std::string& address,
                                           const ChannelSecurity& security,
                                           grpc::ChannelArguments args = {});

// The names (common name, then subject alternative names) of the verified
// client certificate of this call; empty over plaintext or without one.
std::vector<std::string> PeerCertificateNames(const grpc::ServerContext& ctx);

}  // namespace kvtier
