// kvctl: the operator CLI for kvtier-store shards and kvtier-router. This
// file is the dispatcher: the table of commands, kvctl --help built from it,
// and main(). The commands live in one file per group (see commands.h).
//
// Exit codes: 0 done; 1 a service refused the request (its message is
// printed); 2 bad usage; 3 a service could not be reached; 4 the operator
// declined a confirmation.
#include <cstdio>
#include <string>

#include "cli/cli.h"
#include "cli/commands.h"
#include "common/version.h"

namespace kvtier::cli {
namespace {

struct Command {
  const char* name;     // what the operator types after kvctl
  const char* args;     // shown after the name in kvctl --help ("" for none)
  const char* summary;  // the rest of its line in kvctl --help
  // Printed above this command in kvctl --help when it starts a group.
  const char* heading;
  int (*run)(const CommandLine& line);
};

constexpr const char* kStoreHeading =
    "Store shards (--store ADDR[,ADDR...] or KVTIER_STORE, default 127.0.0.1:7400):";
constexpr const char* kRouterHeading =
    "Router (--router ADDR or KVTIER_ROUTER, default 127.0.0.1:7500):";

// In kvctl --help order. policy has a line per verb; both run RunPolicy,
// which reads the verb.
constexpr Command kCommands[] = {
    {"stats", "", "per-tier statistics per shard and summed (--watch, --json)", kStoreHeading,
     RunStats},
    {"policy", "get", "each tier's eviction policy", nullptr, RunPolicy},
    {"policy", "set", "--tier ram|disk lru|s3fifo|sieve [--param name=value]", nullptr, RunPolicy},
    {"evict", "", "--all | --namespace NS | --key NS:HASH   (asks unless --yes)", nullptr,
     RunEvict},
    {"lookup", "", "which blocks of a prompt are where (--tokens FILE | --hashes FILE)", nullptr,
     RunLookup},
    {"namespaces", "", "the registered namespaces", nullptr, RunNamespaces},
    {"namespaces", "rm ID", "forget a namespace and drop its blocks (admin; asks unless --yes)",
     nullptr, RunNamespaces},
    {"workers", "", "the router's sources: endpoint, namespace, blocks, load, last heartbeat",
     kRouterHeading, RunWorkers},
    {"route", "", "explain one routing decision with every candidate's cost", nullptr, RunRoute},
    {"health", "ADDR", "grpc.health.v1 status (--service NAME); for probes",
     "Any server:", RunHealth},
    {"version", "", "kvctl's version and each store shard's and the router's (--store, --router)",
     nullptr, RunVersion},
};

void Usage(FILE* out) {
  std::fputs("Usage: kvctl COMMAND [flags]    (kvctl COMMAND --help for a command's flags)\n\n",
             out);
  for (const Command& c : kCommands) {
    if (c.heading) std::fprintf(out, "%s\n", c.heading);
    std::string shown = *c.args ? std::string(c.name) + " " + c.args : c.name;
    std::fprintf(out, "  %-12s %s\n", shown.c_str(), c.summary);
  }
  std::fputs(
      "TLS: --tls-ca FILE (connect over TLS), --tls-cert/--tls-key (mutual TLS), or\n"
      "KVTIER_TLS_CA/KVTIER_TLS_CERT/KVTIER_TLS_KEY.\n\n"
      "Exit codes: 0 ok, 1 refused by a service, 2 bad usage, 3 unreachable, 4 not confirmed.\n",
      out);
}

int Main(int argc, const char* const* argv) {
  absl::StatusOr<CommandLine> line = SplitCommandLine(argc, argv);
  if (!line.ok()) {
    std::fprintf(stderr, "kvctl: %s\n", std::string(line.status().message()).c_str());
    return kUsage;
  }
  if (line->help) {
    Usage(stdout);
    return kOk;
  }
  if (line->version) {
    std::printf("kvctl %s\n", Version());
    return kOk;
  }
  if (line->words.empty()) {
    Usage(stderr);
    return kUsage;
  }
  const std::string& cmd = line->words[0];
  for (const Command& c : kCommands) {
    if (cmd == c.name) return c.run(*line);
  }
  std::fprintf(stderr, "kvctl: unknown command \"%s\"\n\n", cmd.c_str());
  Usage(stderr);
  return kUsage;
}

}  // namespace
}  // namespace kvtier::cli

int main(int argc, char** argv) { return kvtier::cli::Main(argc, argv); }
