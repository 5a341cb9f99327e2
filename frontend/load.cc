#include "frontend/load.h"

#include <algorithm>

namespace kvtier::frontend {

Ticket LoadBook::Charge(Engine& e, uint64_t prompt_tokens, uint64_t uncached) {
  Ticket t{static_cast<int64_t>(prompt_tokens),
           static_cast<int64_t>(std::min<uint64_t>(uncached, prompt_tokens)), false};
  e.requests++;
  e.in_flight++;
  e.waiting_tokens += t.uncached;
  e.waiting_requests++;
  Push(e, false);
  return t;
}

void LoadBook::Answered(Engine& e, Ticket* t) {
  if (t->answered) return;
  t->answered = true;
  e.waiting_tokens -= t->uncached;
  e.waiting_requests--;
  e.decoding_tokens += t->prompt_tokens;
  Push(e, false);
}

void LoadBook::Finish(Engine& e, Ticket* t) {
  e.in_flight--;
  if (!t->answered) {
    e.waiting_tokens -= t->uncached;
    e.waiting_requests--;
  } else {
    e.decoding_tokens -= t->prompt_tokens;
    if (decode_weight_ <= 0) return;  // no load the router sees changed
  }
  Push(e, false);
}

void LoadBook::Push(Engine& e, bool now) {
  router::SourceLoad load;
  const int64_t in_flight = std::max<int64_t>(0, e.in_flight.load());
  const uint64_t prompts = prompts_seen_.load();
  const double mean_uncached =
      prompts > 0 ? static_cast<double>(uncached_tokens_seen_.load()) / prompts : 0;
  std::lock_guard lk(e.mu);
  if (!e.events) return;
  const int64_t waiting = std::max<int64_t>(0, e.waiting_tokens.load());
  const int64_t decoding = std::max<int64_t>(0, e.decoding_tokens.load());
  load.queued_prefill_tokens =
      static_cast<uint64_t>(waiting) + static_cast<uint64_t>(e.foreign_waiting * mean_uncached) +
      static_cast<uint64_t>(decode_weight_ * static_cast<double>(decoding));
  load.running_requests =
      static_cast<uint32_t>(std::max<double>(e.vllm.running, static_cast<double>(in_flight)));
  if (e.vllm.kv_usage >= 0 && e.vllm.gpu_blocks > 0) {
    load.free_gpu_pages =
        static_cast<uint64_t>((1.0 - e.vllm.kv_usage) * static_cast<double>(e.vllm.gpu_blocks));
  }
  const int64_t t =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch())
          .count();
  const bool tell = now || t - e.last_push_us >= kPushEveryUs;
  if (tell) e.last_push_us = t;
  e.events->SetLoad(load, tell);
}

}  // namespace kvtier::frontend
