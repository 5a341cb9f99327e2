// Command-line and config-file parsing shared by every kvtier binary.
//
// Flags are registered against typed destinations, parsed once at start, and
// validated there: a bad flag is an error that names the flag. A config file
// (--config FILE) holds "name = value" lines (# comments); flags given on the
// command line win over the file. Not thread-safe; use from main().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier {

// "64MiB", "8GiB", "4096", "1.5GB" (KB/MB/GB are powers of 1000, KiB/MiB/GiB
// of 1024; "k"/"m"/"g" alone are 1024-based) -> bytes.
absl::StatusOr<uint64_t> ParseBytes(const std::string& text);
// Bytes as "1.5 GiB", "64 MiB", "512 B".
std::string FormatBytes(uint64_t bytes);
// "250ms", "10s", "2m", "1h", or a bare number of milliseconds -> ms.
absl::StatusOr<uint64_t> ParseDurationMs(const std::string& text);
// "HOST:PORT" -> (host, port); port 0 (pick one) is allowed.
absl::Status ValidateHostPort(const std::string& text);

// The whole file; NOT_FOUND "cannot read \"PATH\"" if it cannot be read.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// One line of a words file (--source-identities, --tenants-file): its
// 1-based number, its text without the comment, and its words.
struct WordsLine {
  int number = 0;
  std::string text;
  std::vector<std::string> words;
};
// The lines of text that hold words: "#" starts a comment, words are
// separated by spaces and tabs, blank lines are dropped.
std::vector<WordsLine> WordsLines(const std::string& text);

// Whether name matches pattern: a pattern ending in "*" matches every name
// that starts with what precedes it; any other pattern only itself.
bool NameMatches(const std::string& pattern, const std::string& name);

class FlagSet {
 public:
  FlagSet(std::string program, std::string summary);

  void String(const std::string& name, std::string* dst, const std::string& help);
  void Bytes(const std::string& name, uint64_t* dst, const std::string& help);
  void DurationMs(const std::string& name, uint64_t* dst, const std::string& help);
  void Int(const std::string& name, int64_t* dst, int64_t min, int64_t max,
           const std::string& help);
  void Double(const std::string& name, double* dst, double min, double max,
              const std::string& help);
  void Bool(const std::string& name, bool* dst, const std::string& help);
  void Choice(const std::string& name, std::string* dst, std::vector<std::string> choices,
              const std::string& help);
  void HostPort(const std::string& name, std::string* dst, const std::string& help);

  // Parses argv[1..]. Positional arguments go to *positional when given, and
  // are an error otherwise. Sets help_requested() on --help / -h.
  absl::Status Parse(int argc, const char* const* argv,
                     std::vector<std::string>* positional = nullptr);
  // Applies "name = value" lines; flags already set on the command line win.
  absl::Status ParseConfigText(const std::string& text, const std::string& origin);

  bool help_requested() const { return help_requested_; }
  // --version was given: the caller prints program() and Version().
  bool version_requested() const { return version_requested_; }
  const std::string& program() const { return program_; }
  std::string Help() const;

 private:
  struct Flag {
    std::string help;
    std::string default_text;
    bool is_bool = false;
    std::function<absl::Status(const std::string&)> set;
  };
  void Add(const std::string& name, std::string default_text, bool is_bool, const std::string& help,
           std::function<absl::Status(const std::string&)> set);
  absl::Status Set(const std::string& name, const std::string& value);

  std::string program_;
  std::string summary_;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::map<std::string, bool> set_on_command_line_;
  bool help_requested_ = false;
  bool version_requested_ = false;
};

// Parses flags for main(): prints help and exits 0 on --help, prints the
// program and kvtier's version and exits 0 on --version; prints the error
// and exits 2 on a bad flag.
void ParseFlagsOrExit(FlagSet& flags, int argc, const char* const* argv,
                      std::vector<std::string>* positional = nullptr);

}  // namespace kvtier
