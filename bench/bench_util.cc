#include "bench/bench_util.h"

#include <nlohmann/json.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/config.h"
#include "common/pattern.h"

namespace kvtier::bench {
namespace {
constexpr std::chrono::seconds kStartTimeout{120};
}  // namespace

absl::StatusOr<NamespaceSpec> SpecForBlockBytes(uint64_t block_bytes, const std::string& model) {
  if (block_bytes == 0 || block_bytes % 8192 != 0 || block_bytes / 8192 > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block size ", block_bytes, " must be a multiple of 8KiB between 8KiB and 8MiB"));
  }
  return NamespaceSpec{model, "fp16", 1, static_cast<uint32_t>(block_bytes / 8192), 128, 16, 0, 1,
                       "",    "",     ""};
}

void FillBlock(uint64_t ns, const BlockHash& hash, uint8_t* out, size_t len) {
  FillPattern(hash.hi ^ (hash.lo * 0x9E3779B97F4A7C15ull) ^ ns, out, len);
}

std::string BlockContent(uint64_t ns, const BlockHash& hash, size_t len) {
  std::string s(len, '\0');
  FillBlock(ns, hash, reinterpret_cast<uint8_t*>(s.data()), len);
  return s;
}

absl::StatusOr<std::vector<uint64_t>> ParseSizeList(const std::string& flag,
                                                    const std::string& text, uint64_t multiple_of) {
  std::vector<uint64_t> out;
  for (absl::string_view x : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    auto b = ParseBytes(std::string(x));
    if (!b.ok() || *b == 0 || *b % multiple_of != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "flag --", flag, ": \"", x, "\" is not a size above 0",
          multiple_of > 1 ? absl::StrCat(" and a multiple of ", multiple_of, " bytes") : ""));
    }
    out.push_back(*b);
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat("flag --", flag, " lists nothing"));
  return out;
}

absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& flag, const std::string& text,
                                                  int64_t min, int64_t max) {
  std::vector<int64_t> out;
  for (absl::string_view x : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(x, &v) || v < min || v > max) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", flag, ": \"", x, "\" is not an integer in ", min, "..", max));
    }
    out.push_back(v);
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat("flag --", flag, " lists nothing"));
  return out;
}

std::string DefaultBinary(const std::string& subdir, const std::string& name) {
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto candidate = self.parent_path().parent_path() / subdir / name;
    if (std::filesystem::exists(candidate)) return candidate.string();
    candidate = self.parent_path() / name;
    if (std::filesystem::exists(candidate)) return candidate.string();
  }
  return name;
}

absl::StatusOr<std::unique_ptr<LocalServer>> LocalServer::Start(
    const std::string& binary, const std::string& scratch, const std::vector<std::string>& flags) {
  std::string port_file = scratch + ".port";
  std::remove(port_file.c_str());
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--port-file=" + port_file};
  args.insert(args.end(), flags.begin(), flags.end());
  std::unique_ptr<LocalServer> s(new LocalServer());
  s->binary_ = binary;
  s->scratch_ = scratch;
  s->args_ = args;
  s->proc_ = std::make_unique<Process>(binary, args, scratch + ".log");
  // A process that exits is noticed at once; one still starting gets two
  // minutes: the first engine to import torch from a cold page cache on a
  // busy machine took over 30 s (CI, ctest -j2).
  int port = WaitForPortFile(port_file, kStartTimeout, s->proc_->pid());
  if (port == 0) {
    return absl::UnavailableError(
        absl::StrCat(binary, " did not start; see ", scratch, ".log, which ends:\n", s->LogTail()));
  }
  s->address_ = absl::StrCat("127.0.0.1:", port);
  return s;
}

void LocalServer::Kill9() { proc_->Kill(SIGKILL); }

void LocalServer::Signal(int sig) {
  if (proc_->running()) ::kill(proc_->pid(), sig);
}

int LocalServer::WaitExit(std::chrono::milliseconds timeout) { return proc_->Wait(timeout); }

absl::Status LocalServer::Restart() {
  proc_->Kill(SIGKILL);
  std::string port_file = scratch_ + ".port";
  std::remove(port_file.c_str());
  // Same port as before: the address clients hold stays right.
  std::vector<std::string> args = args_;
  args.push_back("--listen=" + address_);
  proc_ = std::make_unique<Process>(binary_, args, scratch_ + ".log");
  if (WaitForPortFile(port_file, kStartTimeout, proc_->pid()) == 0) {
    return absl::UnavailableError(absl::StrCat(binary_, " did not restart; see ", scratch_,
                                               ".log, which ends:\n", LogTail()));
  }
  return absl::OkStatus();
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(p * values.size()))];
}

std::string LocalServer::LogTail(size_t bytes) const {
  std::ifstream in(scratch_ + ".log");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

pid_t LocalServer::pid() const { return proc_->pid(); }

LocalServer::~LocalServer() {
  if (proc_) proc_->Kill(SIGTERM);
}

absl::StatusOr<std::string> RunCapture(const std::string& command) {
  ShellResult r = RunShell(command);
  if (r.exit_code != 0) {
    return absl::InternalError(
        absl::StrCat("command failed (exit ", r.exit_code, "): ", command, "\n", r.out));
  }
  return std::move(r.out);
}

absl::StatusOr<MooncakeFigures> MooncakeStoreGbps(uint64_t block_bytes, uint64_t blocks,
                                                  int64_t batch, int64_t clients) {
  std::string python;
  if (const char* env = std::getenv("KVTIER_PYTHON"); env != nullptr && *env != '\0') {
    python = env;
  } else {
    std::error_code ec;
    auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) python = (self.parent_path().parent_path() / "venv" / "bin" / "python").string();
  }
  if (python.empty() || !std::filesystem::exists(python)) {
    return absl::UnavailableError(absl::StrCat(
        "no Python environment with Mooncake at ", python.empty() ? "BUILD/venv" : python,
        " (make venv installs it; KVTIER_PYTHON names another)"));
  }
  const std::string script = std::string(KVTIER_SOURCE_DIR) + "/bench/mooncake_ref.py";
  ShellResult r = RunShell(absl::StrCat(
      "GLOG_minloglevel=2 timeout 600 '", python, "' '", script, "' --block-bytes ", block_bytes,
      " --blocks ", blocks, " --batch ", batch, " --clients ", clients, " 2>/dev/null"));
  // The script's last line is one JSON object, an error included.
  std::string last = r.out;
  while (!last.empty() && last.back() == '\n') last.pop_back();
  if (auto nl = last.rfind('\n'); nl != std::string::npos) last = last.substr(nl + 1);
  nlohmann::json j = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::UnavailableError(absl::StrCat("Mooncake Store did not run (exit ", r.exit_code,
                                               "): ", r.out.substr(0, 400)));
  }
  if (j.contains("error")) return absl::UnavailableError(j["error"].get<std::string>());
  MooncakeFigures f;
  f.put_gbps = j["put"]["gib_s"].get<double>() * (1ull << 30) / 1e9;
  f.get_gbps = j["get"]["gib_s"].get<double>() * (1ull << 30) / 1e9;
  return f;
}

absl::StatusOr<std::pair<double, double>> NginxPlainTlsBytesPerSec(const std::string& dir,
                                                                   const std::string& cert,
                                                                   const std::string& key,
                                                                   uint64_t bytes, int connections,
                                                                   int seconds) {
  for (const char* tool : {"nginx", "wrk"}) {
    if (!HaveCommand(tool)) return absl::UnavailableError(absl::StrCat(tool, " not installed"));
  }
  const std::string root = dir + "/nginx-www";
  std::filesystem::create_directories(root);
  {
    std::ofstream body(root + "/body", std::ios::binary | std::ios::trunc);
    std::string chunk(1 << 16, '\0');
    for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 2654435761u >> 24);
    for (uint64_t left = bytes; left > 0;) {
      const uint64_t n = std::min<uint64_t>(left, chunk.size());
      body.write(chunk.data(), static_cast<std::streamsize>(n));
      left -= n;
    }
  }
  const int plain = FreeLoopbackPort();
  int tls = FreeLoopbackPort();
  while (tls == plain) tls = FreeLoopbackPort();
  // The configuration a user serving static bodies would run: a worker
  // per core, sendfile, keep-alive without a request limit, no access log.
  std::ofstream(dir + "/nginx.conf", std::ios::trunc)
      << (geteuid() == 0 ? "user root;\n" : "")  // its workers read this process's scratch
      << "worker_processes auto;\npid " << dir << "/nginx.pid;\nerror_log " << dir
      << "/nginx-error.log;\ndaemon off;\nevents { worker_connections 1024; }\nhttp {\n"
      << "  access_log off; sendfile on; tcp_nopush on; tcp_nodelay on;\n"
      << "  keepalive_requests 100000000; open_file_cache max=16;\n"
      << "  server {\n    listen 127.0.0.1:" << plain << ";\n    listen 127.0.0.1:" << tls
      << " ssl;\n    ssl_protocols TLSv1.3;\n    ssl_certificate " << cert
      << ";\n    ssl_certificate_key " << key << ";\n    root " << root << ";\n  }\n}\n";
  Process server("/usr/bin/env", {"nginx", "-c", dir + "/nginx.conf", "-p", dir},
                 dir + "/nginx.log");
  bool up = false;
  for (int i = 0; i < 200 && !up; ++i) {
    up = RunCapture(absl::StrCat("curl -sf -o /dev/null http://127.0.0.1:", plain, "/body")).ok();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (!up) {
    std::ifstream log(dir + "/nginx-error.log");
    std::string why((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    return absl::UnavailableError("nginx did not start: " + why);
  }
  auto rate = [&](const std::string& scheme, int port) -> absl::StatusOr<double> {
    auto out = RunCapture(absl::StrCat("wrk -t1 -c", connections, " -d", seconds, "s ", scheme,
                                       "://127.0.0.1:", port, "/body 2>&1"));
    if (!out.ok()) return out.status();
    const size_t at = out->find("Requests/sec:");
    if (at == std::string::npos || out->find("Non-2xx") != std::string::npos) {
      return absl::InternalError("cannot use wrk's output:\n" + *out);
    }
    return std::stod(out->substr(at + 13)) * static_cast<double>(bytes);
  };
  auto p = rate("http", plain);
  if (!p.ok()) return p.status();
  auto t = rate("https", tls);
  if (!t.ok()) return t.status();
  server.Kill(SIGTERM);
  return std::make_pair(*p, *t);
}

absl::StatusOr<std::pair<double, double>> RedisSetGetRps(const std::string& dir,
                                                         uint64_t value_bytes, int64_t keys,
                                                         int64_t clients, int64_t pipeline) {
  if (!HaveCommand("redis-server") || !HaveCommand("redis-benchmark")) {
    return absl::UnavailableError("redis-server/redis-benchmark not installed");
  }
  int port = FreeLoopbackPort();
  Process server("/usr/bin/env",
                 {"redis-server", "--port", std::to_string(port), "--bind", "127.0.0.1", "--save",
                  "", "--appendonly", "no", "--dir", dir},
                 dir + "/redis.log");
  bool up = false;
  for (int i = 0; i < 200 && !up; ++i) {
    up = RunCapture(absl::StrCat("redis-cli -p ", port, " ping 2>/dev/null")).ok();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (!up) return absl::UnavailableError("redis-server did not start");
  auto bench = [&](const std::string& test, int64_t n) -> absl::StatusOr<double> {
    auto out = RunCapture(absl::StrCat("redis-benchmark -h 127.0.0.1 -p ", port, " -t ", test,
                                       " -n ", n, " -r ", keys, " -d ", value_bytes, " -c ",
                                       clients, " -P ", pipeline, " --csv 2>/dev/null"));
    if (!out.ok()) return out.status();
    std::string want = test == "set" ? "SET" : "GET";
    for (absl::string_view line : absl::StrSplit(*out, '\n')) {
      std::vector<std::string> f = absl::StrSplit(line, ',');
      if (f.size() >= 2 && f[0].find(want) != std::string::npos) {
        std::string rps = f[1];
        rps.erase(std::remove(rps.begin(), rps.end(), '"'), rps.end());
        return std::stod(rps);
      }
    }
    return absl::InternalError(absl::StrCat("cannot parse redis-benchmark output:\n", *out));
  };
  auto set = bench("set", keys);
  if (!set.ok()) return set.status();
  if (auto fill = bench("set", 2 * keys); !fill.ok()) return fill.status();
  auto get = bench("get", keys);
  if (!get.ok()) return get.status();
  server.Kill(SIGTERM);
  return std::make_pair(*set, *get);
}

absl::StatusOr<double> UcxPerftestBytesPerSec(const std::string& tls, const std::string& test,
                                              uint64_t size, int64_t iterations) {
  if (!HaveCommand("ucx_perftest")) return absl::UnavailableError("ucx_perftest not installed");
  int port = FreeLoopbackPort();
  // The same TCP segment sizes kvtier's data plane uses (common/ucx.h).
  std::string env = absl::StrCat("UCX_TLS=", tls,
                                 " UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-512k}"
                                 " UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-512k}");
  auto server = std::make_unique<Process>(
      "/bin/sh",
      std::vector<std::string>{"-c", absl::StrCat("exec env ", env, " ucx_perftest -p ", port)},
      "/dev/null");
  absl::StatusOr<std::string> out = absl::UnavailableError("ucx_perftest did not run");
  for (int attempt = 0; attempt < 40; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    out = RunCapture(absl::StrCat(env, " timeout 60 ucx_perftest 127.0.0.1 -p ", port, " -t ", test,
                                  " -s ", size, " -n ", iterations, " -w ",
                                  std::max<int64_t>(1, iterations / 10), " 2>&1"));
    if (out.ok()) break;
  }
  server->Kill(SIGKILL);
  if (!out.ok()) return out.status();
  for (absl::string_view line : absl::StrSplit(*out, '\n')) {
    if (!absl::StartsWith(line, "Final:")) continue;
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    // Final: iters p50 avg overall bw_avg(MB/s) bw_overall msg_avg msg_overall
    if (f.size() >= 7) return std::stod(f[6]) * 1024 * 1024;
  }
  return absl::InternalError(absl::StrCat("cannot parse ucx_perftest output:\n", *out));
}

bool HaveCommand(const std::string& name) {
  return std::system(("command -v " + name + " >/dev/null 2>&1").c_str()) == 0;
}

}  // namespace kvtier::bench
