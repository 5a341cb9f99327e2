// Who may speak for which source on the router's event streams
// (docs/security.md, "Sources").
//
// A source names itself in its hello. Without mutual TLS nothing backs that
// name: any process that reaches the router can claim any id. With mutual
// TLS the router binds a hello to the client certificate that carried it:
//   * by default the certificate must name the source id it claims (its
//     common name or one of its subject alternative names);
//   * with --source-identities FILE, the file decides instead: each line
//     names a certificate identity, the kind of source it may be, and the
//     source ids it may claim (the identity itself when none is listed; a
//     trailing `*` matches a prefix, for a certificate a whole StatefulSet
//     shares). A certificate not in the file may not publish at all.
// Refusals are PERMISSION_DENIED, naming the claimed id and what the
// certificate names; they come before the hello reaches the index, so a
// forged hello changes nothing there.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/v1/router.pb.h"

namespace kvtier::router {

struct SourceIdentity {
  std::string identity;  // a certificate's common name or SAN
  v1::SourceKind kind = v1::SOURCE_KIND_UNSPECIFIED;
  std::vector<std::string> ids;  // source ids it may claim; "prefix*" matches a prefix
};

// Parses a --source-identities file: one `IDENTITY KIND [SOURCE-ID ...]` per
// line (KIND: worker or store), `#` starts a comment, blank lines are
// skipped. INVALID_ARGUMENT names the line and what is wrong with it.
absl::StatusOr<std::vector<SourceIdentity>> ParseSourceIdentities(std::string_view text);

class SourceAuth {
 public:
  // No authentication: every hello is taken at its word.
  SourceAuth() = default;
  // `mutual`: the server demands a CA-signed client certificate. A list of
  // identities needs it (without it no identity is authenticated): asking
  // for one without mutual TLS is INVALID_ARGUMENT.
  static absl::StatusOr<SourceAuth> Make(bool mutual, std::vector<SourceIdentity> identities);

  bool authenticates() const { return mutual_; }
  // OK, or PERMISSION_DENIED saying which id was claimed and what the
  // certificate (`cert_names`: its common name and SANs) names.
  absl::Status Check(const std::vector<std::string>& cert_names, const v1::Hello& hello) const;

 private:
  bool mutual_ = false;
  std::vector<SourceIdentity> identities_;
};

}  // namespace kvtier::router
