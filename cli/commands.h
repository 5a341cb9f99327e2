// The entry point of each kvctl command. main.cc dispatches to them; each is
// defined in the file of its group (stats.cc, policy.cc, ...). Each returns
// an exit code from cli.h.
#pragma once

#include "cli/cli.h"

namespace kvtier::cli {

int RunStats(const CommandLine& line);       // stats.cc
int RunPolicy(const CommandLine& line);      // policy.cc: policy get|set
int RunEvict(const CommandLine& line);       // evict.cc
int RunLookup(const CommandLine& line);      // lookup.cc
int RunNamespaces(const CommandLine& line);  // namespaces.cc
int RunWorkers(const CommandLine& line);     // router_cmds.cc
int RunRoute(const CommandLine& line);       // router_cmds.cc
int RunHealth(const CommandLine& line);      // health.cc
int RunVersion(const CommandLine& line);     // version.cc

}  // namespace kvtier::cli
