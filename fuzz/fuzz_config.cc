// libFuzzer: the flag/config parser and the tenants file's (outside input:
// --config files, flags, --tenants-file).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cachestore/tenants.h"
#include "common/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  uint64_t bytes = 0, ms = 0;
  int64_t n = 0;
  double d = 0;
  bool b = false;
  std::string s = "lru", hp = "127.0.0.1:1";
  kvtier::FlagSet f("fuzz", "fuzz");
  f.Bytes("ram-bytes", &bytes, "");
  f.DurationMs("lease-ms", &ms, "");
  f.Int("n", &n, -5, 5, "");
  f.Double("d", &d, 0, 1, "");
  f.Bool("b", &b, "");
  f.Choice("policy", &s, {"lru", "sieve"}, "");
  f.HostPort("listen", &hp, "");
  (void)f.ParseConfigText(text, "fuzz.conf");
  if (n < -5 || n > 5 || d < 0 || d > 1) __builtin_trap();
  // A tenants file that parses keeps its promises: every tenant has a RAM
  // region and a principal, and its salted specs unsalt back to it.
  if (auto t = kvtier::store::Tenants::Parse(text); t.ok()) {
    for (const auto& tn : (*t)->all()) {
      if (tn.ram_bytes == 0 || (tn.identities.empty() && tn.token_sha256.empty())) __builtin_trap();
      kvtier::NamespaceSpec spec{"m", "fp16", 1, 1, 8, 16, 0, 1, text.substr(0, 64), "", ""};
      kvtier::NamespaceSpec back;
      if ((*t)->Unsalt(tn.Salted(spec), &back) != &tn || back.cache_salt != spec.cache_salt) {
        __builtin_trap();
      }
    }
  }
  (void)kvtier::ParseBytes(text);
  (void)kvtier::ParseDurationMs(text);
  // The same text as command-line words.
  std::vector<std::string> words = {"fuzz"};
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == '\n' || text[i] == ' ') {
      if (i > start) words.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  std::vector<const char*> argv;
  for (const auto& w : words) argv.push_back(w.c_str());
  kvtier::FlagSet g("fuzz", "fuzz");
  g.Bytes("ram-bytes", &bytes, "");
  g.Int("n", &n, -5, 5, "");
  g.Bool("b", &b, "");
  std::vector<std::string> pos;
  (void)g.Parse(static_cast<int>(argv.size()), argv.data(), &pos);
  return 0;
}
