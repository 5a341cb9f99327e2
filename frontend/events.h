// What an engine's answer says before any of it reaches the client: the
// frontend may still send the request to another engine until an engine's
// answer carries a token. Pure functions: tests/openai_test.cc.
#pragma once

#include <cstddef>
#include <string_view>

namespace kvtier::frontend {

// Where the last whole event of a piece of an SSE stream ends: just past
// the last blank line ("\n\n" or "\r\n\r\n"), 0 when no event in it is
// whole. A stream is forwarded up to there; the rest waits for its end.
size_t SseEventsEnd(std::string_view s);

// Whether a piece of an SSE stream that no token of came before opens
// with the engine's own failure: vLLM's `data: {"error": {..., "code":
// 5xx}}`, sent in place of the first token when its engine core died
// (comments before it skipped). A client's error (4xx) is not one.
bool FailsBeforeItsFirstToken(std::string_view events);

// What whole SSE events of an engine's stream hold, before its first token:
//   kAnswer:   an event that answers (a choice with text, a delta with
//              content, reasoning or tool calls, a finish reason other
//              than "abort"; an error; anything that is not an event the
//              frontend knows): the client's from here on.
//   kNoAnswer: data that answers nothing yet: a chat's role delta, a
//              usage-only event, a choice vLLM aborted with no token,
//              "[DONE]". vLLM ends a request it aborted before its first
//              token (a draining engine's, after SIGTERM) with exactly
//              that; the frontend holds it back, and a stream that ends
//              with nothing else goes to another engine.
//   kComments: comments only (keep-alives), or nothing.
enum class StreamPiece { kAnswer, kNoAnswer, kComments };
StreamPiece ClassifyEvents(std::string_view events);

// Whether an engine's whole (unstreamed) answer is a request vLLM aborted
// before its first token: a JSON object whose choices are all finished
// "abort" with no text (nor message content) and whose usage counts no
// completion token. Another engine may answer it.
bool AbortedWithNoToken(std::string_view body);

}  // namespace kvtier::frontend
