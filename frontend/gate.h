// Who may send what, and when: the API keys a client must present (stored
// as SHA-256 digests, never the keys), each key's token rate, and the
// bounded queue requests wait in while the frontend serves its most at
// once. Each refusal is an OpenAI-shaped error (401, 429 with
// Retry-After). docs/frontend.md, "Keys, rates and the queue".
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/status/statusor.h"
#include "frontend/asio.h"
#include "frontend/openai.h"

namespace kvtier::frontend {

// The keys a client may present, as `Authorization: Bearer KEY`.
class ApiKeys {
 public:
  struct Key {
    std::string name;                // for logs and metrics (never the key)
    uint64_t tokens_per_minute = 0;  // 0: no token-rate limit
  };

  // One key a line: its SHA-256 as 64 hex digits, a name, and optionally
  // its tokens per minute ("-": `default_tpm`); '#' starts a comment.
  // INVALID_ARGUMENT naming the line that is wrong.
  static absl::StatusOr<ApiKeys> Parse(std::string_view text, uint64_t default_tpm);

  // The key an Authorization header's value presents; nullptr for none,
  // or one not listed.
  const Key* Find(std::string_view authorization) const;
  size_t size() const { return keys_.size(); }

  // 64 lowercase hex digits: what a key file lists for `key`.
  static std::string Digest(std::string_view key);

 private:
  std::unordered_map<std::string, Key> keys_;  // by digest
};

// The API keys file, read again every `interval_ms` in a thread of its
// own (a Kubernetes Secret mounted as a volume changes in place): a text
// that reads and parses replaces the keys at once; one that does not
// keeps the last good keys and is logged. Thread-safe.
class KeyFile {
 public:
  // The file's keys now, or its error (ApiKeys::Parse's, or the read's).
  static absl::StatusOr<std::unique_ptr<KeyFile>> Open(const std::string& path,
                                                       uint64_t default_tpm, uint64_t interval_ms);
  ~KeyFile();

  // The keys now; they stay valid while held.
  std::shared_ptr<const ApiKeys> keys() const;
  // Reads the file now: true when its text changed and parsed (the keys
  // replaced), false when unchanged; the error when it does not read or
  // parse (the keys kept).
  absl::StatusOr<bool> Reload();
  uint64_t reloads() const { return reloads_.load(); }
  uint64_t failures() const { return failures_.load(); }

 private:
  KeyFile(std::string path, uint64_t default_tpm) : path_(std::move(path)), tpm_(default_tpm) {}

  const std::string path_;
  const uint64_t tpm_;
  mutable std::mutex mu_;
  std::shared_ptr<const ApiKeys> keys_;
  std::string text_, bad_text_;  // the keys' text; the last one refused
  std::atomic<uint64_t> reloads_{0}, failures_{0};
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread reader_;
};

// Each key's tokens per minute as a bucket that holds a minute's tokens
// and refills continuously: a request takes its prompt and the tokens it
// may generate (Prepared::max_new_tokens) when the bucket holds them.
class TokenRates {
 public:
  // nullopt: taken. Else the seconds until the bucket holds `tokens`
  // (infinite when `tokens` exceed a whole minute's: it never will).
  std::optional<double> Take(const std::string& key, uint64_t tokens_per_minute, uint64_t tokens,
                             int64_t now_ms);

 private:
  struct Bucket {
    double tokens = 0;
    int64_t at_ms = 0;
  };
  std::mutex mu_;
  std::map<std::string, Bucket> buckets_;
};

// At most `limit` requests served at once; up to `queue` more wait, in
// order of arrival, up to `timeout_ms` each. Each admitted request holds
// a Slot until its answer ends. Shared: a coroutine frame destroyed with
// its io_context (at exit) may release its slot after the frontend went.
class Admission : public std::enable_shared_from_this<Admission> {
 public:
  Admission(uint64_t limit, uint64_t queue, uint64_t timeout_ms)
      : limit_(limit), queue_(queue), timeout_ms_(timeout_ms) {}

  // One request served: its turn passes on when this goes.
  class Slot {
   public:
    Slot() = default;
    explicit Slot(std::shared_ptr<Admission> a) : a_(std::move(a)) {}
    Slot(Slot&&) noexcept = default;
    Slot& operator=(Slot&& o) noexcept {
      std::swap(a_, o.a_);
      return *this;
    }
    ~Slot() {
      if (a_) a_->Release();
    }

   private:
    std::shared_ptr<Admission> a_;
  };

  enum class Refused { kNone, kQueueFull, kTimedOut, kClientGone };
  // A turn, at once or once one frees (`*why` kNone), or why not. While
  // it waits, `gone` is asked every kGoneCheck: a waiter whose client left
  // leaves the queue (kClientGone).
  Task<Slot> Enter(Refused* why, std::function<bool()> gone = nullptr);
  static constexpr auto kGoneCheck = std::chrono::milliseconds(200);
  // At exit: turns that end from now on wake nobody (their loops are gone).
  void Close();

  uint64_t waiting() const;

 private:
  struct Waiter {
    std::shared_ptr<Timer> timer;
    Executor executor;
    bool granted = false;
  };
  void Release();

  const uint64_t limit_, queue_, timeout_ms_;
  mutable std::mutex mu_;
  bool closed_ = false;                          // guarded by mu_
  uint64_t serving_ = 0;                         // guarded by mu_
  std::deque<std::shared_ptr<Waiter>> waiting_;  // guarded by mu_
};

// OpenAI's answers to a request without a valid key, over its token rate,
// or refused by the queue.
ApiError KeyRequired(bool presented);
ApiError OverTokenRate(const ApiKeys::Key& key, uint64_t tokens, double wait_s);
ApiError QueueRefused(Admission::Refused why, uint64_t timeout_ms);

}  // namespace kvtier::frontend
