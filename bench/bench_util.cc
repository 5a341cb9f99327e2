#include "bench/bench_util.h"

#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace kvtier::bench {

absl::StatusOr<NamespaceSpec> SpecForBlockBytes(uint64_t block_bytes, const std::string& model) {
  if (block_bytes == 0 || block_bytes % 8192 != 0 || block_bytes / 8192 > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block size ", block_bytes, " must be a multiple of 8KiB between 8KiB and 8MiB"));
  }
  return NamespaceSpec{model, "fp16", 1, static_cast<uint32_t>(block_bytes / 8192), 128, 16, 0,
                       1, ""};
}

void FillBlock(uint64_t ns, const BlockHash& hash, uint8_t* out, size_t len) {
  // xorshift64*, seeded by the key: fast and different for every block.
  uint64_t x = (hash.hi ^ (hash.lo * 0x9E3779B97F4A7C15ull) ^ ns) | 1;
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(out + i, &v, 8);
  }
  for (; i < len; ++i) out[i] = static_cast<uint8_t>(x >> (i % 8));
}

std::string BlockContent(uint64_t ns, const BlockHash& hash, size_t len) {
  std::string s(len, '\0');
  FillBlock(ns, hash, reinterpret_cast<uint8_t*>(s.data()), len);
  return s;
}

std::string DefaultStoreBinary() {
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto candidate = self.parent_path().parent_path() / "cachestore" / "kvtier-store";
    if (std::filesystem::exists(candidate)) return candidate.string();
    candidate = self.parent_path() / "kvtier-store";
    if (std::filesystem::exists(candidate)) return candidate.string();
  }
  return "kvtier-store";
}

absl::StatusOr<std::unique_ptr<LocalStore>> LocalStore::Start(
    const std::string& binary, const std::string& data_dir, const std::vector<std::string>& flags) {
  std::string port_file = data_dir + ".port";
  std::remove(port_file.c_str());
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--data-dir=" + data_dir,
                                   "--port-file=" + port_file};
  args.insert(args.end(), flags.begin(), flags.end());
  std::unique_ptr<LocalStore> s(new LocalStore());
  s->proc_ = std::make_unique<Process>(binary, args, data_dir + ".log");
  int port = WaitForPortFile(port_file, std::chrono::seconds(30));
  if (port == 0) {
    return absl::UnavailableError(
        absl::StrCat("kvtier-store (", binary, ") did not start; see ", data_dir, ".log"));
  }
  s->address_ = absl::StrCat("127.0.0.1:", port);
  return s;
}

LocalStore::~LocalStore() {
  if (proc_) proc_->Kill(SIGTERM);
}

absl::StatusOr<std::string> RunCapture(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  if (!p) return absl::InternalError(absl::StrCat("cannot run: ", command));
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int rc = pclose(p);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("command failed (", rc, "): ", command, "\n", out));
  }
  return out;
}

bool HaveCommand(const std::string& name) {
  return std::system(("command -v " + name + " >/dev/null 2>&1").c_str()) == 0;
}

}  // namespace kvtier::bench
