// What every kvctl command shares: splitting the command line at the
// command, the shared flags and the clients built from them, the prompt flags
// of lookup and route, and output helpers.
#include "cli/cli.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/rpc/grpc_status.h"

namespace kvtier::cli {
namespace {

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// The flags SharedFlags::Register may add (AddTlsFlags adds the tls-* ones),
// plus --config, which FlagSet takes everywhere. Keep in step with Register:
// a flag missing here is refused before the command.
struct EarlyFlag {
  std::string_view name;
  bool takes_value;
};
constexpr EarlyFlag kEarlyFlags[] = {
    {"store", true},   {"router", true},           {"json", false},
    {"timeout", true}, {"admin-token-file", true}, {"tls-cert", true},
    {"tls-key", true}, {"tls-ca", true},           {"tls-server-name", true},
    {"config", true},
};

const EarlyFlag* FindEarlyFlag(std::string_view name) {
  for (const EarlyFlag& f : kEarlyFlags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// Reads a token file: integers separated by spaces, commas or newlines.
absl::StatusOr<std::vector<uint32_t>> ReadTokens(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file \"", path, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<uint32_t> out;
  for (absl::string_view t :
       absl::StrSplit(ss.str(), absl::ByAnyChar(" ,\n\t\r"), absl::SkipEmpty())) {
    uint32_t v;
    if (!absl::SimpleAtoi(t, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file \"", path, "\": \"", t, "\" is not a token id"));
    }
    out.push_back(v);
  }
  return out;
}

// Reads a hash file: one 32-hex-digit hash per line.
absl::StatusOr<std::vector<BlockHash>> ReadHashes(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read hash file \"", path, "\""));
  std::vector<BlockHash> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto h = BlockHashFromHex(line);
    if (!h.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("hash file \"", path, "\": ", h.status().message()));
    out.push_back(*h);
  }
  return out;
}

}  // namespace

absl::StatusOr<CommandLine> SplitCommandLine(int argc, const char* const* argv) {
  CommandLine line;
  int i = 1;
  for (; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      // As before flags were taken here: kvctl's help, whatever follows.
      line.help = true;
      return line;
    }
    if (a == "--version") {
      line.version = true;
      return line;
    }
    // "--" and "-x" are not flags here: as the command they are refused as unknown.
    if (a.size() <= 2 || !a.starts_with("--")) break;
    std::string_view name = a.substr(2);
    size_t eq = name.find('=');
    bool has_value = eq != std::string_view::npos;
    if (has_value) name = name.substr(0, eq);
    const EarlyFlag* f = FindEarlyFlag(name);
    if (!f && !has_value && name.starts_with("no-")) {
      // --no-json: FlagSet's negation of a bool flag.
      f = FindEarlyFlag(name.substr(3));
      if (f && f->takes_value) f = nullptr;
    }
    if (!f) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", std::string(name),
                       " goes after the command (only --store, --router, --json, --timeout, "
                       "--admin-token-file, --tls-* and --config may come before it)"));
    }
    line.early_flags.emplace_back(a);
    if (f->takes_value && !has_value) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(
            absl::StrCat("flag --", std::string(name), " needs a value"));
      }
      line.early_flags.emplace_back(argv[++i]);
    }
  }
  for (; i < argc; ++i) line.words.emplace_back(argv[i]);
  return line;
}

void ParseCommandFlags(FlagSet& flags, const CommandLine& line,
                       std::vector<std::string>* positional, size_t name_at) {
  std::vector<const char*> argv;
  argv.push_back(line.words[name_at].c_str());
  for (const std::string& f : line.early_flags) argv.push_back(f.c_str());
  for (size_t i = name_at + 1; i < line.words.size(); ++i) argv.push_back(line.words[i].c_str());
  ParseFlagsOrExit(flags, static_cast<int>(argv.size()), argv.data(), positional);
}

int Report(const absl::Status& s, const std::string& what) {
  bool unreachable =
      s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded;
  // A message that names what failed already ("store HOST:PORT: ...", as
  // the store client says a deadline that passed) is not prefixed again.
  const std::string said(Prefixed(s, what + ": ").message());
  std::fprintf(stderr, "kvctl: %s%s\n", said.c_str(),
               unreachable ? " (is it running? check the address, --store/--router or "
                             "KVTIER_STORE/KVTIER_ROUTER)"
                           : "");
  return unreachable ? kUnreachable : kRefused;
}

int ReportCall(const grpc::Status& s, const grpc::ClientContext& ctx, const std::string& what) {
  const absl::Status st = FromGrpc(s);
  if (st.code() == absl::StatusCode::kUnavailable &&
      ctx.GetServerTrailingMetadata().count(kAnsweredByServer) > 0) {
    std::fprintf(stderr, "kvctl: %s: %s\n", what.c_str(), std::string(st.message()).c_str());
    return kRefused;
  }
  return Report(st, what);
}

SharedFlags::SharedFlags()
    : stores(EnvOr("KVTIER_STORE", "127.0.0.1:7400")),
      router(EnvOr("KVTIER_ROUTER", "127.0.0.1:7500")),
      tls{EnvOr("KVTIER_TLS_CERT", ""), EnvOr("KVTIER_TLS_KEY", ""), EnvOr("KVTIER_TLS_CA", ""),
          false, EnvOr("KVTIER_TLS_SERVER_NAME", "")} {}

void SharedFlags::Register(FlagSet& f, Dials dials) {
  // The order is the order of every command's --help.
  AddTlsFlags(f, &tls, /*serves=*/false, /*dials=*/true);
  if (dials == Dials::kStores) {
    f.String("admin-token-file", &admin_token_file,
             "File with the store's admin token (policy set, evict) [env KVTIER_ADMIN_TOKEN]");
  }
  if (dials == Dials::kStores || dials == Dials::kStoresAndRouter) {
    f.String("store", &stores, "Store shard address(es), comma-separated [env KVTIER_STORE]");
  }
  if (dials == Dials::kRouter || dials == Dials::kStoresAndRouter) {
    f.String("router", &router, "Router address [env KVTIER_ROUTER]");
  }
  f.Bool("json", &json, "Print JSON for scripts");
  f.DurationMs("timeout", &timeout_ms, "Deadline of each call");
}

std::vector<std::string> SharedFlags::StoreList() const {
  std::vector<std::string> out;
  for (absl::string_view s : absl::StrSplit(stores, ',', absl::SkipEmpty())) out.emplace_back(s);
  return out;
}

ChannelSecurity SharedFlags::Security() const {
  absl::StatusOr<ChannelSecurity> sec = ClientSecurity(tls);
  if (!sec.ok()) {
    std::fprintf(stderr, "kvctl: %s\n", std::string(sec.status().message()).c_str());
    std::exit(kUsage);
  }
  return *sec;
}

StoreClientOptions SharedFlags::ClientOptions() const {
  StoreClientOptions o;
  o.security = Security();
  o.deadline_ms = static_cast<int>(timeout_ms);
  o.admin_token = EnvOr("KVTIER_ADMIN_TOKEN", "");
  if (!admin_token_file.empty()) {
    std::ifstream in(admin_token_file);
    std::getline(in, o.admin_token);
  }
  return o;
}

StoreClient SharedFlags::StoreAt(const std::string& address) const {
  return StoreClient(address, ClientOptions());
}

std::unique_ptr<v1::Router::Stub> SharedFlags::RouterStub() const {
  return v1::Router::NewStub(OpenChannel(router, Security()));
}

std::chrono::system_clock::time_point SharedFlags::Deadline() const {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
}

int Confirm(const std::string& command, const std::string& what, const std::string& where) {
  if (!isatty(0)) {
    std::fprintf(stderr, "%s: would %s on %s; not a terminal, so pass --yes to confirm\n",
                 command.c_str(), what.c_str(), where.c_str());
    return kDeclined;
  }
  std::fprintf(stderr, "%s on %s? Type yes to confirm: ", what.c_str(), where.c_str());
  std::string answer;
  std::getline(std::cin, answer);
  if (answer != "yes") {
    std::fprintf(stderr, "%s: not confirmed; nothing changed\n", command.c_str());
    return kDeclined;
  }
  return kOk;
}

absl::StatusOr<uint64_t> ParseNamespace(const std::string& text) {
  uint64_t v;
  if (text.empty() || !absl::SimpleHexAtoi(text, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("namespace \"", text, "\" is not a hex id"));
  }
  return v;
}

void PromptFlags::Register(FlagSet& f, const std::string& tokens_help) {
  f.String("namespace", &ns, "Namespace id (hex)");
  f.String("tokens", &tokens_file, tokens_help);
  f.String("hashes", &hashes_file, "File of block hashes, one per line (32 hex digits)");
}

absl::Status PromptFlags::Check() const {
  if (auto id = ParseNamespace(ns); !id.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--namespace: ", id.status().message()));
  }
  if (tokens_file.empty() == hashes_file.empty()) {
    return absl::InvalidArgumentError("give exactly one of --tokens FILE and --hashes FILE");
  }
  return absl::OkStatus();
}

absl::StatusOr<Prompt> PromptFlags::Read() const {
  if (absl::Status s = Check(); !s.ok()) return s;
  Prompt p;
  p.ns = *ParseNamespace(ns);
  p.from_tokens = !tokens_file.empty();
  if (p.from_tokens) {
    auto t = ReadTokens(tokens_file);
    if (!t.ok()) return t.status();
    p.tokens = *std::move(t);
  } else {
    auto h = ReadHashes(hashes_file);
    if (!h.ok()) return h.status();
    p.hashes = *std::move(h);
  }
  return p;
}

const char* TierName(v1::Tier tier) { return tier == v1::TIER_RAM ? "ram" : "disk"; }

void PrintJson(const nlohmann::json& j) { std::printf("%s\n", j.dump(2).c_str()); }

}  // namespace kvtier::cli
