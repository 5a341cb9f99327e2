// The frontend's flags: --engines-dns parsed, and the options checked as
// a whole before anything starts (frontend/server.h).
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "frontend/server.h"

namespace kvtier::frontend {

absl::Status ParseEnginesDns(absl::string_view text, FrontendOptions* options) {
  auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--engines-dns: ", why));
  };
  for (absl::string_view one : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    FrontendOptions::DnsPool pool;
    router::VllmSourceSpec& spec = pool.spec;
    for (absl::string_view part : absl::StrSplit(one, ',', absl::SkipWhitespace())) {
      const size_t eq = part.find('=');
      if (eq == absl::string_view::npos) {
        return bad(absl::StrCat("\"", part, "\" is not key=value"));
      }
      const std::string key(absl::StripAsciiWhitespace(part.substr(0, eq)));
      const std::string value(absl::StripAsciiWhitespace(part.substr(eq + 1)));
      auto port = [&](uint32_t* dst) {
        return absl::SimpleAtoi(value, dst) && *dst >= 1 && *dst <= 65535;
      };
      if (key == "name") {
        spec.endpoint = value;
      } else if (key == "events-port") {
        if (!port(&pool.events_port)) {
          return bad(absl::StrCat("events-port \"", value, "\" is not a port"));
        }
      } else if (key == "replay-port") {
        if (!port(&pool.replay_port)) {
          return bad(absl::StrCat("replay-port \"", value, "\" is not a port"));
        }
      } else if (key == "namespace") {
        if (value.size() != 16 || !absl::SimpleHexAtoi(value, &spec.namespace_id) ||
            spec.namespace_id == 0) {
          return bad(absl::StrCat("namespace \"", value, "\" must be 16 hex digits, not all 0"));
        }
      } else if (key == "block-tokens") {
        if (!absl::SimpleAtoi(value, &spec.block_tokens) ||
            spec.block_tokens < limits::kMinBlockTokens ||
            spec.block_tokens > limits::kMaxBlockTokens) {
          return bad(absl::StrCat("block-tokens \"", value, "\" must be ", limits::kMinBlockTokens,
                                  "..", limits::kMaxBlockTokens));
        }
      } else if (key == "role") {
        auto role = router::ParseEngineRole(value);
        if (!role.ok()) return bad(std::string(role.status().message()));
        spec.role = *role;
      } else {
        return bad(
            absl::StrCat("unknown key \"", key,
                         "\" (name, events-port, replay-port, namespace, block-tokens, role)"));
      }
    }
    const size_t colon = spec.endpoint.rfind(':');
    if (spec.endpoint.empty() || colon == std::string::npos || colon == 0 ||
        colon + 1 == spec.endpoint.size()) {
      return bad("name=HOST:PORT is missing");
    }
    if (pool.events_port == 0) {
      return bad(
          absl::StrCat(spec.endpoint, ": events-port is missing (vLLM's --kv-events-config port)"));
    }
    if (spec.namespace_id == 0) return bad(absl::StrCat(spec.endpoint, ": namespace is missing"));
    if (spec.block_tokens == 0) {
      return bad(absl::StrCat(spec.endpoint, ": block-tokens is missing"));
    }
    for (const auto& other : options->dns) {
      if (other.spec.endpoint == spec.endpoint) {
        return bad(absl::StrCat(spec.endpoint, " twice"));
      }
    }
    options->dns.push_back(std::move(pool));
  }
  if (options->dns.empty()) return bad("no name=HOST:PORT");
  return absl::OkStatus();
}

absl::Status ParseExtraModels(absl::string_view text, FrontendOptions* options) {
  auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--extra-models: ", why));
  };
  for (absl::string_view one : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    FrontendOptions::ExtraModel m;
    for (absl::string_view part : absl::StrSplit(one, ',', absl::SkipWhitespace())) {
      const size_t eq = part.find('=');
      if (eq == absl::string_view::npos)
        return bad(absl::StrCat("\"", part, "\" is not key=value"));
      const std::string key(absl::StripAsciiWhitespace(part.substr(0, eq)));
      const std::string value(absl::StripAsciiWhitespace(part.substr(eq + 1)));
      if (key == "name") {
        m.name = value;
      } else if (key == "model") {
        m.dir = value;
      } else if (key == "namespace") {
        if (value.size() != 16 || !absl::SimpleHexAtoi(value, &m.namespace_id) ||
            m.namespace_id == 0) {
          return bad(absl::StrCat("namespace \"", value, "\" must be 16 hex digits, not all 0"));
        }
      } else if (key == "lora-adapters") {
        for (absl::string_view a : absl::StrSplit(value, '|', absl::SkipWhitespace())) {
          m.adapters.emplace_back(a);
        }
      } else if (key == "max-model-len") {
        if (!absl::SimpleAtoi(value, &m.max_model_len)) {
          return bad(absl::StrCat("max-model-len \"", value, "\" is not a whole number"));
        }
      } else {
        return bad(absl::StrCat("unknown key \"", key,
                                "\" (name, model, namespace, lora-adapters, max-model-len)"));
      }
    }
    if (m.name.empty() || m.dir.empty() || m.namespace_id == 0) {
      return bad(absl::StrCat("\"", one, "\" needs name=, model= and namespace="));
    }
    options->extra_models.push_back(std::move(m));
  }
  return absl::OkStatus();
}

uint64_t FrontendOptions::FirstNamespace() const {
  auto claimed = [this](uint64_t ns) {
    return std::any_of(extra_models.begin(), extra_models.end(),
                       [ns](const ExtraModel& m) { return m.namespace_id == ns; });
  };
  for (const auto& e : engines) {
    if (!claimed(e.namespace_id)) return e.namespace_id;
  }
  for (const auto& d : dns) {
    if (!claimed(d.spec.namespace_id)) return d.spec.namespace_id;
  }
  return 0;
}

absl::Status FrontendOptions::Validate() const {
  if (served_model.empty()) return absl::InvalidArgumentError("--served-model-name is required");
  // Every name a request may send (models and adapters) means one model.
  std::set<std::string> names = {served_model};
  for (const auto& a : lora_adapters) {
    if (!names.insert(a).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lora-adapters: \"", a, "\" is the served model's own name or twice"));
    }
  }
  std::set<uint64_t> claimed;  // the extra models' namespaces
  for (const auto& m : extra_models) {
    for (const std::string& name : m.adapters) {
      if (!names.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("--extra-models: the name \"", name, "\" means two models"));
      }
    }
    if (!names.insert(m.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--extra-models: the name \"", m.name, "\" means two models"));
    }
    if (!claimed.insert(m.namespace_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--extra-models: ", m.name,
                       "'s namespace is another model's: each model's engines "
                       "key their blocks in a namespace of its own"));
    }
  }
  if (max_concurrent_requests > 0 && queue_timeout_ms == 0) {
    return absl::InvalidArgumentError("--queue-timeout must be > 0 with --max-concurrent-requests");
  }
  if (breaker_errors < 1) return absl::InvalidArgumentError("--breaker-errors: at least 1");
  if (retry_backoff_max_ms < retry_backoff_ms) {
    return absl::InvalidArgumentError("--retry-backoff-max is under --retry-backoff");
  }
  if (max_connections == 0) return absl::InvalidArgumentError("--max-connections must be >= 1");
  if (max_body_bytes_in_flight < max_body_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-body-bytes-in-flight (", max_body_bytes_in_flight, ") is under --max-body-bytes (",
        max_body_bytes, "): no largest body could be read"));
  }
  if (text_threads < 1 || text_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("--text-threads is ", text_threads, " (allowed 1..256)"));
  }
  if (engines.empty() && dns.empty()) {
    return absl::InvalidArgumentError("--engines or --engines-dns: at least one engine");
  }
  if (!deletion_cost.selector.empty() &&
      (deletion_cost.interval_ms < 1000 || deletion_cost.interval_ms > 3600000)) {
    return absl::InvalidArgumentError(absl::StrCat("--deletion-cost-interval is ",
                                                   deletion_cost.interval_ms,
                                                   " ms (allowed 1s..1h: Kubernetes asks that "
                                                   "pod-deletion-cost not churn)"));
  }
  // Every engine serves one model: one namespace and block size.
  std::vector<std::pair<std::string, const router::VllmSourceSpec*>> all;
  for (const auto& e : engines) all.emplace_back(e.id, &e);
  for (const auto& pool : dns) {
    const router::VllmSourceSpec& d = pool.spec;
    const size_t colon = d.endpoint.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == d.endpoint.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--engines-dns ", d.endpoint, " is not host:port"));
    }
    if (d.block_tokens == 0) {
      return absl::InvalidArgumentError("--engines-dns needs --block-tokens (vLLM's --block-size)");
    }
    if (pool.events_port > 65535 || pool.replay_port > 65535) {
      return absl::InvalidArgumentError("--engines-dns: events-port/replay-port: 1..65535");
    }
    all.emplace_back(absl::StrCat("(DNS ", d.endpoint, ")"), &d);
  }
  if (!dns.empty() && dns_interval_ms < 100) {
    return absl::InvalidArgumentError("--dns-interval: at least 100 ms");
  }
  // The first model's engines: those of the namespace no extra model
  // claims (one namespace); each model's engines share a block size.
  const uint64_t first = FirstNamespace();
  std::map<uint64_t, uint32_t> block_tokens_of;
  for (const auto& [name, e] : all) {
    auto [it, fresh] = block_tokens_of.try_emplace(e->namespace_id, e->block_tokens);
    if (!fresh && it->second != e->block_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engine ", name, ": the engines of one model (namespace) have one block-tokens"));
    }
    if (claimed.count(e->namespace_id)) continue;
    if (e->namespace_id != first) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engine ", name, ": its namespace is neither ", served_model,
          "'s (the other engines') nor an --extra-models one: every engine serves one model"));
    }
  }
  if (first == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no engine serves ", served_model, " (every engine's namespace is an --extra-models one)"));
  }
  for (const auto& m : extra_models) {
    if (!block_tokens_of.count(m.namespace_id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--extra-models: no engine has ", m.name, "'s namespace"));
    }
  }
  if (threads < 1 || threads > 256) return absl::InvalidArgumentError("--threads: 1..256");
  if (max_attempts < 1) return absl::InvalidArgumentError("--max-attempts: at least 1");
  if (!(decode_weight >= 0 && decode_weight <= 16)) {
    return absl::InvalidArgumentError("--decode-weight: 0..16");
  }
  // Roles pair: a prefill engine's requests need an engine that decodes.
  std::string prefill_only;
  bool decodes = false;
  for (const auto& [name, e] : all) {
    if (e->role == router::EngineRole::kPrefill) {
      prefill_only = name;
    } else {
      decodes = true;
    }
  }
  if (!prefill_only.empty() && !decodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--engines: engine ", prefill_only,
                     " has role=prefill but no engine decodes (role=decode or both): the "
                     "prefill's KV would have nowhere to go"));
  }
  std::set<std::string> ids;
  for (const auto& e : engines) {
    if (e.id.empty() || e.endpoint.empty()) {
      return absl::InvalidArgumentError("--engines: every engine needs id= and endpoint=");
    }
    if (!ids.insert(e.id).second) {
      return absl::InvalidArgumentError(absl::StrCat("--engines: engine id ", e.id, " twice"));
    }
    if (e.endpoint.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--engines: endpoint ", e.endpoint, " is not host:port"));
    }
  }
  return router.Validate();
}

}  // namespace kvtier::frontend
