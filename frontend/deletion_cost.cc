#include "frontend/deletion_cost.h"

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier::frontend {

namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;

namespace {

constexpr char kServiceAccount[] = "/var/run/secrets/kubernetes.io/serviceaccount/";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// "10.0.0.7:8000" -> "10.0.0.7" ("[::1]:8000" -> "::1").
std::string HostOf(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  std::string host = colon == std::string::npos ? endpoint : endpoint.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

absl::StatusOr<std::vector<EnginePod>> ParsePodList(absl::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("items") || !j["items"].is_array()) {
    return absl::InvalidArgumentError("the Kubernetes API's answer is not a PodList (no items)");
  }
  std::vector<EnginePod> out;
  for (const auto& item : j["items"]) {
    if (!item.is_object() || !item.contains("metadata") || !item["metadata"].is_object()) {
      return absl::InvalidArgumentError("a PodList item has no metadata");
    }
    const auto& md = item["metadata"];
    EnginePod pod;
    if (!md.contains("name") || !md["name"].is_string()) {
      return absl::InvalidArgumentError("a PodList item has no metadata.name");
    }
    pod.name = md["name"].get<std::string>();
    pod.terminating = md.contains("deletionTimestamp") && !md["deletionTimestamp"].is_null();
    if (md.contains("annotations") && md["annotations"].is_object() &&
        md["annotations"].contains(kDeletionCostAnnotation) &&
        md["annotations"][kDeletionCostAnnotation].is_string()) {
      int64_t v = 0;
      if (absl::SimpleAtoi(md["annotations"][kDeletionCostAnnotation].get<std::string>(), &v)) {
        pod.cost = v;
      }
    }
    if (item.contains("status") && item["status"].is_object() && item["status"].contains("podIP") &&
        item["status"]["podIP"].is_string()) {
      pod.ip = item["status"]["podIP"].get<std::string>();
    }
    out.push_back(std::move(pod));
  }
  return out;
}

std::vector<CostPatch> PlanDeletionCosts(const std::vector<router::SourceInfo>& sources,
                                         uint32_t block_tokens,
                                         const std::vector<EnginePod>& pods) {
  std::map<std::string, uint64_t> sole_by_host;
  for (const auto& s : sources) {
    if (s.kind != router::SourceKind::kWorker) continue;
    sole_by_host[HostOf(s.endpoint)] += s.sole_blocks;
  }
  std::vector<CostPatch> out;
  for (const auto& pod : pods) {
    if (pod.terminating || pod.ip.empty()) continue;
    const auto it = sole_by_host.find(pod.ip);
    const double tokens =
        it == sole_by_host.end() ? 0 : static_cast<double>(it->second) * block_tokens;
    const int64_t cost = static_cast<int64_t>(
        std::min(tokens, static_cast<double>(std::numeric_limits<int32_t>::max())));
    if (pod.cost) {
      const int64_t diff = std::abs(cost - *pod.cost);
      const int64_t larger = std::max(cost, *pod.cost);
      if (diff == 0 || diff < std::max<int64_t>(block_tokens, larger / 10)) continue;
    }
    out.push_back({pod.name, cost});
  }
  return out;
}

std::string DeletionCostPatchBody(int64_t cost) {
  nlohmann::json j;
  j["metadata"]["annotations"][kDeletionCostAnnotation] = std::to_string(cost);
  return j.dump();
}

absl::StatusOr<std::unique_ptr<DeletionCostUpdater>> DeletionCostUpdater::Start(
    DeletionCostOptions options, uint32_t block_tokens, SourcesFn sources) {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (host == nullptr || port == nullptr) {
    return absl::FailedPreconditionError(
        "--deletion-cost-selector: KUBERNETES_SERVICE_HOST/PORT are not set (the updater runs "
        "in a pod; leave the flag empty elsewhere)");
  }
  std::unique_ptr<DeletionCostUpdater> u(new DeletionCostUpdater());
  u->host_ = host;
  u->port_ = port;
  u->token_file_ = std::string(kServiceAccount) + "token";
  u->ca_file_ = std::string(kServiceAccount) + "ca.crt";
  if (ReadFile(u->token_file_).empty() || ReadFile(u->ca_file_).empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--deletion-cost-selector: no service account token or CA under ", kServiceAccount,
        " (automountServiceAccountToken: true, and a Role that may list and patch pods)"));
  }
  if (options.k8s_namespace.empty()) {
    options.k8s_namespace = ReadFile(std::string(kServiceAccount) + "namespace");
  }
  if (options.k8s_namespace.empty()) {
    return absl::FailedPreconditionError(
        "--deletion-cost-namespace is empty and the service account names no namespace");
  }
  u->options_ = std::move(options);
  u->block_tokens_ = block_tokens;
  u->sources_ = std::move(sources);
  DeletionCostUpdater* raw = u.get();
  u->thread_ = std::thread([raw] { raw->Loop(); });
  Log("frontend", "pod deletion costs: engine pods ", u->options_.selector, " in namespace ",
      u->options_.k8s_namespace, ", every ", u->options_.interval_ms, " ms");
  return u;
}

DeletionCostUpdater::~DeletionCostUpdater() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DeletionCostUpdater::AddMetrics(MetricsBuilder& m) const {
  m.Counter("kvtier_frontend_deletion_cost_patches_total", "Pod deletion costs patched.",
            static_cast<double>(patches_.load()));
  m.Counter("kvtier_frontend_deletion_cost_failed_rounds_total",
            "Rounds of deletion-cost updates that failed.",
            static_cast<double>(failed_rounds_.load()));
}

void DeletionCostUpdater::Loop() {
  for (;;) {
    {
      std::unique_lock lk(mu_);
      if (cv_.wait_for(lk, std::chrono::milliseconds(options_.interval_ms),
                       [&] { return stop_; })) {
        return;
      }
    }
    if (absl::Status s = Round(); !s.ok()) {
      failed_rounds_++;
      const auto now = std::chrono::steady_clock::now();
      if (now - last_logged_ >= std::chrono::minutes(1)) {
        last_logged_ = now;
        Log("frontend", "pod deletion costs not updated: ", s.ToString());
      }
    }
  }
}

absl::Status DeletionCostUpdater::Round() {
  const std::string ns = options_.k8s_namespace;
  std::string selector;
  for (char ch : options_.selector) {  // the selector as a query value
    if (std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.' ||
        ch == '/') {
      selector += ch;
    } else {
      selector += absl::StrCat("%", absl::Hex(static_cast<unsigned char>(ch), absl::kZeroPad2));
    }
  }
  auto list = Call("GET", absl::StrCat("/api/v1/namespaces/", ns, "/pods?labelSelector=", selector),
                   "", "");
  if (!list.ok()) return list.status();
  auto pods = ParsePodList(*list);
  if (!pods.ok()) return pods.status();
  for (const CostPatch& p : PlanDeletionCosts(sources_(), block_tokens_, *pods)) {
    auto r = Call("PATCH", absl::StrCat("/api/v1/namespaces/", ns, "/pods/", p.pod),
                  DeletionCostPatchBody(p.cost), "application/merge-patch+json");
    if (!r.ok()) return r.status();
    patches_++;
  }
  return absl::OkStatus();
}

// One call to the API server, each step within kCallTimeout (the exchange
// runs asynchronously on a local io_context, so a stalled server times out
// rather than holding the updater, and the frontend's shutdown, forever).
absl::StatusOr<std::string> DeletionCostUpdater::Call(const std::string& method,
                                                      const std::string& target,
                                                      const std::string& body,
                                                      const std::string& content_type) {
  const std::string what = absl::StrCat(method, " ", target, " to ", host_, ":", port_);
  try {
    net::io_context ioc;
    ssl::context ctx(ssl::context::tls_client);
    ctx.load_verify_file(ca_file_);
    ctx.set_verify_mode(ssl::verify_peer);
    ctx.set_verify_callback(ssl::host_name_verification(host_));
    beast::ssl_stream<beast::tcp_stream> stream(ioc, ctx);
    tcp::resolver resolver(ioc);
    http::request<http::string_body> req(http::string_to_verb(method), target, 11);
    req.set(http::field::host, host_);
    std::string token = ReadFile(token_file_);  // the kubelet rotates it
    while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
    req.set(http::field::authorization, "Bearer " + token);
    req.set(http::field::accept, "application/json");
    if (!body.empty()) {
      req.set(http::field::content_type, content_type);
      req.body() = body;
    }
    req.prepare_payload();
    beast::flat_buffer buf;
    http::response_parser<http::string_body> parser;
    parser.body_limit(kMaxAnswerBytes);  // a pod list of a large fleet is over Beast's 8 MiB
    beast::error_code ec;
    std::string step = "resolve";
    auto& tcp_layer = beast::get_lowest_layer(stream);
    auto fail = [&](const char* at, beast::error_code e) {
      ec = e;
      step = at;
    };
    // Each step chains the next; `ec` and `step` say where it ended.
    resolver.async_resolve(host_, port_, [&](beast::error_code e, tcp::resolver::results_type r) {
      if (e) return fail("resolve", e);
      tcp_layer.expires_after(kCallTimeout);
      tcp_layer.async_connect(r, [&](beast::error_code e, const tcp::endpoint&) {
        if (e) return fail("connect", e);
        tcp_layer.expires_after(kCallTimeout);
        stream.async_handshake(ssl::stream_base::client, [&](beast::error_code e) {
          if (e) return fail("TLS handshake", e);
          tcp_layer.expires_after(kCallTimeout);
          http::async_write(stream, req, [&](beast::error_code e, size_t) {
            if (e) return fail("write", e);
            tcp_layer.expires_after(kCallTimeout);
            http::async_read(stream, buf, parser, [&](beast::error_code e, size_t) {
              if (e) return fail("read", e);
              step = "done";
            });
          });
        });
      });
    });
    // The resolver has no timer of its own: the whole call is bounded too.
    ioc.run_for(4 * kCallTimeout);
    if (step != "done") {
      if (!ec) ec = beast::error::timeout;
      return absl::UnavailableError(absl::StrCat(what, ": ", step, ": ", ec.message()));
    }
    tcp_layer.expires_after(std::chrono::seconds(1));
    stream.async_shutdown([](beast::error_code) {});
    ioc.restart();
    ioc.run_for(std::chrono::seconds(1));
    http::response<http::string_body>& res = parser.get();
    if (res.result_int() / 100 != 2) {
      return absl::UnavailableError(absl::StrCat(method, " ", target, ": HTTP ", res.result_int(),
                                                 ": ", res.body().substr(0, 300)));
    }
    return std::move(res.body());
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(what, ": ", e.what()));
  }
}

}  // namespace kvtier::frontend
