#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"
#include "bench/dataplane_report.h"
#include "common/config.h"

namespace kvtier::bench {

void PrintDataPlaneReport(const std::vector<Row>& rows, const References& refs,
                          uint64_t working_set, bool json) {
  if (json) {
    nlohmann::json j;
    j["working_set_bytes"] = working_set;
    for (const auto& r : rows) {
      nlohmann::json c = {{"path", r.path},     {"block_bytes", r.block_bytes},
                          {"batch", r.batch},   {"op", r.op},
                          {"gb_per_s", r.gbps}, {"blocks_per_s", r.blocks_per_s}};
      // A reference's figure and the case's ratio to it, when measured.
      auto beside = [&](const char* name, const char* ratio, double ref) {
        if (ref <= 0) return;
        c[name] = ref;
        c[ratio] = r.gbps / ref;
      };
      beside("raw_rma_gb_per_s", "ratio_vs_raw_rma", r.raw_gbps);
      beside("redis_best_gb_per_s", "ratio_vs_redis_best", r.redis_best_gbps);
      beside("perftest_gb_per_s", "ratio_vs_perftest", r.perftest_gbps);
      beside("memcpy_gb_per_s", "ratio_vs_memcpy", r.memcpy_gbps);
      beside("ucx_data_plane_gb_per_s", "ratio_vs_ucx_data_plane", r.ucx_gbps);
      beside("mooncake_gb_per_s", "ratio_vs_mooncake", r.mooncake_gbps);
      beside("plain_socket_gb_per_s", "ratio_vs_plain_socket", r.plain_gbps);
      beside("nginx_https_gb_per_s", "ratio_vs_nginx_https", r.nginx_tls_gbps);
      j["cases"].push_back(c);
    }
    for (const auto& [size, b] : refs.redis_best) {
      j["redis_best"].push_back({{"block_bytes", size},
                                 {"set_gb_per_s", b.set_gbps},
                                 {"set_clients", b.set_clients},
                                 {"set_pipeline", b.set_pipeline},
                                 {"get_gb_per_s", b.get_gbps},
                                 {"get_clients", b.get_clients},
                                 {"get_pipeline", b.get_pipeline}});
    }
    if (!refs.mooncake_why.empty()) j["mooncake_not_measured"] = refs.mooncake_why;
    for (const auto& [size, n] : refs.nginx) {
      j["nginx"].push_back(
          {{"block_bytes", size}, {"http_gb_per_s", n.plain_gbps}, {"https_gb_per_s", n.tls_gbps}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf(
      "kvtier-bench dataplane: %s per case. raw RMA: a UCX RMA loop over the same endpoints\n"
      "and registered arena, no control plane (the data plane's ceiling); ceiling:\n"
      "ucx_perftest for TCP, memcpy of distinct buffers for shared memory; redis-best:\n"
      "Redis's best over 1/4/8 connections x pipeline 1/4/16 for the same value size;\n"
      "mooncake: Mooncake Store (mooncake_master + a mooncake_client holding the memory)\n"
      "over TCP, batch_put_from/batch_get_into of registered buffers, same block size,\n"
      "batch and one client, the best of --repeats rounds\n\n",
      FormatBytes(working_set).c_str());
  if (!refs.mooncake_why.empty())
    std::printf("Mooncake Store not measured: %s\n\n", refs.mooncake_why.c_str());
  for (const auto& [size, b] : refs.redis_best) {
    std::printf(
        "redis best at %s: SET %.2f GB/s (%ld clients, pipeline %ld), GET %.2f GB/s "
        "(%ld clients, pipeline %ld)\n",
        FormatBytes(size).c_str(), b.set_gbps, b.set_clients, b.set_pipeline, b.get_gbps,
        b.get_clients, b.get_pipeline);
  }
  if (!refs.redis_best.empty()) std::printf("\n");
  for (const auto& [size, n] : refs.nginx) {
    std::printf(
        "nginx at %s (a worker per core, sendfile, wrk with 4 keep-alive connections): HTTP "
        "%.2f GB/s, HTTPS (TLS 1.3) %.2f GB/s, HTTPS/HTTP %.2f\n",
        FormatBytes(size).c_str(), n.plain_gbps, n.tls_gbps,
        n.plain_gbps > 0 ? n.tls_gbps / n.plain_gbps : 0.0);
  }
  if (!refs.nginx.empty()) std::printf("\n");
  auto num = [](double v) { return v > 0 ? absl::StrFormat("%.2f", v) : std::string("n/a"); };
  auto ratio = [](double a, double b) {
    return b > 0 ? absl::StrFormat("%.2f", a / b) : std::string("n/a");
  };
  std::printf(
      "%-12s %9s %6s %4s | %8s %10s | %8s %6s | %-8s %8s %6s | %10s %6s | %8s %6s | %7s | %8s | "
      "%9s %6s\n",
      "path", "block", "batch", "op", "GB/s", "blocks/s", "raw GB/s", "ratio", "ceiling", "GB/s",
      "ratio", "redis GB/s", "ratio", "mooncake", "ratio", "vs ucx", "vs plain", "nginx tls",
      "ratio");
  for (const auto& r : rows) {
    const bool shm = r.path == "shm";
    const double ceiling = shm ? r.memcpy_gbps : r.perftest_gbps;
    std::printf(
        "%-12s %9s %6ld %4s | %8.2f %10.0f | %8s %6s | %-8s %8s %6s | %10s %6s | %8s %6s | %7s | "
        "%8s | %9s %6s\n",
        r.path.c_str(), FormatBytes(r.block_bytes).c_str(), r.batch, r.op.c_str(), r.gbps,
        r.blocks_per_s, num(r.raw_gbps).c_str(), ratio(r.gbps, r.raw_gbps).c_str(),
        shm ? "memcpy" : "perftest", num(ceiling).c_str(), ratio(r.gbps, ceiling).c_str(),
        num(r.redis_best_gbps).c_str(), ratio(r.gbps, r.redis_best_gbps).c_str(),
        num(r.mooncake_gbps).c_str(), ratio(r.gbps, r.mooncake_gbps).c_str(),
        ratio(r.gbps, r.ucx_gbps).c_str(), ratio(r.gbps, r.plain_gbps).c_str(),
        num(r.nginx_tls_gbps).c_str(), ratio(r.gbps, r.nginx_tls_gbps).c_str());
  }
  std::printf(
      "\n(socket and inline-grpc rows are compared with ucx-tcp's raw RMA and with "
      "ucx_perftest over TCP; shm rows have no Mooncake figure (it ran over TCP); \"vs ucx\": a "
      "socket row over the UCX data plane's figure "
      "for the same case, --data-plane ucx; \"vs plain\": a socket-tls row (the store with "
      "--data-tls and TLS gRPC) over the plaintext socket row of the same case; nginx tls: "
      "nginx serving a body of the block's size over HTTPS, beside socket-tls gets; n/a: not "
      "measured, with --references=false or without a ucx-tcp run)\n");
}

}  // namespace kvtier::bench
