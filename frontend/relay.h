// One try at an engine: the request sent on a pooled connection (one fresh
// connection tried when a pooled one the engine closed while idle fails),
// and its answer relayed to the client: an unstreamed answer of known
// length whole, in one write; a stream chunk by chunk, an event stream in
// whole events. The client is watched meanwhile: one that leaves closes
// the upstream connection, which vLLM takes as an abort.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "frontend/asio.h"
#include "frontend/fleet.h"
#include "frontend/load.h"
#include "frontend/metrics.h"
#include "frontend/openai.h"
#include "frontend/wire.h"

namespace kvtier::frontend {

// How one try at an engine ended.
enum class Tried { kDone, kRetry, kClientGone };

// Watches the client's socket while the engine works: a peer that closed
// (readable with nothing to read) closes the upstream connection, which
// cancels what waits on it and tells vLLM to abort the request.
struct Watch {
  std::weak_ptr<Stream> upstream;  // the connection in use now
  bool gone = false;
  bool done = false;  // the try ended: a late wake-up touches nothing
};

// Starts watching `client` for `watch` (a plain handler on the client's
// thread, not a coroutine); ends when watch->done is set and the client's
// socket's waits are cancelled.
void WatchClient(Stream* client, std::shared_ptr<Watch> watch);

// Whether `client` has gone now (its end of stream or an error is
// waiting), without reading or waiting: bytes waiting are its next request.
bool ClientGone(Stream* client);

// The client's answer over the tries of one request: once an engine's
// event stream began it (its header written), another engine's events
// continue it.
struct ClientAnswer {
  bool head_sent = false;
  int status = 0;    // the status the client was answered
  bool cut = false;  // its stream ended short (the engine failed mid-stream)
};

class Relay {
 public:
  Relay(const FrontendOptions& options, const Fleet& fleet, LoadBook& load, size_t threads)
      : options_(options), fleet_(fleet), load_(load), threads_(threads) {}

  // Unstreamed answers up to this size are forwarded whole, in one write.
  static constexpr uint64_t kWholeAnswerBytes = 4 << 20;
  // Longest event held back for its end (an event stream forwards whole
  // events; vLLM's are a few hundred bytes, more with logprobs).
  static constexpr size_t kMaxEventBytes = 1 << 20;

  // `p` sent to `e` and its answer relayed to `client` (the route's
  // explanation in its header). kRetry: nothing reached the client and
  // another engine may answer; `*client_keep` false when the client's
  // connection cannot carry another request.
  Task<Tried> Forward(Engine& e, const Prepared& p, const std::string& explain, Stream& client,
                      bool keep_alive, bool* client_keep, Ticket* ticket, ClientAnswer* answer);

  // Ends a client's event stream with `json` as its last event (an error,
  // as vLLM ends a stream that failed) and [DONE]. False: the client is
  // gone.
  Task<bool> EndWithEvent(Stream& client, std::string json);

  // One whole unstreamed exchange with an engine (a prefill): the status
  // (0: no answer: the engine is skipped for --down, as is one answering
  // 5xx) and the answer's body in `out`.
  Task<unsigned> Exchange(Engine& e, const std::string& path, const std::string& body,
                          std::string* out, std::shared_ptr<Watch> watch);

 private:
  enum class Sent { kOk, kFailed, kClientGone };
  template <class Body>
  Task<Sent> Send(Engine& e, const WireRequest& req, bool whole, uint64_t body_limit,
                  beast::flat_buffer& ubuf, std::optional<http::response_parser<Body>>& parser,
                  std::shared_ptr<Stream>& up, Watch& watch, const char* what);
  Task<Tried> ForwardWatched(Engine& e, const Prepared& p, const std::string& explain,
                             Stream& client, bool keep_alive, bool* client_keep, Ticket* ticket,
                             ClientAnswer* answer, std::shared_ptr<Watch> watch);
  void Reuse(Engine& e, std::shared_ptr<Stream> up) const;

  const FrontendOptions& options_;
  const Fleet& fleet_;
  LoadBook& load_;
  const size_t threads_;
};

}  // namespace kvtier::frontend
