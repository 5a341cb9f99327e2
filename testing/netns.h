// Hosts for multi-host tests: network namespaces joined by veth pairs to a
// bridge in a hub namespace, each host with an address of 10.213.0.0/24
// inside it. Nothing is added to the namespace the caller runs in. The
// namespaces are named TAGPID-NAME, removed on destruction (with any
// /etc/netns/NS/hosts file made for them), and RemoveStale removes those
// of runs no longer alive (a run killed outright cannot clean up). Needs
// root and iproute2.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "testing/process.h"

namespace kvtier {

class NetnsLab {
 public:
  struct Host {
    std::string name, ns, ip;
  };

  explicit NetnsLab(std::string tag = "kvc") : tag_(std::move(tag)) {}
  ~NetnsLab() {
    for (const auto& h : hosts_) {
      Sh("ip netns del " + h.ns);
      std::error_code ec;
      std::filesystem::remove_all("/etc/netns/" + h.ns, ec);
    }
    if (!hub_.empty()) Sh("ip netns del " + hub_);
  }
  NetnsLab(const NetnsLab&) = delete;
  NetnsLab& operator=(const NetnsLab&) = delete;

  static bool Available() {
    return geteuid() == 0 && RunShell("command -v ip >/dev/null 2>&1").exit_code == 0;
  }

  // Removes TAG<pid>-* namespaces whose pid is not a live process.
  static void RemoveStale(const std::string& tag) {
    std::istringstream list(RunShell("ip netns list 2>/dev/null").out);
    std::string line;
    while (std::getline(list, line)) {
      const std::string name = line.substr(0, line.find(' '));
      if (name.rfind(tag, 0) != 0) continue;
      const size_t dash = name.find('-');
      if (dash == std::string::npos || dash == tag.size()) continue;
      const std::string digits = name.substr(tag.size(), dash - tag.size());
      if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
      const pid_t pid = static_cast<pid_t>(std::atol(digits.c_str()));
      if (pid > 0 && kill(pid, 0) == 0) continue;  // a live run's
      Sh("ip netns del " + name);
      std::error_code ec;
      std::filesystem::remove_all("/etc/netns/" + name, ec);
    }
  }

  // Creates the hub and one host per name; false with *error set on failure
  // (what was made is removed on destruction either way).
  bool Create(const std::vector<std::string>& names, std::string* error) {
    const std::string run = tag_ + std::to_string(getpid()) + "-";
    hub_ = run + "hub";
    for (const std::string& cmd :
         {"ip netns add " + hub_, "ip -n " + hub_ + " link add br0 type bridge",
          "ip -n " + hub_ + " link set br0 up", "ip -n " + hub_ + " link set lo up"}) {
      if (!Run(cmd, error)) return false;
    }
    for (const std::string& name : names) {
      const size_t n = hosts_.size();
      Host h{name, run + name, "10.213.0." + std::to_string(10 + n)};
      hosts_.push_back(h);
      const std::string port = "vh" + std::to_string(n);
      for (const std::string& cmd :
           {"ip netns add " + h.ns,
            "ip -n " + hub_ + " link add " + port + " type veth peer name eth0 netns " + h.ns,
            "ip -n " + hub_ + " link set " + port + " master br0 up",
            "ip -n " + h.ns + " addr add " + h.ip + "/24 dev eth0",
            "ip -n " + h.ns + " link set eth0 up", "ip -n " + h.ns + " link set lo up"}) {
        if (!Run(cmd, error)) return false;
      }
    }
    return true;
  }

  const Host& at(const std::string& name) const {
    for (const auto& h : hosts_) {
      if (h.name == name) return h;
    }
    std::abort();
  }
  const std::string& hub() const { return hub_; }

  // The /etc/hosts processes started in host `name` by `ip netns exec` see.
  void SetHosts(const std::string& name, const std::string& contents) const {
    const std::string dir = "/etc/netns/" + at(name).ns;
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/hosts") << contents;
  }

  // argv for a program run inside host `name`: {ip, netns, exec, NS, binary, args...}.
  static std::string IpPath() {
    std::string p = RunShell("command -v ip").out;
    while (!p.empty() && (p.back() == '\n' || p.back() == ' ')) p.pop_back();
    return p;
  }
  std::vector<std::string> ExecArgs(const std::string& name, const std::string& binary,
                                    const std::vector<std::string>& args) const {
    std::vector<std::string> a = {"netns", "exec", at(name).ns, binary};
    a.insert(a.end(), args.begin(), args.end());
    return a;
  }

  // Moves the calling thread (and threads it starts from now on) into host
  // `name`'s namespace.
  bool Enter(const std::string& name) const {
    const int fd = open(("/var/run/netns/" + at(name).ns).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const int r = setns(fd, CLONE_NEWNET);
    close(fd);
    return r == 0;
  }

 private:
  static ShellResult Sh(const std::string& cmd) { return RunShell(cmd + " 2>&1"); }
  static bool Run(const std::string& cmd, std::string* error) {
    ShellResult r = Sh(cmd);
    if (r.exit_code == 0) return true;
    *error = cmd + ": " + r.out;
    return false;
  }

  std::string tag_, hub_;
  std::vector<Host> hosts_;
};

// A server inside a host's namespace (run through `ip netns exec`; ip_path:
// NetnsLab::IpPath()), restartable with the same flags.
class NetnsServer {
 public:
  NetnsServer(std::string ip_path, NetnsLab::Host host, std::string binary,
              std::vector<std::string> flags, std::string log)
      : ip_(std::move(ip_path)),
        host_(std::move(host)),
        binary_(std::move(binary)),
        flags_(std::move(flags)),
        log_(std::move(log)) {}
  void Start() {
    std::vector<std::string> args = {"netns", "exec", host_.ns, binary_};
    args.insert(args.end(), flags_.begin(), flags_.end());
    proc_ = std::make_unique<Process>(ip_, args, log_);
  }
  void Kill9() {
    if (proc_) proc_->Kill(SIGKILL);
  }
  void Stop() {
    if (proc_) proc_->Kill(SIGTERM);
  }
  // Sends SIGTERM without waiting: servers stopped together shut down in
  // parallel (each may wait out its own grace period); Stop() then reaps.
  void Terminate() {
    if (proc_ && proc_->running()) ::kill(proc_->pid(), SIGTERM);
  }
  const NetnsLab::Host& host() const { return host_; }

 private:
  std::string ip_;
  NetnsLab::Host host_;
  std::string binary_;
  std::vector<std::string> flags_;
  std::string log_;
  std::unique_ptr<Process> proc_;
};

}  // namespace kvtier
