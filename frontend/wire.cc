#include "frontend/wire.h"

#include "absl/strings/str_cat.h"

namespace kvtier::frontend {
namespace {

absl::string_view View(beast::string_view v) { return absl::string_view(v.data(), v.size()); }

}  // namespace

WireRequest::WireRequest(const Engine& e, const std::string& path, const std::string& body)
    : head(absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: ", e.spec.endpoint,
                        "\r\nContent-Type: application/json\r\nUser-Agent: kvtier-frontend"
                        "\r\nContent-Length: ",
                        body.size(), "\r\n\r\n")),
      body(&body) {}

std::optional<std::string> WholeAnswerHead(unsigned status, const http::fields& upstream,
                                           const std::string& explain, bool keep_alive,
                                           size_t length) {
  if (status < 200 || status == 204 || status == 304) return std::nullopt;
  std::string head = absl::StrCat("HTTP/1.1 ", status, " ",
                                  View(http::obsolete_reason(static_cast<http::status>(status))),
                                  "\r\nServer: kvtier-frontend\r\n");
  for (auto field : {http::field::content_type, http::field::cache_control}) {
    auto it = upstream.find(field);
    if (it != upstream.end()) {
      absl::StrAppend(&head, View(http::to_string(field)), ": ", View(it->value()), "\r\n");
    }
  }
  if (!explain.empty()) absl::StrAppend(&head, "x-kvtier-route: ", explain, "\r\n");
  if (!keep_alive) head += "Connection: close\r\n";
  absl::StrAppend(&head, "Content-Length: ", length, "\r\n\r\n");
  return head;
}

ChunkWire::ChunkWire(std::string_view data, bool last)
    : size_line_(absl::StrCat(absl::Hex(data.size()), "\r\n")), data_(data), last_(last) {}

std::array<net::const_buffer, 3> ChunkWire::Buffers() const {
  static constexpr std::string_view kEnd = "\r\n", kEndAndLast = "\r\n0\r\n\r\n";
  const std::string_view end = last_ ? kEndAndLast : kEnd;
  return {net::buffer(size_line_), net::const_buffer(data_.data(), data_.size()),
          net::const_buffer(end.data(), end.size())};
}

}  // namespace kvtier::frontend
