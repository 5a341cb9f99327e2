#include "common/rpc/tls.h"

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/tls_stream.h"

namespace kvtier {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", flag, ": cannot read \"", path, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", flag, ": \"", path, "\" is not a PEM file (no -----BEGIN line)"));
  }
  return pem;
}

// Flags that go together; the files are read (and checked) by the factories.
absl::Status CheckTlsFlags(const TlsFlags& tls) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "flags --tls-cert and --tls-key go together: give both or neither");
  }
  if (tls.require_client_cert) {
    if (tls.ca_file.empty()) {
      return absl::InvalidArgumentError(
          "flag --tls-require-client-cert needs --tls-ca (the CA client certificates are "
          "verified against)");
    }
    if (tls.cert_file.empty()) {
      return absl::InvalidArgumentError(
          "flag --tls-require-client-cert needs --tls-cert and --tls-key (the server's own "
          "certificate)");
    }
  }
  if (!tls.server_name.empty() && tls.ca_file.empty()) {
    return absl::InvalidArgumentError("flag --tls-server-name needs --tls-ca");
  }
  return absl::OkStatus();
}

}  // namespace

void AddTlsFlags(FlagSet& flags, TlsFlags* dst, bool serves, bool dials) {
  flags.String("tls-cert", &dst->cert_file,
               serves ? "PEM certificate chain to serve gRPC over TLS with (and to present as a "
                        "client); empty: plaintext"
                      : "PEM client certificate to present (mutual TLS)");
  flags.String("tls-key", &dst->key_file, "PEM private key of --tls-cert");
  flags.String("tls-ca", &dst->ca_file,
               serves ? "PEM CA bundle: peers' certificates are verified against it (outgoing "
                        "connections use TLS when it is set)"
                      : "PEM CA bundle to verify servers against; set: connect over TLS");
  if (serves) {
    flags.Bool("tls-require-client-cert", &dst->require_client_cert,
               "Mutual TLS: refuse clients without a certificate signed by --tls-ca");
  }
  if (dials) {
    flags.String("tls-server-name", &dst->server_name,
                 "Name to verify in servers' certificates instead of the dialled host");
  }
}

absl::StatusOr<ChannelSecurity> ClientSecurity(const TlsFlags& tls) {
  if (auto s = CheckTlsFlags(tls); !s.ok()) return s;
  ChannelSecurity out;
  if (tls.ca_file.empty()) return out;
  grpc::SslCredentialsOptions o;
  auto ca = ReadPem("tls-ca", tls.ca_file);
  if (!ca.ok()) return ca.status();
  o.pem_root_certs = *ca;
  if (!tls.cert_file.empty()) {
    auto cert = ReadPem("tls-cert", tls.cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadPem("tls-key", tls.key_file);
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  out.credentials = grpc::SslCredentials(o);
  out.server_name = tls.server_name;
  // The same trust for a store's socket data plane under --data-tls.
  auto data = net::TlsContext::Client(tls.ca_file, tls.cert_file, tls.key_file);
  if (!data.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --tls-ca/--tls-cert: ", data.status().message()));
  }
  out.data_plane = std::move(*data);
  return out;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFlags& tls) {
  if (auto s = CheckTlsFlags(tls); !s.ok()) return s;
  if (tls.cert_file.empty()) return grpc::InsecureServerCredentials();
  auto cert = ReadPem("tls-cert", tls.cert_file);
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("tls-key", tls.key_file);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions o(
      tls.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
      : tls.ca_file.empty()   ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!tls.ca_file.empty()) {
    auto ca = ReadPem("tls-ca", tls.ca_file);
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
  }
  o.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(o);
}

void PrepareGrpcProcess() {
  static std::once_flag once;
  std::call_once(once, [] { setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", 0); });
}

std::shared_ptr<grpc::Channel> OpenChannel(const std::string& address,
                                           const ChannelSecurity& security,
                                           grpc::ChannelArguments args) {
  PrepareGrpcProcess();
  if (!security.tls()) {
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  if (!security.server_name.empty()) args.SetSslTargetNameOverride(security.server_name);
  return grpc::CreateCustomChannel(address, security.credentials, args);
}

std::vector<std::string> PeerCertificateNames(const grpc::ServerContext& ctx) {
  std::vector<std::string> names;
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return names;
  for (const char* prop : {"x509_common_name", "x509_subject_alternative_name"}) {
    for (const auto& v : auth->FindPropertyValues(prop)) names.emplace_back(v.data(), v.size());
  }
  return names;
}

}  // namespace kvtier
