#include "frontend/handoff.h"

#include <memory>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "frontend/choice.h"

namespace kvtier::frontend {

Prefiller::Prefiller(router::RouterCore& core, Fleet& fleet, LoadBook& load, Counters& counters,
                     Relay& relay)
    : core_(core),
      fleet_(fleet),
      load_(load),
      counters_(counters),
      relay_(relay),
      prefix_(absl::StrCat(absl::Hex(
          (uint64_t{std::random_device{}()} << 32) | std::random_device{}(), absl::kZeroPad16))) {}

Task<std::optional<nlohmann::json>> Prefiller::Prefill(const Prepared& p, Stream& client,
                                                       std::string* note, bool* client_gone) {
  const std::set<const Engine*> none;
  const std::shared_ptr<const FleetView> fleet = fleet_.Snapshot();
  Choice c = Choose(core_, p.namespace_id, *fleet, p.tokens, p.prompt_tokens, p.variant, none,
                    Want::kPrefill, counters_);
  if (c.engine == nullptr) {
    counters_.Handoff("no_prefill_engine");
    *note = "; prefill=none";
    co_return std::nullopt;
  }
  const std::shared_ptr<Engine> held = c.engine;
  Engine& e = *held;
  Ticket ticket = load_.Charge(e, p.prompt_tokens, c.uncached);
  auto watch = std::make_shared<Watch>();
  WatchClient(&client, watch);
  std::string answer;
  const std::string kv_request_id = absl::StrCat("kvtier-", prefix_, "-", ids_.fetch_add(1) + 1);
  const std::string body = PrefillBody(p, kv_request_id);
  const unsigned status = co_await relay_.Exchange(e, p.path, body, &answer, watch);
  watch->done = true;
  ErrorCode ignored;
  client.socket().cancel(ignored);
  load_.Finish(e, &ticket);
  if (watch->gone) {
    *client_gone = true;
    counters_.Handoff("client_gone");
    co_return std::nullopt;
  }
  std::optional<nlohmann::json> params;
  Handoff handoff;
  if (status == 200) handoff = HandoffOf(answer, kv_request_id);
  if (status == 200 && handoff.kind != Handoff::kNotSent) params = handoff.params;
  if (status == 200 && !params) {
    // It prefilled but handed nothing on (its store did not answer):
    // requests go colocated until it is tried again.
    fleet_.MarkDown(e, absl::StrCat("prefill answered without a handoff (", handoff.why, ")"));
  }
  if (!params) {
    counters_.Handoff("prefill_failed");
    Log("frontend", "prefill on ", e.spec.id, " gave no handoff (status ", status,
        "): the decode engine computes the prompt");
    *note = absl::StrCat("; prefill=", e.spec.id, " (failed: ", status, ")");
    co_return std::nullopt;
  }
  counters_.Handoff("handed_off");
  *note = absl::StrCat("; prefill=", e.spec.id, "; handoff_blocks=",
                       handoff.kind == Handoff::kFence
                           ? absl::StrCat((*params)["kvtier"].value("blocks", int64_t{0}))
                           : std::string("prompt"));
  co_return params;
}

}  // namespace kvtier::frontend
