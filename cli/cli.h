// What every kvctl command shares: exit codes, the shared flags (addresses,
// TLS, admin token, --json, --timeout) and how they reach a command even when
// given before it, the prompt flags of lookup and route, and the clients and
// printing the commands build their output with.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/store_client.h"
#include "common/block_key.h"
#include "common/config.h"
#include "common/rpc/tls.h"
#include "kvtier/v1/router.grpc.pb.h"

namespace kvtier::cli {

// Exit codes; scripts and the Helm probes depend on them (docs/operations.md).
inline constexpr int kOk = 0;           // done
inline constexpr int kRefused = 1;      // a service refused; its message is printed
inline constexpr int kUsage = 2;        // bad usage
inline constexpr int kUnreachable = 3;  // a service could not be reached
inline constexpr int kDeclined = 4;     // the operator declined a confirmation

// A command line split at its command: `kvctl [shared flags] COMMAND ...`.
struct CommandLine {
  // The command and everything after it, e.g. {"policy", "set", "lru"}.
  std::vector<std::string> words;
  // Shared flags written before the command, values included, e.g.
  // {"--store", "a:7400", "--json"}. They apply to the command as if written
  // right after it, so a repeat after the command wins.
  std::vector<std::string> early_flags;
  // --help or -h came before the command: kvctl's own help is wanted.
  bool help = false;
  // --version came before the command: kvctl's version.
  bool version = false;
};

// Splits argv at the first word that is not a flag. Only the shared flags may
// come before it, because only for them is it known whether the next word is
// their value or the command; other flags there are an error.
absl::StatusOr<CommandLine> SplitCommandLine(int argc, const char* const* argv);

// Parses a command's flags like ParseFlagsOrExit, over words[name_at..] with
// the early flags placed right after words[name_at]; name_at is 1 for
// commands with a verb (policy get). Errors and --help name words[name_at].
void ParseCommandFlags(FlagSet& flags, const CommandLine& line,
                       std::vector<std::string>* positional = nullptr, size_t name_at = 0);

// Prints a failed call's status; returns kUnreachable when the service could
// not be reached (with a hint about the address flags), kRefused otherwise.
int Report(const absl::Status& s, const std::string& what);
// The same for a finished gRPC call: an UNAVAILABLE the server itself
// answered (it says so in its trailing metadata, e.g. "no live worker serves
// namespace ...") is a refusal, exit 1 with its message, not "unreachable".
int ReportCall(const grpc::Status& s, const grpc::ClientContext& ctx, const std::string& what);

// The flags every command shares; which of them a command takes depends on
// what it dials.
struct SharedFlags {
  enum class Dials { kAnyServer, kStores, kRouter, kStoresAndRouter };

  std::string stores;  // comma-separated; --store or KVTIER_STORE
  std::string router;  // --router or KVTIER_ROUTER
  bool json = false;
  uint64_t timeout_ms = 5000;
  std::string admin_token_file;
  TlsFlags tls;

  SharedFlags();
  void Register(FlagSet& f, Dials dials);

  std::vector<std::string> StoreList() const;
  // TLS per --tls-ca/--tls-cert/--tls-key (or KVTIER_TLS_*); exits kUsage on
  // a bad file, before anything is dialled.
  ChannelSecurity Security() const;
  StoreClientOptions ClientOptions() const;
  StoreClient StoreAt(const std::string& address) const;
  std::unique_ptr<v1::Router::Stub> RouterStub() const;
  // When a call started now must end: --timeout.
  std::chrono::system_clock::time_point Deadline() const;
};

// Asks on the terminal whether to `what` on `where`; kOk when the operator
// typed yes, kDeclined otherwise. Without a terminal nobody can answer, so
// that is a refusal too (the message says to pass --yes). `command` names
// the command in messages ("kvctl evict").
int Confirm(const std::string& command, const std::string& what, const std::string& where);

// A hex namespace id as `kvctl namespaces` prints it.
absl::StatusOr<uint64_t> ParseNamespace(const std::string& text);

// A prompt named by --namespace NS and exactly one of --tokens FILE (integers
// separated by spaces, commas or newlines) and --hashes FILE (one
// 32-hex-digit hash per line).
struct Prompt {
  uint64_t ns = 0;
  bool from_tokens = false;
  std::vector<uint32_t> tokens;   // with --tokens
  std::vector<BlockHash> hashes;  // with --hashes
};

struct PromptFlags {
  std::string ns, tokens_file, hashes_file;

  void Register(FlagSet& f, const std::string& tokens_help);
  // Whether the flags name one prompt: a hex namespace and exactly one file.
  absl::Status Check() const;
  // Check(), then the file. Errors are usage errors, worded for the operator.
  absl::StatusOr<Prompt> Read() const;
};

// "ram" or "disk".
const char* TierName(v1::Tier tier);
// Indented JSON and a newline on stdout: what --json prints.
void PrintJson(const nlohmann::json& j);

}  // namespace kvtier::cli
