// kvtier-bench: benchmarks and trace replays. Each subcommand prints the
// project's figure beside a reference measured in the same run.
#include <cstdio>
#include <cstring>
#include <string>

#include "common/version.h"

namespace kvtier::bench {
int RunStoreBench(int argc, const char* const* argv);
int RunTraceStore(int argc, const char* const* argv);
int RunRouterBench(int argc, const char* const* argv);
int RunDataPlaneBench(int argc, const char* const* argv);
int RunIdleBench(int argc, const char* const* argv);
int RunWorkerBench(int argc, const char* const* argv);
int RunReplay(int argc, const char* const* argv);
int RunChaos(int argc, const char* const* argv);
int RunCrash(int argc, const char* const* argv);
}  // namespace kvtier::bench

namespace {
void Usage(FILE* out) {
  std::fputs(
      "Usage: kvtier-bench COMMAND [flags]\n\n"
      "Commands:\n"
      "  replay  the main job: store + router + simulated workers on loopback replaying\n"
      "          a Mooncake trace in several modes (round-robin, kv-aware, with/without\n"
      "          the store) beside the infinite-cache bound\n"
      "  store   inline gRPC put/get of kvtier-store (RAM and NVMe hits) beside\n"
      "          redis-benchmark and fio with the same block size\n"
      "  trace   replay a Mooncake trace against a kvtier-store as a shared cache,\n"
      "          verifying every byte, beside the infinite-cache bound\n"
      "  dataplane  put/get over UCX (TCP, shared memory) and inline gRPC beside\n"
      "          ucx_perftest and redis-benchmark\n"
      "  idle    another tenant's get latency beside idle data-plane connections, and\n"
      "          the store's threads and memory with thousands of them\n"
      "  worker  offload/onboard through the worker library beside the plain data\n"
      "          plane; CPU gather/scatter beside memcpy\n"
      "  router  Route latency, event ingestion and memory per block of the router\n"
      "          index, beside a bare hash walk and round-robin over the same gRPC path\n"
      "  chaos   3 store shards, a router and 4 workers, each host in a network namespace,\n"
      "          a trace replayed through faults (link down, kill -9, loss, shaping)\n"
      "  crash   SIGKILL the store at random moments under load, restart it, and check\n"
      "          every block acknowledged on NVMe against an expected-state oracle\n\n"
      "Run 'kvtier-bench COMMAND --help' for a command's flags.\n",
      out);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    Usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  if (cmd == "--version") {
    std::printf("kvtier-bench %s\n", kvtier::Version());
    return 0;
  }
  const char* const* sub = argv + 1;
  if (cmd == "store") return kvtier::bench::RunStoreBench(argc - 1, sub);
  if (cmd == "trace") return kvtier::bench::RunTraceStore(argc - 1, sub);
  if (cmd == "router") return kvtier::bench::RunRouterBench(argc - 1, sub);
  if (cmd == "dataplane") return kvtier::bench::RunDataPlaneBench(argc - 1, sub);
  if (cmd == "idle") return kvtier::bench::RunIdleBench(argc - 1, sub);
  if (cmd == "worker") return kvtier::bench::RunWorkerBench(argc - 1, sub);
  if (cmd == "replay") return kvtier::bench::RunReplay(argc - 1, sub);
  if (cmd == "chaos") return kvtier::bench::RunChaos(argc - 1, sub);
  if (cmd == "crash") return kvtier::bench::RunCrash(argc - 1, sub);
  std::fprintf(stderr, "kvtier-bench: unknown command \"%s\"\n\n", cmd.c_str());
  Usage(stderr);
  return 2;
}
