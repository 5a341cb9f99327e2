// Prefill/decode through kvtier-frontend (docs/disaggregation.md): a long
// uncached prompt is computed on a prefill engine (chosen by prefix, in GPU
// and store, and queue) with max_tokens 1, and the decode engine is sent
// the prefill's kv_transfer_params. A failed handoff costs time, never a
// request: the decode engine then computes the prompt itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "frontend/asio.h"
#include "frontend/fleet.h"
#include "frontend/load.h"
#include "frontend/metrics.h"
#include "frontend/openai.h"
#include "frontend/relay.h"
#include "router/router_core.h"

namespace kvtier::frontend {

class Prefiller {
 public:
  Prefiller(router::RouterCore& core, Fleet& fleet, LoadBook& load, Counters& counters,
            Relay& relay);

  // The decode's kv_transfer_params, or nullopt when no prefill engine
  // could do it. `*note` explains it for the route header; `*client_gone`:
  // the client left meanwhile (the prefill was cancelled with it).
  Task<std::optional<nlohmann::json>> Prefill(const Prepared& p, Stream& client, std::string* note,
                                              bool* client_gone);

 private:
  router::RouterCore& core_;
  Fleet& fleet_;
  LoadBook& load_;
  Counters& counters_;
  Relay& relay_;
  // A handoff's kv_request_id: this frontend's random prefix and a count.
  const std::string prefix_;
  std::atomic<uint64_t> ids_{0};
};

}  // namespace kvtier::frontend
