#include "cachestore/tenants.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/config.h"

namespace kvtier::store {

namespace {

constexpr absl::string_view kSaltPrefix = "tenant:";
constexpr size_t kSaltHexDigits = 32;

bool ValidName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return false;
    }
  }
  return true;
}

bool IsHex(std::string_view s) {
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

std::vector<std::string> List(absl::string_view value) {
  std::vector<std::string> out;
  for (absl::string_view v : absl::StrSplit(value, ',', absl::SkipEmpty())) out.emplace_back(v);
  return out;
}

}  // namespace

std::string Sha256Hex(std::string_view data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * sizeof(digest));
  for (unsigned char b : digest) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

absl::Status Tenant::AllowsModel(const std::string& model) const {
  if (models.empty()) return absl::OkStatus();
  for (const auto& p : models) {
    if (NameMatches(p, model)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("tenant ", name, " may not register model \"", model,
                   "\" (its models: ", absl::StrJoin(models, ", "), ")"));
}

NamespaceSpec Tenant::Salted(const NamespaceSpec& spec) const {
  NamespaceSpec s = spec;
  s.cache_salt = absl::StrCat(kSaltPrefix, name, ":", salt, "|", spec.cache_salt);
  return s;
}

absl::StatusOr<std::shared_ptr<const Tenants>> Tenants::Parse(std::string_view text) {
  auto t = std::make_shared<Tenants>();
  std::string secret;
  std::set<std::string> identities, tokens;
  for (const WordsLine& l : WordsLines(std::string(text))) {
    const int line_no = l.number;
    const std::vector<std::string>& f = l.words;
    auto bad = [&](const auto&... what) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": ", what...));
    };
    if (f[0] == "secret") {
      if (f.size() != 2) return bad("expected secret VALUE (no spaces, no #)");
      if (!secret.empty()) return bad("a second secret line");
      if (!t->tenants_.empty()) return bad("secret must come before the first tenant");
      secret = f[1];
      continue;
    }
    if (f[0] != "tenant" || f.size() < 2) {
      return bad("expected \"tenant NAME ram=SIZE ...\" or \"secret VALUE\", got \"", l.text, "\"");
    }
    Tenant tn;
    tn.name = f[1];
    if (!ValidName(tn.name)) {
      return bad("tenant name \"", tn.name, "\" must be 1..64 of [A-Za-z0-9._-]");
    }
    for (const auto& other : t->tenants_) {
      if (other.name == tn.name) return bad("tenant ", tn.name, " is listed twice");
    }
    tn.index = static_cast<int>(t->tenants_.size());
    bool has_ram = false;
    std::set<std::string> keys;
    for (size_t i = 2; i < f.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv =
          absl::StrSplit(f[i], absl::MaxSplits('=', 1));
      const std::string key(kv.first), value(kv.second);
      if (value.empty()) return bad("\"", f[i], "\" is not KEY=VALUE");
      if (!keys.insert(key).second) return bad(key, "= is given twice for tenant ", tn.name);
      if (key == "ram" || key == "nvme" || key == "buffered") {
        auto b = ParseBytes(value);
        if (!b.ok()) return bad(key, ": ", b.status().message());
        if (key == "buffered" && *b == 0) return bad("buffered=", value, " is not a size >= 1");
        (key == "ram" ? tn.ram_bytes : key == "nvme" ? tn.nvme_bytes : tn.max_buffered) = *b;
        has_ram |= key == "ram";
      } else if (key == "leases" || key == "namespaces" || key == "connections" ||
                 key == "sessions") {
        uint64_t n = 0;
        if (!absl::SimpleAtoi(value, &n) || n == 0)
          return bad(key, "=", value, " is not a count >= 1");
        (key == "leases"        ? tn.max_leases
         : key == "namespaces"  ? tn.max_namespaces
         : key == "connections" ? tn.max_connections
                                : tn.max_sessions) = n;
      } else if (key == "identities") {
        tn.identities = List(value);
        for (const auto& id : tn.identities) {
          if (!identities.insert(id).second) return bad("identity ", id, " belongs to two tenants");
        }
      } else if (key == "token-sha256") {
        tn.token_sha256 = List(value);
        for (auto& h : tn.token_sha256) {
          h = absl::AsciiStrToLower(h);
          if (h.size() != 64 || !IsHex(h)) {
            return bad("token-sha256 \"", h, "\" is not 64 hex digits (sha256sum of the token)");
          }
          if (!tokens.insert(h).second) return bad("a token belongs to two tenants");
        }
      } else if (key == "models") {
        tn.models = List(value);
      } else {
        return bad("unknown key \"", key,
                   "\" (known: ram, nvme, leases, namespaces, connections, sessions, buffered, "
                   "identities, "
                   "token-sha256, models)");
      }
    }
    if (!has_ram || tn.ram_bytes == 0) {
      return bad("tenant ", tn.name, " needs ram=SIZE (its region of the RAM arena)");
    }
    if (tn.identities.empty() && tn.token_sha256.empty()) {
      return bad("tenant ", tn.name,
                 " has no identities= and no token-sha256=: nobody could act as it");
    }
    if (tn.ram_bytes > (uint64_t{1} << 50) || tn.nvme_bytes > (uint64_t{1} << 50)) {
      return bad("tenant ", tn.name, ": ram= and nvme= at most 1 PiB each");
    }
    tn.salt =
        Sha256Hex(absl::StrCat("kvtier-tenant|", secret, "|", tn.name)).substr(0, kSaltHexDigits);
    t->tenants_.push_back(std::move(tn));
  }
  if (t->tenants_.empty()) return absl::InvalidArgumentError("no tenant is defined");
  if (secret.empty()) {
    return absl::InvalidArgumentError(
        "no \"secret SECRET\" line: it keys the tenants' salts, which must not be guessable "
        "(a long random string, e.g. from openssl rand -hex 32; keep the file secret)");
  }
  return std::shared_ptr<const Tenants>(std::move(t));
}

absl::StatusOr<std::shared_ptr<const Tenants>> Tenants::Load(const std::string& path) {
  auto text = ReadTextFile(path);
  if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
  auto t = Parse(*text);
  if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", t.status().message()));
  return t;
}

const Tenant* Tenants::ByIdentity(const std::vector<std::string>& names) const {
  for (const auto& name : names) {
    for (const auto& t : tenants_) {
      for (const auto& id : t.identities) {
        if (id == name) return &t;
      }
    }
  }
  return nullptr;
}

const Tenant* Tenants::ByToken(std::string_view token) const {
  if (token.empty()) return nullptr;
  const std::string h = Sha256Hex(token);
  const Tenant* found = nullptr;
  // Every candidate is compared in full, in constant time per comparison.
  for (const auto& t : tenants_) {
    for (const auto& want : t.token_sha256) {
      if (CRYPTO_memcmp(want.data(), h.data(), h.size()) == 0) found = &t;
    }
  }
  return found;
}

const Tenant* Tenants::Unsalt(const NamespaceSpec& stored, NamespaceSpec* client) const {
  std::string_view s = stored.cache_salt;
  if (s.substr(0, kSaltPrefix.size()) != std::string_view(kSaltPrefix.data(), kSaltPrefix.size())) {
    return nullptr;
  }
  s.remove_prefix(kSaltPrefix.size());
  size_t colon = s.find(':');
  if (colon == std::string_view::npos) return nullptr;
  std::string_view name = s.substr(0, colon);
  s.remove_prefix(colon + 1);
  if (s.size() < kSaltHexDigits + 1 || s[kSaltHexDigits] != '|') return nullptr;
  std::string_view salt = s.substr(0, kSaltHexDigits);
  for (const auto& t : tenants_) {
    if (t.name == name && t.salt == salt) {
      *client = stored;
      client->cache_salt = std::string(s.substr(kSaltHexDigits + 1));
      return &t;
    }
  }
  return nullptr;
}

uint64_t Tenants::ram_bytes() const {
  uint64_t sum = 0;
  for (const auto& t : tenants_) sum += t.ram_bytes;
  return sum;
}

}  // namespace kvtier::store
