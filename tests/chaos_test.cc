// The multi-host fault test: kvtier-bench chaos --quick builds 3 store
// shards, a router, 4 workers and a client, each in a network namespace of
// its own joined by veth pairs and a bridge, and replays the trace through
// a store host's link going down, a store's kill -9 and restart on the same
// data, and the router's kill -9 and restart. Every onboarded block is
// verified by the workers. Needs root (CI runs as root); skipped otherwise.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "testing/process.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

// The namespaces a run with this pid created.
int Namespaces(pid_t pid) {
  ShellResult r =
      RunShell("ip netns list 2>/dev/null | grep -c '^kvc" + std::to_string(pid) + "-'");
  return std::atoi(r.out.c_str());
}

bool CanCreateNamespaces() {
  return geteuid() == 0 && RunShell("command -v ip >/dev/null 2>&1").exit_code == 0;
}

TEST(Chaos, FaultsAcrossHostsServeNoWrongByteAndRecover) {
  if (!CanCreateNamespaces())
    GTEST_SKIP() << "needs root and iproute2 to create network namespaces";
  TempDir dir;
  const std::string out = dir.sub("out.json");
  ShellResult r = RunShell(std::string(KVTIER_BENCH_BIN) + " chaos --quick --json > " + out +
                           " 2> " + dir.sub("err"));
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ifstream ein(dir.sub("err"));
  std::string err((std::istreambuf_iterator<char>(ein)), std::istreambuf_iterator<char>());
  ASSERT_EQ(r.exit_code, 0) << err;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_TRUE(j.is_array()) << text;
  ASSERT_EQ(j.size(), 3u) << text;
  for (const auto& sc : j) {
    const std::string name = sc["scenario"];
    SCOPED_TRACE(name);
    for (const char* phase : {"before", "during", "after"}) {
      EXPECT_EQ(sc[phase]["wrong_blocks"].get<uint64_t>(), 0u) << phase;
    }
    EXPECT_GT(sc["before"]["done"].get<uint64_t>(), 0u);
    EXPECT_GT(sc["before"]["verified_blocks"].get<uint64_t>() +
                  sc["after"]["verified_blocks"].get<uint64_t>(),
              0u)
        << "nothing was onboarded: the store path was not exercised";
    EXPECT_GT(sc["after"]["done"].get<uint64_t>(), 0u) << "no request finished after healing";
    EXPECT_GE(sc["sources_back_s"].get<double>(), 0) << "a source never came back to the router";
    EXPECT_FALSE(sc.contains("inject_error")) << sc.dump();
    EXPECT_FALSE(sc.contains("heal_error")) << sc.dump();
  }
  // Each fault was felt (so the test would see a recovery that did not happen).
  EXPECT_GT(j[1]["during"]["loads_failed_recomputed"].get<uint64_t>(), 0u) << j[1].dump();
  EXPECT_GT(j[2]["during"]["routes_failed"].get<uint64_t>(), 0u) << j[2].dump();
  EXPECT_GT(j[0]["during"]["wall_p99_ms"].get<double>(),
            j[0]["before"]["wall_p50_ms"].get<double>())
      << j[0].dump();
}

// Interrupted mid-run, the harness stops its servers and removes every
// namespace it created; one killed outright leaves them, and the next run
// removes them at start.
TEST(Chaos, NamespacesAreRemovedAfterAnInterruptionAndAKill) {
  if (!CanCreateNamespaces())
    GTEST_SKIP() << "needs root and iproute2 to create network namespaces";
  TempDir dir;
  auto start = [&](const std::string& log) {
    return std::make_unique<Process>(
        KVTIER_BENCH_BIN, std::vector<std::string>{"chaos", "--scenarios=kill9", "--phase-s=30"},
        dir.sub(log));
  };
  auto wait_for_namespaces = [](pid_t pid) {
    for (int i = 0; i < 300 && Namespaces(pid) < 10; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return Namespaces(pid);
  };
  auto p = start("interrupted.log");
  const pid_t first = p->pid();
  ASSERT_EQ(wait_for_namespaces(first), 10);  // hub, 3 stores, router, 4 workers, client
  // Mid-run: its set-up done, a scenario running.
  auto running = [&] {
    std::ifstream in(dir.sub("interrupted.log"));
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return log.find("  scenario kill9...") != std::string::npos;
  };
  ASSERT_TRUE(testing::WaitFor(running, std::chrono::seconds(60)))
      << "the run never reached its scenario";
  int st = p->Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(st)) << st;
  EXPECT_EQ(Namespaces(first), 0);

  auto killed = start("killed.log");
  const pid_t second = killed->pid();
  ASSERT_EQ(wait_for_namespaces(second), 10);
  killed->Kill(SIGKILL);
  EXPECT_EQ(Namespaces(second), 10) << "a killed run cannot clean up after itself";
  auto next = start("next.log");
  for (int i = 0; i < 300 && Namespaces(second) > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Namespaces(second), 0) << "the next run removes what a killed one left";
  next->Kill(SIGTERM);
  EXPECT_EQ(Namespaces(next->pid()), 0);
}

}  // namespace
}  // namespace kvtier
