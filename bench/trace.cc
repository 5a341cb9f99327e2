#include "bench/trace.h"

#include <fstream>
#include <list>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace kvtier {

namespace {
absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("trace line: ", what));
}

absl::StatusOr<uint64_t> UInt(const nlohmann::json& j, const char* field, uint64_t max) {
  auto it = j.find(field);
  if (it == j.end()) return Bad(absl::StrCat("field \"", field, "\" is missing"));
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0)) {
    return Bad(absl::StrCat("field \"", field, "\" is not a non-negative integer"));
  }
  uint64_t v = it->get<uint64_t>();
  if (v > max) return Bad(absl::StrCat("field \"", field, "\" = ", v, " is above ", max));
  return v;
}
}  // namespace

absl::StatusOr<TraceRequest> ParseTraceLine(std::string_view line) {
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
  if (j.is_discarded()) return Bad("not valid JSON");
  if (!j.is_object()) return Bad("not a JSON object");
  TraceRequest r;
  auto ts = UInt(j, "timestamp", uint64_t{1} << 50);
  if (!ts.ok()) return ts.status();
  auto in = UInt(j, "input_length", kTraceMaxInputTokens);
  if (!in.ok()) return in.status();
  auto out = UInt(j, "output_length", kTraceMaxInputTokens);
  if (!out.ok()) return out.status();
  r.timestamp_ms = *ts;
  r.input_length = static_cast<uint32_t>(*in);
  r.output_length = static_cast<uint32_t>(*out);
  auto ids = j.find("hash_ids");
  if (ids == j.end() || !ids->is_array()) return Bad("field \"hash_ids\" is missing or not a list");
  uint64_t want = (r.input_length + kTraceBlockTokens - 1) / kTraceBlockTokens;
  if (ids->size() != want) {
    return Bad(absl::StrCat("hash_ids has ", ids->size(), " entries; input_length ", r.input_length,
                            " needs ", want));
  }
  r.hash_ids.reserve(ids->size());
  for (const auto& id : *ids) {
    if (!id.is_number_unsigned() && !(id.is_number_integer() && id.get<int64_t>() >= 0)) {
      return Bad("hash_ids holds something other than non-negative integers");
    }
    r.hash_ids.push_back(id.get<uint64_t>());
  }
  return r;
}

absl::StatusOr<std::vector<TraceRequest>> ReadTrace(const std::string& path, size_t limit) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read trace file \"", path, "\""));
  std::vector<TraceRequest> out;
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto r = ParseTraceLine(line);
    if (!r.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_no, ": ", r.status().message()));
    }
    out.push_back(std::move(*r));
    if (limit && out.size() >= limit) break;
  }
  return out;
}

PrefixCacheFigures SharedPrefixCache(const std::vector<TraceRequest>& trace,
                                     uint64_t capacity_blocks) {
  PrefixCacheFigures f;
  std::list<uint64_t> order;  // front = most recent
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
  for (const auto& r : trace) {
    f.blocks += r.hash_ids.size();
    f.tokens += r.input_length;
    size_t k = 0;
    while (k < r.hash_ids.size() && where.count(r.hash_ids[k])) ++k;
    f.hit_blocks += k;
    f.hit_tokens += std::min<uint64_t>(uint64_t{k} * kTraceBlockTokens, r.input_length);
    for (uint64_t id : r.hash_ids) {
      auto it = where.find(id);
      if (it != where.end()) {
        order.splice(order.begin(), order, it->second);
        continue;
      }
      order.push_front(id);
      where[id] = order.begin();
      if (capacity_blocks && where.size() > capacity_blocks) {
        where.erase(order.back());
        order.pop_back();
      }
    }
  }
  return f;
}

}  // namespace kvtier
