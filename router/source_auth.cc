#include "router/source_auth.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/config.h"

namespace kvtier::router {

namespace {

const char* KindName(v1::SourceKind k) {
  switch (k) {
    case v1::SOURCE_WORKER:
      return "worker";
    case v1::SOURCE_STORE:
      return "store";
    default:
      return "unspecified";
  }
}

std::string Quoted(const std::vector<std::string>& names) {
  if (names.empty()) return "nothing";
  return absl::StrCat("\"", absl::StrJoin(names, "\", \""), "\"");
}

}  // namespace

absl::StatusOr<std::vector<SourceIdentity>> ParseSourceIdentities(std::string_view text) {
  std::vector<SourceIdentity> out;
  for (const WordsLine& l : WordsLines(std::string(text))) {
    const int line_no = l.number;
    const std::vector<std::string>& f = l.words;
    if (f.size() < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_no, ": expected IDENTITY KIND [SOURCE-ID ...], got \"", l.text, "\""));
    }
    SourceIdentity si;
    si.identity = f[0];
    if (f[1] == "worker") {
      si.kind = v1::SOURCE_WORKER;
    } else if (f[1] == "store") {
      si.kind = v1::SOURCE_STORE;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, ": kind \"", f[1], "\" (expected worker or store)"));
    }
    for (size_t i = 2; i < f.size(); ++i) {
      if (f[i] == "*") {
        return absl::InvalidArgumentError(
            absl::StrCat("line ", line_no, ": \"*\" alone would let ", si.identity,
                         " claim every source id; give a prefix (e.g. kvtier-store-*)"));
      }
      si.ids.emplace_back(f[i]);
    }
    if (si.ids.empty()) si.ids.push_back(si.identity);
    for (const auto& other : out) {
      if (other.identity == si.identity) {
        return absl::InvalidArgumentError(
            absl::StrCat("line ", line_no, ": identity ", si.identity, " is listed twice"));
      }
    }
    out.push_back(std::move(si));
  }
  return out;
}

absl::StatusOr<SourceAuth> SourceAuth::Make(bool mutual, std::vector<SourceIdentity> identities) {
  if (!identities.empty() && !mutual) {
    return absl::InvalidArgumentError(
        "--source-identities needs mutual TLS (--tls-require-client-cert): without client "
        "certificates no source's identity is authenticated");
  }
  SourceAuth a;
  a.mutual_ = mutual;
  a.identities_ = std::move(identities);
  return a;
}

absl::Status SourceAuth::Check(const std::vector<std::string>& cert_names,
                               const v1::Hello& hello) const {
  if (!mutual_) return absl::OkStatus();
  const std::string& id = hello.source_id();
  if (identities_.empty()) {
    if (std::find(cert_names.begin(), cert_names.end(), id) != cert_names.end()) {
      return absl::OkStatus();
    }
    return absl::PermissionDeniedError(absl::StrCat(
        "hello names source \"", id, "\" but the client's certificate names ", Quoted(cert_names),
        ": a source must present a certificate naming its id (or be allowed by "
        "--source-identities)"));
  }
  std::vector<std::string> listed;
  for (const auto& si : identities_) {
    if (std::find(cert_names.begin(), cert_names.end(), si.identity) == cert_names.end()) continue;
    listed.push_back(si.identity);
    if (si.kind != hello.kind()) continue;
    for (const auto& pattern : si.ids) {
      if (NameMatches(pattern, id)) return absl::OkStatus();
    }
  }
  if (listed.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("hello names source \"", id, "\" but the client's certificate names ",
                     Quoted(cert_names), ", none of which --source-identities lists"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "hello names ", KindName(hello.kind()), " \"", id, "\" but --source-identities lets ",
      Quoted(listed), " (the client's certificate) claim no such ", KindName(hello.kind())));
}

}  // namespace kvtier::router
