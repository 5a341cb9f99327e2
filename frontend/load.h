// What kvtier-frontend tells the router of each engine's load: the prompt
// tokens it expects the engine to compute for the requests it sent there
// and has no answer to yet; for other frontends' requests, what vLLM says
// waits beyond those, priced at the mean uncached prompt seen here; the
// prompt tokens of the requests it is decoding, at decode_weight (each is a
// sequence every step of the next prefill shares: with no prefix to match,
// this is what spreads streams as least-connections would); vLLM's running
// requests; its free KV pages.
#pragma once

#include <atomic>
#include <cstdint>

#include "frontend/fleet.h"

namespace kvtier::frontend {

// One request sent to an engine, as its load: until the engine answers,
// the prompt tokens the route expected it to compute wait in its prefill
// queue (a prefix hit waits as its uncached tail, not its whole prompt);
// once answered, the whole prompt is a sequence it decodes.
struct Ticket {
  int64_t prompt_tokens = 0;
  int64_t uncached = 0;
  bool answered = false;
};

class LoadBook {
 public:
  explicit LoadBook(double decode_weight) : decode_weight_(decode_weight) {}

  // A request's first route: its uncached tokens price other frontends'
  // waiting requests.
  void Seen(uint64_t uncached) {
    uncached_tokens_seen_ += uncached;
    prompts_seen_++;
  }

  // The request goes to `e`. The load told from here holds it: the router
  // counted its route only until then.
  Ticket Charge(Engine& e, uint64_t prompt_tokens, uint64_t uncached);
  // Its answer began: its prefill is done, it decodes.
  void Answered(Engine& e, Ticket* t);
  // Its exchange with the engine ended, answered or not.
  void Finish(Engine& e, Ticket* t);

  // Tells the router `e`'s load: at once when `now` or none was told for
  // kPushEveryUs (a burst of answers is one update: each costs the
  // router's write lock), else with the next update or the engine's
  // heartbeat (each second). The router counts what it routed until the
  // engine's next update, which holds it.
  void Push(Engine& e, bool now);
  static constexpr int64_t kPushEveryUs = 2000;

 private:
  const double decode_weight_;
  std::atomic<uint64_t> uncached_tokens_seen_{0}, prompts_seen_{0};
};

}  // namespace kvtier::frontend
