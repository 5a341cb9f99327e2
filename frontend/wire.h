// Messages on the wire as the frontend writes them on its hot paths: a
// request to an engine, a whole answer's head and a stream's chunks, each
// rendered into one buffer and sent with its body in one write. Beast's
// serializer makes a piece of every field and walks them through nested
// buffer views, which cost more than the bytes cost to send (a tenth of the
// frontend's CPU at short completions; docs/benchmarks.md).
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "frontend/asio.h"
#include "frontend/fleet.h"

namespace kvtier::frontend {

// A request to an engine: its start line and fields rendered in one
// buffer, the body sent from where it lies (which outlives this).
struct WireRequest {
  WireRequest(const Engine& e, const std::string& path, const std::string& body);
  std::array<net::const_buffer, 2> Buffers() const {
    return {net::buffer(head), net::buffer(*body)};
  }
  std::string head;
  const std::string* body;
};

// A whole answer's start line and fields: `status`, Server, the engine's
// Content-Type and Cache-Control from `upstream`, x-kvtier-route when
// `explain` is not empty, Connection: close unless `keep_alive`, and a
// Content-Length of `length`, in the order Beast writes them. None for a
// status whose answer carries no Content-Length (1xx, 204, 304).
std::optional<std::string> WholeAnswerHead(unsigned status, const http::fields& upstream,
                                           const std::string& explain, bool keep_alive,
                                           size_t length);

// One piece of an answer in HTTP/1.1's chunked coding (RFC 9112 7.1),
// with the stream's last chunk after it when `last`: its size line, the
// bytes and the end, as one write's buffers. `data` outlives it.
class ChunkWire {
 public:
  ChunkWire(std::string_view data, bool last);
  std::array<net::const_buffer, 3> Buffers() const;

 private:
  std::string size_line_;
  std::string_view data_;
  bool last_;
};

// A stream's last chunk alone.
inline constexpr std::string_view kLastChunk = "0\r\n\r\n";

}  // namespace kvtier::frontend
