#include "common/config.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/version.h"

namespace kvtier {

absl::StatusOr<uint64_t> ParseBytes(const std::string& text) {
  std::string t(absl::StripAsciiWhitespace(text));
  size_t i = 0;
  while (i < t.size() && (absl::ascii_isdigit(t[i]) || t[i] == '.')) ++i;
  std::string num = t.substr(0, i);
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(t.substr(i)));
  double v;
  if (num.empty() || !absl::SimpleAtod(num, &v) || v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not a size (use e.g. 4096, 64MiB, 8GiB)"));
  }
  double mult;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib")
    mult = 1024.0;
  else if (unit == "m" || unit == "mib")
    mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else {
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" has unknown size unit \"", unit,
                                                   "\" (use B, KiB, MiB, GiB, TiB)"));
  }
  double bytes = v * mult;
  if (bytes > 1.8e19) {
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is too large"));
  }
  return static_cast<uint64_t>(std::llround(bytes));
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.1f %s", v, kUnits[u]);
}

absl::StatusOr<uint64_t> ParseDurationMs(const std::string& text) {
  std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  size_t i = 0;
  while (i < t.size() && (absl::ascii_isdigit(t[i]) || t[i] == '.')) ++i;
  double v;
  if (i == 0 || !absl::SimpleAtod(t.substr(0, i), &v) || v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not a duration (use e.g. 250ms, 10s, 2m)"));
  }
  std::string unit = t.substr(i);
  double mult;
  if (unit.empty() || unit == "ms")
    mult = 1;
  else if (unit == "s")
    mult = 1000;
  else if (unit == "m")
    mult = 60000;
  else if (unit == "h")
    mult = 3600000;
  else {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" has unknown duration unit \"", unit, "\" (ms, s, m, h)"));
  }
  if (v * mult > 1e15)
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is too long"));
  return static_cast<uint64_t>(std::llround(v * mult));
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read \"", path, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<WordsLine> WordsLines(const std::string& text) {
  std::vector<WordsLine> out;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    WordsLine l;
    for (absl::string_view w : absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty())) {
      l.words.emplace_back(w);
    }
    if (l.words.empty()) continue;
    l.number = number;
    l.text = std::string(absl::StripAsciiWhitespace(line));
    out.push_back(std::move(l));
  }
  return out;
}

bool NameMatches(const std::string& pattern, const std::string& name) {
  if (!pattern.empty() && pattern.back() == '*') {
    return name.compare(0, pattern.size() - 1, pattern, 0, pattern.size() - 1) == 0;
  }
  return pattern == name;
}

absl::Status ValidateHostPort(const std::string& text) {
  size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not HOST:PORT (e.g. 127.0.0.1:7000)"));
  }
  uint32_t port;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" has no valid port (0..65535) after the last ':'"));
  }
  return absl::OkStatus();
}

FlagSet::FlagSet(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void FlagSet::Add(const std::string& name, std::string default_text, bool is_bool,
                  const std::string& help, std::function<absl::Status(const std::string&)> set) {
  if (!flags_.count(name)) order_.push_back(name);
  flags_[name] = Flag{help, std::move(default_text), is_bool, std::move(set)};
}

void FlagSet::String(const std::string& name, std::string* dst, const std::string& help) {
  Add(name, *dst, false, help, [dst](const std::string& v) {
    *dst = v;
    return absl::OkStatus();
  });
}

void FlagSet::Bytes(const std::string& name, uint64_t* dst, const std::string& help) {
  Add(name, FormatBytes(*dst), false, help, [dst](const std::string& v) -> absl::Status {
    auto b = ParseBytes(v);
    if (!b.ok()) return b.status();
    *dst = *b;
    return absl::OkStatus();
  });
}

void FlagSet::DurationMs(const std::string& name, uint64_t* dst, const std::string& help) {
  Add(name, absl::StrCat(*dst, "ms"), false, help, [dst](const std::string& v) -> absl::Status {
    auto d = ParseDurationMs(v);
    if (!d.ok()) return d.status();
    *dst = *d;
    return absl::OkStatus();
  });
}

void FlagSet::Int(const std::string& name, int64_t* dst, int64_t min, int64_t max,
                  const std::string& help) {
  Add(name, absl::StrCat(*dst), false, help, [=](const std::string& v) -> absl::Status {
    int64_t x;
    if (!absl::SimpleAtoi(v, &x)) {
      return absl::InvalidArgumentError(absl::StrCat("\"", v, "\" is not an integer"));
    }
    if (x < min || x > max) {
      return absl::InvalidArgumentError(absl::StrCat(x, " is outside ", min, "..", max));
    }
    *dst = x;
    return absl::OkStatus();
  });
}

void FlagSet::Double(const std::string& name, double* dst, double min, double max,
                     const std::string& help) {
  Add(name, absl::StrCat(*dst), false, help, [=](const std::string& v) -> absl::Status {
    double x;
    if (!absl::SimpleAtod(v, &x) || std::isnan(x)) {
      return absl::InvalidArgumentError(absl::StrCat("\"", v, "\" is not a number"));
    }
    if (x < min || x > max) {
      return absl::InvalidArgumentError(absl::StrCat(x, " is outside ", min, "..", max));
    }
    *dst = x;
    return absl::OkStatus();
  });
}

void FlagSet::Bool(const std::string& name, bool* dst, const std::string& help) {
  Add(name, *dst ? "true" : "false", true, help, [dst](const std::string& v) -> absl::Status {
    std::string l = absl::AsciiStrToLower(v);
    if (l == "true" || l == "1" || l == "yes" || l == "on")
      *dst = true;
    else if (l == "false" || l == "0" || l == "no" || l == "off")
      *dst = false;
    else
      return absl::InvalidArgumentError(absl::StrCat("\"", v, "\" is not true or false"));
    return absl::OkStatus();
  });
}

void FlagSet::Choice(const std::string& name, std::string* dst, std::vector<std::string> choices,
                     const std::string& help) {
  std::string h = absl::StrCat(help, " (", absl::StrJoin(choices, "|"), ")");
  Add(name, *dst, false, h, [dst, choices](const std::string& v) -> absl::Status {
    for (const auto& c : choices) {
      if (c == v) {
        *dst = v;
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("\"", v, "\" is not one of ", absl::StrJoin(choices, ", ")));
  });
}

void FlagSet::HostPort(const std::string& name, std::string* dst, const std::string& help) {
  Add(name, *dst, false, help, [dst](const std::string& v) -> absl::Status {
    if (auto s = ValidateHostPort(v); !s.ok()) return s;
    *dst = v;
    return absl::OkStatus();
  });
}

absl::Status FlagSet::Set(const std::string& name, const std::string& value) {
  auto it = flags_.find(name);
  if (it == flags_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown flag --", name, " (see ", program_, " --help)"));
  }
  if (auto s = it->second.set(value); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("flag --", name, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status FlagSet::Parse(int argc, const char* const* argv,
                            std::vector<std::string>* positional) {
  std::string config_file;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help_requested_ = true;
      continue;
    }
    if (a == "--version") {
      version_requested_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      if (positional) {
        positional->push_back(a);
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument \"", a, "\" (see ", program_, " --help)"));
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "config") {
      if (!has_value) {
        if (i + 1 >= argc) return absl::InvalidArgumentError("flag --config needs a file path");
        value = argv[++i];
      }
      config_file = value;
      continue;
    }
    auto it = flags_.find(name);
    if (it == flags_.end() && name.rfind("no-", 0) == 0) {
      auto b = flags_.find(name.substr(3));
      if (b != flags_.end() && b->second.is_bool && !has_value) {
        if (auto s = Set(name.substr(3), "false"); !s.ok()) return s;
        set_on_command_line_[name.substr(3)] = true;
        continue;
      }
    }
    if (it == flags_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (see ", program_, " --help)"));
    }
    if (!has_value) {
      if (it->second.is_bool) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    if (auto s = Set(name, value); !s.ok()) return s;
    set_on_command_line_[name] = true;
  }
  if (!config_file.empty()) {
    auto text = ReadTextFile(config_file);
    if (!text.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("flag --config: ", text.status().message()));
    }
    return ParseConfigText(*text, config_file);
  }
  return absl::OkStatus();
}

absl::Status FlagSet::ParseConfigText(const std::string& text, const std::string& origin) {
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ":", line_no, ": expected \"name = value\""));
    }
    std::string name(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (absl::StartsWith(name, "--")) name = name.substr(2);
    if (set_on_command_line_.count(name)) continue;
    if (auto s = Set(name, value); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", line_no, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Help() const {
  std::string out = absl::StrCat("Usage: ", program_, " [flags]\n\n", summary_, "\n\nFlags:\n");
  for (const auto& name : order_) {
    const Flag& f = flags_.at(name);
    absl::StrAppend(&out, "  --", name, f.is_bool ? "" : "=VALUE", "\n      ", f.help);
    if (!f.default_text.empty()) absl::StrAppend(&out, " [default: ", f.default_text, "]");
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out,
                  "  --config=FILE\n      Read \"name = value\" lines from FILE; command-line "
                  "flags win.\n  --help\n      Print this help and exit.\n");
  return out;
}

void ParseFlagsOrExit(FlagSet& flags, int argc, const char* const* argv,
                      std::vector<std::string>* positional) {
  absl::Status s = flags.Parse(argc, argv, positional);
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    std::exit(0);
  }
  if (flags.version_requested()) {
    std::printf("%s %s\n", flags.program().c_str(), Version());
    std::exit(0);
  }
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argc > 0 ? argv[0] : "kvtier",
                 std::string(s.message()).c_str());
    std::exit(2);
  }
  // The docs' command lines are checked this way (tests/python/test_docs.py):
  // the flags parse, and nothing runs.
  if (const char* only = std::getenv("KVTIER_FLAGS_ONLY");
      only != nullptr && only == std::string("1")) {
    std::exit(0);
  }
}

}  // namespace kvtier
