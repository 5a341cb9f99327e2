// Child processes and scratch directories for tests, benchmarks and the
// demo: a process started with fork/exec is always stopped (SIGKILL on
// destruction if still running), and a TempDir is removed with its contents.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace kvtier {

// A fresh directory under $TMPDIR, removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvtier-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A child process; killed (SIGKILL) if still running on destruction.
class Process {
 public:
  Process(const std::string& binary, const std::vector<std::string>& args,
          const std::string& log_path = "") {
    std::fflush(nullptr);  // or the child flushes the parent's buffered output again
    pid_ = fork();
    if (pid_ == 0) {
      // The child never outlives its parent, even if the parent is killed.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (!log_path.empty()) {
        FILE* f = std::freopen(log_path.c_str(), "a", stderr);
        (void)f;
        f = std::freopen("/dev/null", "w", stdout);
      }
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(binary.c_str()));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
  }
  ~Process() {
    if (running()) Kill(SIGKILL);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // SIGSTOP, then waits (up to 5 s) until the kernel reports the process
  // stopped: kill() returns before every thread of a busy process has
  // stopped, and calls sent meanwhile are still answered.
  bool Stop() {
    ::kill(pid_, SIGSTOP);
    const std::string stat = "/proc/" + std::to_string(pid_) + "/stat";
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < end) {
      std::ifstream in(stat);
      std::string line;
      std::getline(in, line);
      size_t paren = line.rfind(')');
      if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T')
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }
  bool running() const { return pid_ > 0 && !exited_; }
  // Sends sig and waits (up to 10 s, then SIGKILL). Returns the wait status.
  int Kill(int sig) {
    if (!running()) return status_;
    ::kill(pid_, sig);
    return Wait(std::chrono::seconds(10));
  }
  // Waits for exit; SIGKILL after the timeout.
  int Wait(std::chrono::milliseconds timeout) {
    auto end = std::chrono::steady_clock::now() + timeout;
    while (running()) {
      int st;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        status_ = st;
        break;
      }
      if (std::chrono::steady_clock::now() > end) {
        ::kill(pid_, SIGKILL);
        waitpid(pid_, &st, 0);
        exited_ = true;
        status_ = st;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return status_;
  }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
};

// A TCP port on 127.0.0.1 that was free a moment ago (for a server that
// must come back on the same port, or a tool that takes no port 0), never
// one this process gave before. It lies below the kernel's ephemeral range,
// in the 10,000 ports under the 10,000 the Python tests take
// (tests/python/vllm_server.py): a port from bind(0) lies in the range, so
// a client connecting to it before its server starts can be given it as
// its own source port (a TCP self-connect holds it), and any connect of
// another process can take it. Ports are walked from a random start, so two
// test processes meet only when their walks overlap in time and place.
// Only with every port there in use does the kernel pick one (bind(0)).
inline int FreeLoopbackPort() {
  // Binds 127.0.0.1:port (0: the kernel picks) and closes it: the port
  // bound, or 0.
  auto bind_and_close = [](int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    socklen_t len = sizeof(a);
    const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                       getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    close(fd);
    return bound ? static_cast<int>(ntohs(a.sin_port)) : 0;
  };
  static std::mutex mu;
  static int lo = 0, hi = 0, next = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (hi == 0) {
    int lowest = 32768;
    std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
    range >> lowest;
    lo = std::max(1024, lowest - 20000);
    hi = std::max(lo + 1000, lowest - 10000);
    next = lo + static_cast<int>(std::random_device{}() % static_cast<unsigned>(hi - lo));
  }
  for (int tried = 0; tried < hi - lo; ++tried) {
    const int port = next;
    next = next + 1 < hi ? next + 1 : lo;
    if (bind_and_close(port) == port) return port;
  }
  return bind_and_close(0);  // every port there in use: one the kernel picks
}

// The output (stdout) and exit code of a shell command; exit code -1 when it
// did not exit normally (killed, or the shell could not start).
struct ShellResult {
  int exit_code = -1;
  std::string out;
};
inline ShellResult RunShell(const std::string& command) {
  ShellResult r;
  FILE* p = popen(command.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int st = pclose(p);
  r.exit_code = st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// The number after `key` (e.g. "VmRSS:") in /proc/PID/status; 0 if it
// cannot be read.
inline uint64_t ProcStatus(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string word;
  while (in >> word) {
    if (word == key) {
      uint64_t n = 0;
      in >> n;
      return n;
    }
  }
  return 0;
}

// Resident set size of a process in bytes (VmRSS); 0 if it cannot be read.
inline uint64_t RssBytes(pid_t pid = getpid()) { return ProcStatus(pid, "VmRSS:") * 1024; }

// Threads of a process; 0 if it cannot be read.
inline int ThreadCount(pid_t pid = getpid()) {
  return static_cast<int>(ProcStatus(pid, "Threads:"));
}

// Waits for a port file written by a server started with --port-file; 0 on
// timeout, or as soon as process `pid` (> 0) has exited without writing it.
inline int WaitForPortFile(const std::string& path, std::chrono::milliseconds timeout,
                           pid_t pid = 0) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    std::ifstream in(path);
    int port = 0;
    if (in >> port && port > 0) return port;
    // A zombie of ours: exited (kill(pid, 0) still succeeds on a zombie).
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (pid > 0 && (!std::getline(stat, line) || line.find(") Z") != std::string::npos)) {
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

}  // namespace kvtier
