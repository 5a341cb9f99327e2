#include "frontend/relay.h"

#include <sys/socket.h>

#include <cerrno>
#include <limits>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "frontend/events.h"
#include "frontend/pool.h"
#include "frontend/wire.h"

namespace kvtier::frontend {
namespace {

enum class Peeked { kThere, kQuiet, kGone };
// Whether the client is gone now, without waiting: only an end of
// stream, or an error, is a client gone; bytes are its next request.
Peeked Peek(Stream* client) {
  char byte;
  const ssize_t n = ::recv(client->socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return Peeked::kThere;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Peeked::kQuiet;
  return Peeked::kGone;
}

// The client's answer header: the engine's status (set by the caller),
// content type and cache control, and the route's explanation.
template <class Body, class Upstream>
void AnswerHeader(http::response<Body>& res, const Upstream& upstream, const std::string& explain,
                  bool keep_alive) {
  res.set(http::field::server, "kvtier-frontend");
  for (auto field : {http::field::content_type, http::field::cache_control}) {
    auto it = upstream.find(field);
    if (it != upstream.end()) res.set(field, it->value());
  }
  if (!explain.empty()) res.set("x-kvtier-route", explain);
  res.keep_alive(keep_alive);
}

// The route header's value when --route-header is off: none.
const std::string kNoRoute;

}  // namespace

bool ClientGone(Stream* client) { return Peek(client) == Peeked::kGone; }

void WatchClient(Stream* client, std::shared_ptr<Watch> watch) {
  // Asio's reactor is edge-triggered and a wait is never tried at once:
  // a client that closed before this wait began (while its request was
  // read or routed) raises no new edge, so it is looked for first.
  switch (Peek(client)) {
    case Peeked::kThere:
      return;  // its next request: it is still there
    case Peeked::kGone:
      watch->gone = true;
      return;
    case Peeked::kQuiet:
      break;
  }
  client->socket().async_wait(tcp::socket::wait_read, [client, watch](const ErrorCode& ec) {
    if (ec || watch->done) return;  // cancelled: the exchange ended first
    // Readiness can be stale (the epoll edge of bytes the request's read
    // already took): Peek tells.
    switch (Peek(client)) {
      case Peeked::kThere:
        return;
      case Peeked::kQuiet:
        WatchClient(client, watch);
        return;
      case Peeked::kGone:
        break;
    }
    watch->gone = true;
    ErrorCode ignored;
    if (auto up = watch->upstream.lock()) up->socket().close(ignored);
  });
}

// The client is watched from the first byte sent upstream: one that
// leaves while the engine computes (before its answer starts) cancels
// the request too. The watcher ends with the try.
Task<Tried> Relay::Forward(Engine& e, const Prepared& p, const std::string& explain, Stream& client,
                           bool keep_alive, bool* client_keep, Ticket* ticket,
                           ClientAnswer* answer) {
  auto watch = std::make_shared<Watch>();
  WatchClient(&client, watch);
  const Tried t = co_await ForwardWatched(e, p, explain, client, keep_alive, client_keep, ticket,
                                          answer, watch);
  watch->done = true;
  ErrorCode ignored;
  client.socket().cancel(ignored);
  co_return t;
}

// Sends `req` to the engine on a pooled connection and reads its
// answer's header (`whole`: the whole answer) into `parser`, `up` the
// connection it came on. A pooled connection the engine closed while
// idle fails at once: one fresh connection is tried before the engine
// is blamed (skipped for --down, `what` naming the exchange in the log).
template <class Body>
Task<Relay::Sent> Relay::Send(Engine& e, const WireRequest& req, bool whole, uint64_t body_limit,
                              beast::flat_buffer& ubuf,
                              std::optional<http::response_parser<Body>>& parser,
                              std::shared_ptr<Stream>& up, Watch& watch, const char* what) {
  ErrorCode ec;
  for (int fresh = 0; fresh < 2; ++fresh) {
    if (watch.gone) co_return Sent::kClientGone;  // before a connection is taken
    parser.emplace();
    parser->body_limit(body_limit);
    ubuf.clear();
    auto pooled = fresh == 0 ? TakeIdle(e) : nullptr;
    const bool reused = pooled != nullptr;
    if (reused) {
      up = std::move(pooled);
    } else {
      auto made = co_await Connect(e, options_.connect_timeout_ms, ec);
      if (!made) {
        fleet_.MarkDown(e, absl::StrCat("connect: ", ec.message()));
        co_return Sent::kFailed;
      }
      up = std::move(made);
    }
    watch.upstream = up;
    if (watch.gone) co_return Sent::kClientGone;
    up->expires_after(std::chrono::milliseconds(options_.upstream_timeout_ms));
    co_await net::async_write(*up, req.Buffers(), net::redirect_error(kAwait, ec));
    if (!ec && whole) {
      co_await http::async_read(*up, ubuf, *parser, net::redirect_error(kAwait, ec));
    } else if (!ec) {
      co_await http::async_read_header(*up, ubuf, *parser, net::redirect_error(kAwait, ec));
    }
    if (watch.gone) co_return Sent::kClientGone;
    if (!ec) co_return Sent::kOk;
    // An answer larger than the frontend takes (a prefill with
    // prompt_logprobs) is the request's, not a failing engine's.
    if (ec == http::error::body_limit) co_return Sent::kFailed;
    if (reused) continue;
    fleet_.MarkDown(e, absl::StrCat(what, ": ", ec.message()));
    co_return Sent::kFailed;
  }
  co_return Sent::kFailed;
}

Task<Tried> Relay::ForwardWatched(Engine& e, const Prepared& p, const std::string& explain,
                                  Stream& client, bool keep_alive, bool* client_keep,
                                  Ticket* ticket, ClientAnswer* answer,
                                  std::shared_ptr<Watch> watch) {
  ErrorCode ec;
  std::shared_ptr<Stream> up;
  const WireRequest req(e, p.path, p.body);
  beast::flat_buffer ubuf;
  std::optional<http::response_parser<http::buffer_body>> parser;
  const uint64_t unlimited = std::numeric_limits<std::uint64_t>::max();
  const Sent sent = co_await Send(e, req, false, unlimited, ubuf, parser, up, *watch, "request");
  if (sent == Sent::kClientGone) co_return Tried::kClientGone;
  if (sent == Sent::kFailed) co_return Tried::kRetry;
  const unsigned status = parser->get().result_int();
  if (status >= 500) {
    // The request failed there: another engine may answer it. The engine
    // is skipped only when its answers fail --breaker-errors times in a row.
    fleet_.AnswerFailed(e, absl::StrCat("answered ", status));
    co_return Tried::kRetry;  // the connection is dropped with `up`
  }
  // An SSE event is a few hundred bytes: 4 KiB holds many, and a held
  // stream costs its coroutine frame, this buffer included.
  char chunk[4096];
  // A whole answer of known length (vLLM's unstreamed responses; not an
  // event stream) is read first and goes to the client in one write: one
  // send, as it came.
  const auto length = parser->content_length();
  const auto type = parser->get().find(http::field::content_type);
  const bool events = type != parser->get().end() && type->value().starts_with("text/event-stream");
  if (!parser->chunked() && !events && length && *length <= kWholeAnswerBytes) {
    load_.Answered(e, ticket);  // a whole answer comes once the engine is done
    std::string body;
    body.reserve(*length);
    ErrorCode rec;
    while (!parser->is_done() && !rec) {
      parser->get().body().data = chunk;
      parser->get().body().size = sizeof(chunk);
      up->expires_after(std::chrono::milliseconds(options_.upstream_timeout_ms));
      co_await http::async_read_some(*up, ubuf, *parser, net::redirect_error(kAwait, rec));
      if (rec == http::error::need_buffer) rec = {};
      body.append(chunk, sizeof(chunk) - parser->get().body().size);
    }
    if (watch->gone) co_return Tried::kClientGone;
    if (!parser->is_done()) {  // nothing reached the client: another engine may answer
      fleet_.MarkDown(e, absl::StrCat("answer cut short: ", rec.message()));
      co_return Tried::kRetry;
    }
    if (status == 200 && AbortedWithNoToken(body)) {  // a draining vLLM's
      fleet_.AnswerFailed(e, "aborted the request before its first token");
      co_return Tried::kRetry;
    }
    if (answer->head_sent) {
      // An engine tried before began the client's event stream: this
      // answer (an error) ends it as an event.
      *client_keep = false;
      const bool told = co_await EndWithEvent(client, body);
      co_return told ? Tried::kDone : Tried::kClientGone;
    }
    answer->status = static_cast<int>(status);
    const std::string& route = options_.route_header ? explain : kNoRoute;
    client.expires_after(std::chrono::milliseconds(options_.client_timeout_ms));
    if (auto head = WholeAnswerHead(status, parser->get(), route, keep_alive, body.size())) {
      const std::array<net::const_buffer, 2> pieces{net::buffer(*head), net::buffer(body)};
      co_await net::async_write(client, pieces, net::redirect_error(kAwait, ec));
    } else {
      http::response<http::string_body> res{static_cast<http::status>(status), 11};
      AnswerHeader(res, parser->get(), route, keep_alive);
      res.body() = std::move(body);
      res.prepare_payload();
      co_await http::async_write(client, res, net::redirect_error(kAwait, ec));
    }
    client.expires_never();
    if (ec) {
      *client_keep = false;
      co_return Tried::kClientGone;
    }
    if (!watch->gone && parser->get().keep_alive()) {
      Reuse(e, std::move(up));
    }
    co_return Tried::kDone;
  }
  // A stream. vLLM sends its header before the prefill and its first
  // event with the first token: the client has the header at once (the
  // first engine's route in it), and the request is committed to an
  // engine at its first event. An engine failing before then leaves the
  // request to another, whose events continue the same stream. From the
  // first event on, the client has the engine's bytes chunk by chunk as
  // the engine writes them; no other engine is tried.
  if (!answer->head_sent) {
    http::response<http::empty_body> res{static_cast<http::status>(status), 11};
    AnswerHeader(res, parser->get(), options_.route_header ? explain : "", keep_alive);
    res.chunked(true);
    http::response_serializer<http::empty_body> sr{res};
    client.expires_after(std::chrono::milliseconds(options_.client_timeout_ms));
    co_await http::async_write_header(client, sr, net::redirect_error(kAwait, ec));
    answer->head_sent = true;
    answer->status = static_cast<int>(status);
  }
  // This engine's answer reached the client: its first token (or, not an
  // event stream, its first bytes). Keep-alive comments before it are
  // passed on without committing; events that answer nothing yet wait in
  // `held` (a stream that ends with only those goes to another engine).
  bool committed = false;
  bool ended = false;  // the client has the stream's last chunk
  std::string held;
  Tried outcome = Tried::kDone;
  // An event stream goes to the client in whole events. A read of the
  // engine's backlog (a stream the frontend fell behind on) can end
  // mid-event, and a client that parses each read on its own misreads
  // the event cut in two: vLLM's own `vllm bench serve` strips every
  // read, so "data:" at a read's end and " {...}" at the next one's start
  // become "data:{...}", which it fails to parse. What follows the last
  // event's end waits here for the rest of its event (never a whole
  // event; all of it past kMaxEventBytes, or at the stream's end).
  std::string carry;
  while (!ec && !parser->is_done()) {
    parser->get().body().data = chunk;
    parser->get().body().size = sizeof(chunk);
    up->expires_after(std::chrono::milliseconds(options_.upstream_timeout_ms));
    ErrorCode rec;
    co_await http::async_read_some(*up, ubuf, *parser, net::redirect_error(kAwait, rec));
    if (rec == http::error::need_buffer) rec = {};
    std::string_view got(chunk, sizeof(chunk) - parser->get().body().size);
    size_t from_carry = 0;  // the head of carry that `got` is, sent below
    if (events && (!carry.empty() || SseEventsEnd(got) != got.size())) {
      carry.append(got);
      from_carry = SseEventsEnd(carry);
      if (rec || parser->is_done() || carry.size() > kMaxEventBytes) from_carry = carry.size();
      got = std::string_view(carry).substr(0, from_carry);
    }
    if (!committed && events && FailsBeforeItsFirstToken(got)) {
      // The engine failed before the first token (its core died): nothing
      // of it reached the client, and another engine may answer.
      fleet_.AnswerFailed(e, "failed before its first token");
      co_return Tried::kRetry;  // the connection is dropped with `up`
    }
    std::string flushed;  // what was held, then this piece
    bool answers = !events;
    if (!committed && events && !got.empty()) {
      const StreamPiece piece = ClassifyEvents(got);
      if (piece == StreamPiece::kNoAnswer) {
        held.append(got);
        got = {};
      } else if (piece == StreamPiece::kAnswer) {
        answers = true;
        if (!held.empty()) {
          flushed = std::move(held);
          held.clear();
          flushed.append(got);
          got = flushed;
        }
      }
    }
    if (!got.empty()) {
      // vLLM sends a stream's header at once, its first event with the
      // first token: until then the prompt waits in its prefill queue (a
      // keep-alive comment, --sse-keep-alive-interval, is no answer).
      if (!ticket->answered && (!events || got.find("data:") != std::string_view::npos)) {
        load_.Answered(e, ticket);
      }
      // A client that stops reading is cut after the client timeout,
      // freeing the engine's connection.
      client.expires_after(std::chrono::milliseconds(options_.client_timeout_ms));
      committed = committed || answers;
      // The engine's answer ended with this piece: the stream's end goes
      // in the same write.
      ended = committed && !rec && parser->is_done() && !watch->gone;
      const ChunkWire piece(got, ended);
      co_await net::async_write(client, piece.Buffers(), net::redirect_error(kAwait, ec));
    }
    carry.erase(0, from_carry);
    if (rec && !ec && !committed && !watch->gone) {
      // Nothing reached the client: another engine may answer.
      fleet_.MarkDown(e, absl::StrCat("failed before its first event: ", rec.message()));
      co_return Tried::kRetry;
    }
    if (rec && !ec) {
      // The client left (the watcher closed the engine's connection: an
      // SSE client may close once it read [DONE]), or the engine failed
      // mid-response: then the client's stream ends short (no last
      // chunk), which it sees as an error, not as a whole answer.
      if (!watch->gone) {
        Log("frontend", "engine ", e.spec.id, " failed mid-response: ", rec.message());
        e.failures++;
        answer->cut = true;
      }
      *client_keep = false;
      outcome = watch->gone ? Tried::kClientGone : Tried::kDone;
      break;
    }
  }
  ErrorCode ignored;
  // A client that closed once it read the stream's end (sent with its last
  // piece) had its whole answer.
  if (ec || (watch->gone && !ended)) {
    *client_keep = false;
    up->socket().close(ignored);
    co_return Tried::kClientGone;
  }
  if (outcome == Tried::kDone && !committed && !held.empty()) {
    // The stream ended with no token: vLLM aborted the request (a draining
    // engine does with one that reached it after SIGTERM). Nothing of it
    // reached the client: another engine may answer.
    fleet_.AnswerFailed(e, "ended its stream with no token");
    co_return Tried::kRetry;
  }
  if (outcome != Tried::kDone || !parser->is_done()) {
    *client_keep = false;
    co_return outcome;
  }
  if (!ended) {
    client.expires_after(std::chrono::milliseconds(options_.client_timeout_ms));
    co_await net::async_write(client, net::buffer(kLastChunk), net::redirect_error(kAwait, ec));
  }
  client.expires_never();
  if (ec || watch->gone) *client_keep = false;
  // The watcher closes the engine's connection when the client leaves.
  if (!watch->gone && parser->get().keep_alive()) {
    Reuse(e, std::move(up));
  }
  co_return Tried::kDone;
}

// One whole unstreamed exchange with an engine (a prefill): the status
// (0: no answer: the engine is skipped for --down, as is one answering
// 5xx) and the answer's body in `out`. The client is watched meanwhile.
Task<unsigned> Relay::Exchange(Engine& e, const std::string& path, const std::string& body,
                               std::string* out, std::shared_ptr<Watch> watch) {
  std::shared_ptr<Stream> up;
  const WireRequest req(e, path, body);
  beast::flat_buffer ubuf;
  std::optional<http::response_parser<http::string_body>> parser;
  const uint64_t limit = kWholeAnswerBytes;
  const Sent sent = co_await Send(e, req, true, limit, ubuf, parser, up, *watch, "prefill");
  if (sent != Sent::kOk) co_return 0u;
  const unsigned status = parser->get().result_int();
  *out = std::move(parser->get().body());
  if (status >= 500) {
    fleet_.AnswerFailed(e, absl::StrCat("prefill answered ", status));
  } else if (parser->get().keep_alive()) {
    Reuse(e, std::move(up));
  }
  co_return status;
}
Task<bool> Relay::EndWithEvent(Stream& client, std::string json) {
  const std::string events = absl::StrCat("data: ", json, "\n\ndata: [DONE]\n\n");
  ErrorCode ec;
  client.expires_after(std::chrono::milliseconds(options_.client_timeout_ms));
  const ChunkWire piece(events, true);
  co_await net::async_write(client, piece.Buffers(), net::redirect_error(kAwait, ec));
  client.expires_never();
  co_return !ec;
}

void Relay::Reuse(Engine& e, std::shared_ptr<Stream> up) const {
  up->expires_never();
  ReturnIdle(e, std::move(up), options_.idle_per_engine / threads_);
}

}  // namespace kvtier::frontend
