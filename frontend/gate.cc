#include "frontend/gate.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/config.h"
#include "common/log.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // as in server.cc
#endif

namespace kvtier::frontend {

std::string ApiKeys::Digest(std::string_view key) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), d);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(d), sizeof(d)));
}

absl::StatusOr<ApiKeys> ApiKeys::Parse(std::string_view text, uint64_t default_tpm) {
  ApiKeys keys;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_no;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> parts =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipWhitespace());
    if (parts.empty()) continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("--api-keys-file line ", line_no, ": ", why));
    };
    std::string digest = absl::AsciiStrToLower(parts[0]);
    if (digest.size() != 64 || digest.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return bad(
          "the first field must be the key's SHA-256 in 64 hex digits (printf %s KEY | "
          "sha256sum), never the key itself");
    }
    if (parts.size() < 2 || parts.size() > 3) {
      return bad("expected: SHA256 NAME [TOKENS_PER_MINUTE]");
    }
    Key key{std::string(parts[1]), default_tpm};
    if (parts.size() == 3 && parts[2] != "-" &&
        !absl::SimpleAtoi(parts[2], &key.tokens_per_minute)) {
      return bad(absl::StrCat("tokens per minute \"", parts[2], "\" is not a whole number or -"));
    }
    if (!keys.keys_.emplace(std::move(digest), std::move(key)).second) {
      return bad("this digest is listed twice");
    }
  }
  if (keys.keys_.empty()) {
    return absl::InvalidArgumentError("--api-keys-file lists no key (every request would be 401)");
  }
  return keys;
}

absl::StatusOr<std::unique_ptr<KeyFile>> KeyFile::Open(const std::string& path,
                                                       uint64_t default_tpm, uint64_t interval_ms) {
  std::unique_ptr<KeyFile> f(new KeyFile(path, default_tpm));
  if (auto first = f->Reload(); !first.ok()) return first.status();
  f->reloads_ = 0;
  if (interval_ms > 0) {
    KeyFile* self = f.get();
    f->reader_ = std::thread([self, interval_ms] {
      std::unique_lock lk(self->mu_);
      while (!self->stop_cv_.wait_for(lk, std::chrono::milliseconds(interval_ms),
                                      [self] { return self->stop_; })) {
        lk.unlock();
        auto changed = self->Reload();
        if (!changed.ok()) {
          Log("frontend", changed.status().message(), "; the last keys stay");
        } else if (*changed) {
          Log("frontend", "--api-keys-file read again: ", self->keys()->size(), " keys");
        }
        lk.lock();
      }
    });
  }
  return f;
}

KeyFile::~KeyFile() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (reader_.joinable()) reader_.join();
}

std::shared_ptr<const ApiKeys> KeyFile::keys() const {
  std::lock_guard lk(mu_);
  return keys_;
}

absl::StatusOr<bool> KeyFile::Reload() {
  auto text = ReadTextFile(path_);
  {
    std::lock_guard lk(mu_);
    // Unchanged, or the same text that failed last time (logged then).
    if (text.ok() && keys_ && (*text == text_ || *text == bad_text_)) return false;
  }
  if (!text.ok()) {
    failures_++;
    return text.status();
  }
  auto parsed = ApiKeys::Parse(*text, tpm_);
  if (!parsed.ok()) {
    failures_++;
    std::lock_guard lk(mu_);
    bad_text_ = std::move(*text);
    return parsed.status();
  }
  auto keys = std::make_shared<const ApiKeys>(std::move(*parsed));
  std::lock_guard lk(mu_);
  keys_ = std::move(keys);
  text_ = std::move(*text);
  reloads_++;
  return true;
}

const ApiKeys::Key* ApiKeys::Find(std::string_view authorization) const {
  constexpr absl::string_view kBearer = "Bearer ";
  const absl::string_view auth(authorization.data(), authorization.size());
  if (auth.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(auth.substr(0, kBearer.size()), kBearer)) {
    return nullptr;
  }
  const absl::string_view key = absl::StripAsciiWhitespace(auth.substr(kBearer.size()));
  auto it = keys_.find(Digest(std::string_view(key.data(), key.size())));
  return it == keys_.end() ? nullptr : &it->second;
}

std::optional<double> TokenRates::Take(const std::string& key, uint64_t tokens_per_minute,
                                       uint64_t tokens, int64_t now_ms) {
  if (tokens_per_minute == 0) return std::nullopt;
  const double capacity = static_cast<double>(tokens_per_minute);
  const double per_ms = capacity / 60000.0;
  if (static_cast<double>(tokens) > capacity) return std::numeric_limits<double>::infinity();
  std::lock_guard lk(mu_);
  // A key's first request finds a full minute's tokens.
  auto [it, fresh] = buckets_.try_emplace(key, Bucket{capacity, now_ms});
  Bucket& b = it->second;
  if (!fresh) {
    b.tokens = std::min(capacity, b.tokens + per_ms * static_cast<double>(now_ms - b.at_ms));
    b.at_ms = now_ms;
  }
  const double want = static_cast<double>(tokens);
  if (b.tokens >= want) {
    b.tokens -= want;
    return std::nullopt;
  }
  return (want - b.tokens) / per_ms / 1000.0;
}

Task<Admission::Slot> Admission::Enter(Refused* why, std::function<bool()> gone) {
  *why = Refused::kNone;
  if (limit_ == 0) co_return Slot();  // no limit: nothing is held
  const Executor here = co_await net::this_coro::executor;
  auto w = std::make_shared<Waiter>(Waiter{nullptr, here, false});
  {
    std::lock_guard lk(mu_);
    if (serving_ < limit_ && waiting_.empty()) {
      serving_++;
      co_return Slot(shared_from_this());
    }
    if (waiting_.size() >= queue_) {
      *why = Refused::kQueueFull;
      co_return Slot();
    }
    w->timer = std::make_shared<Timer>(w->executor);
    waiting_.push_back(w);
  }
  // Waits in slices of kGoneCheck (a grant cancels the wait at once).
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  for (;;) {
    w->timer->expires_at(std::min(until, Clock::now() + kGoneCheck));
    ErrorCode ec;
    co_await w->timer->async_wait(net::redirect_error(kAwait, ec));
    std::lock_guard lk(mu_);
    if (w->granted) co_return Slot(shared_from_this());  // handed over (maybe at its timeout too)
    const bool left = gone && gone();
    if (!left && Clock::now() < until) continue;
    std::erase(waiting_, w);
    *why = left ? Refused::kClientGone : Refused::kTimedOut;
    co_return Slot();
  }
}

void Admission::Close() {
  std::lock_guard lk(mu_);
  closed_ = true;
}

void Admission::Release() {
  std::lock_guard lk(mu_);
  if (closed_) return;
  if (waiting_.empty()) {
    serving_--;
    return;
  }
  // The slot passes to the first in line, woken on its own thread.
  std::shared_ptr<Waiter> next = waiting_.front();
  waiting_.pop_front();
  next->granted = true;
  net::post(next->executor, [timer = next->timer] { timer->cancel(); });
}

uint64_t Admission::waiting() const {
  std::lock_guard lk(mu_);
  return waiting_.size();
}

ApiError KeyRequired(bool presented) {
  return ApiError{401, "invalid_request_error",
                  presented ? "Incorrect API key provided."
                            : "You didn't provide an API key. Send it as an "
                              "Authorization: Bearer KEY header.",
                  "", "invalid_api_key"};
}

ApiError OverTokenRate(const ApiKeys::Key& key, uint64_t tokens, double wait_s) {
  if (std::isinf(wait_s)) {
    return ApiError{
        429, "tokens",
        absl::StrCat("Request too large for key ", key.name, " on tokens per min (TPM): Limit ",
                     key.tokens_per_minute, ", Requested ", tokens,
                     ". Send fewer prompt tokens or a smaller max_tokens."),
        "", "rate_limit_exceeded"};
  }
  return ApiError{
      429, "tokens",
      absl::StrCat("Rate limit reached for key ", key.name, " on tokens per min (TPM): Limit ",
                   key.tokens_per_minute, ", Requested ", tokens, ". Please try again in ",
                   std::ceil(wait_s * 10) / 10, "s."),
      "", "rate_limit_exceeded"};
}

ApiError QueueRefused(Admission::Refused why, uint64_t timeout_ms) {
  return ApiError{
      429, "requests",
      why == Admission::Refused::kQueueFull
          ? std::string("The frontend serves its most requests at once and its queue is full; "
                        "please try again.")
          : absl::StrCat("The request waited ", timeout_ms,
                         " ms in the frontend's queue without a turn; please try again."),
      "", "rate_limit_exceeded"};
}

}  // namespace kvtier::frontend
