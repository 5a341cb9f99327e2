// kvctl: the operator CLI for kvtier-store shards and kvtier-router.
//
// Exit codes: 0 done; 1 a service refused the request (its message is
// printed); 2 bad usage; 3 a service could not be reached; 4 the operator
// declined a confirmation.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/block_key.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/store_client.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvtier/v1/router.grpc.pb.h"

namespace kvtier::cli {
namespace {

constexpr int kOk = 0, kRefused = 1, kUsage = 2, kUnreachable = 3, kDeclined = 4;

int Report(const absl::Status& s, const std::string& what) {
  bool unreachable = s.code() == absl::StatusCode::kUnavailable ||
                     s.code() == absl::StatusCode::kDeadlineExceeded;
  std::fprintf(stderr, "kvctl: %s: %s%s\n", what.c_str(), std::string(s.message()).c_str(),
               unreachable ? " (is it running? check the address, --store/--router or "
                             "KVTIER_STORE/KVTIER_ROUTER)"
                           : "");
  return unreachable ? kUnreachable : kRefused;
}

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// Common flags of every subcommand.
struct Common {
  std::string stores = EnvOr("KVTIER_STORE", "127.0.0.1:7400");
  std::string router = EnvOr("KVTIER_ROUTER", "127.0.0.1:7500");
  bool json = false;
  uint64_t timeout_ms = 5000;
  std::string admin_token_file;
  TlsFlags tls{EnvOr("KVTIER_TLS_CERT", ""), EnvOr("KVTIER_TLS_KEY", ""), EnvOr("KVTIER_TLS_CA", ""),
               false, EnvOr("KVTIER_TLS_SERVER_NAME", "")};
  void Register(FlagSet& f, bool store, bool router_flag) {
    AddTlsFlags(f, &tls, /*serves=*/false, /*dials=*/true);
    if (store) {
      f.String("admin-token-file", &admin_token_file,
               "File with the store's admin token (policy set, evict) [env KVTIER_ADMIN_TOKEN]");
    }
    if (store) {
      f.String("store", &stores,
               "Store shard address(es), comma-separated [env KVTIER_STORE]");
    }
    if (router_flag) f.String("router", &router, "Router address [env KVTIER_ROUTER]");
    f.Bool("json", &json, "Print JSON for scripts");
    f.DurationMs("timeout", &timeout_ms, "Deadline of each call");
  }
  std::vector<std::string> StoreList() const {
    std::vector<std::string> out;
    for (absl::string_view s : absl::StrSplit(stores, ',', absl::SkipEmpty())) out.emplace_back(s);
    return out;
  }
  // TLS per --tls-ca/--tls-cert/--tls-key (or KVTIER_TLS_*); exits 2 on a
  // bad file.
  ChannelSecurity Security() const {
    absl::StatusOr<ChannelSecurity> sec = ClientSecurity(tls);
    if (!sec.ok()) {
      std::fprintf(stderr, "kvctl: %s\n", std::string(sec.status().message()).c_str());
      std::exit(kUsage);
    }
    return *sec;
  }
  StoreClientOptions ClientOptions() const {
    StoreClientOptions o;
    o.security = Security();
    o.deadline_ms = static_cast<int>(timeout_ms);
    o.admin_token = EnvOr("KVTIER_ADMIN_TOKEN", "");
    if (!admin_token_file.empty()) {
      std::ifstream in(admin_token_file);
      std::getline(in, o.admin_token);
    }
    return o;
  }
};

std::string Ratio(uint64_t hits, uint64_t misses) {
  return hits + misses ? absl::StrFormat("%.1f%%", 100.0 * hits / (hits + misses)) : "-";
}

nlohmann::json TierJson(const v1::TierStats& t) {
  return {{"capacity_bytes", t.capacity_bytes()}, {"used_bytes", t.used_bytes()},
          {"items", t.items()},                   {"hits", t.hits()},
          {"misses", t.misses()},                 {"hit_ratio", t.hits() + t.misses() ? double(t.hits()) / (t.hits() + t.misses()) : 0.0},
          {"evictions", t.evictions()},           {"promotions", t.promotions()},
          {"demotions", t.demotions()},           {"bytes_in", t.bytes_in()},
          {"bytes_out", t.bytes_out()},           {"policy", t.policy()},
          {"degraded", t.degraded()},             {"degraded_reason", t.degraded_reason()}};
}

void Add(v1::TierStats* sum, const v1::TierStats& t) {
  sum->set_capacity_bytes(sum->capacity_bytes() + t.capacity_bytes());
  sum->set_used_bytes(sum->used_bytes() + t.used_bytes());
  sum->set_items(sum->items() + t.items());
  sum->set_hits(sum->hits() + t.hits());
  sum->set_misses(sum->misses() + t.misses());
  sum->set_evictions(sum->evictions() + t.evictions());
  sum->set_promotions(sum->promotions() + t.promotions());
  sum->set_demotions(sum->demotions() + t.demotions());
  sum->set_bytes_in(sum->bytes_in() + t.bytes_in());
  sum->set_bytes_out(sum->bytes_out() + t.bytes_out());
  if (sum->policy().empty()) sum->set_policy(t.policy());
  else if (sum->policy() != t.policy()) sum->set_policy("mixed");
  sum->set_degraded(sum->degraded() || t.degraded());
}

int Stats(int argc, const char* const* argv) {
  Common c;
  bool watch = false;
  uint64_t interval_ms = 2000;
  FlagSet f("kvctl stats", "Per-tier statistics of every store shard, and their sum.");
  c.Register(f, true, false);
  f.Bool("watch", &watch, "Refresh in place until interrupted");
  f.DurationMs("interval", &interval_ms, "Refresh period with --watch");
  ParseFlagsOrExit(f, argc, argv);
  for (bool first = true;; first = false) {
    std::vector<std::pair<std::string, v1::GetStatsResponse>> shards;
    for (const auto& addr : c.StoreList()) {
      StoreClient client(addr, c.ClientOptions());
      auto s = client.GetStats();
      if (!s.ok()) return Report(s.status(), "store " + addr);
      shards.emplace_back(addr, *s);
    }
    v1::TierStats sum[2];
    for (const auto& [a, s] : shards) {
      for (int t = 0; t < s.tiers_size() && t < 2; ++t) Add(&sum[t], s.tiers(t));
    }
    if (c.json) {
      nlohmann::json j;
      for (const auto& [a, s] : shards) {
        nlohmann::json shard = {{"address", a},
                                {"demotion_queue_blocks", s.demotion_queue_blocks()},
                                {"demotion_queue_dropped", s.demotion_queue_dropped()},
                                {"put_leases", s.put_leases()},
                                {"get_leases", s.get_leases()},
                                {"checksum_failures", s.checksum_failures()}};
        for (const auto& t : s.tiers()) shard["tiers"][t.tier() == v1::TIER_RAM ? "ram" : "disk"] = TierJson(t);
        j["shards"].push_back(shard);
      }
      j["total"]["tiers"]["ram"] = TierJson(sum[0]);
      j["total"]["tiers"]["disk"] = TierJson(sum[1]);
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      if (watch && !first) std::printf("\033[H\033[2J");
      auto row = [](const std::string& shard, const char* tier, const v1::TierStats& t) {
        std::printf("%-22s %-5s %-7s %11s %11s %9lu %7s %10lu %10lu %10lu %11s %11s%s\n", shard.c_str(),
                    tier, t.policy().c_str(), FormatBytes(t.capacity_bytes()).c_str(),
                    FormatBytes(t.used_bytes()).c_str(), t.items(), Ratio(t.hits(), t.misses()).c_str(),
                    t.evictions(), t.promotions(), t.demotions(), FormatBytes(t.bytes_in()).c_str(),
                    FormatBytes(t.bytes_out()).c_str(), t.degraded() ? "  DEGRADED" : "");
      };
      std::printf("%-22s %-5s %-7s %11s %11s %9s %7s %10s %10s %10s %11s %11s\n", "shard", "tier",
                  "policy", "capacity", "used", "items", "hits", "evictions", "promotions",
                  "demotions", "bytes in", "bytes out");
      for (const auto& [a, s] : shards) {
        for (const auto& t : s.tiers()) row(a, t.tier() == v1::TIER_RAM ? "ram" : "disk", t);
      }
      if (shards.size() > 1) {
        row("total", "ram", sum[0]);
        row("total", "disk", sum[1]);
      }
    }
    if (!watch) return kOk;
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
}

int Policy(int argc, const char* const* argv) {
  if (argc < 2 || (std::string(argv[1]) != "get" && std::string(argv[1]) != "set")) {
    std::fprintf(stderr, "kvctl policy: say get or set (kvctl policy set --tier ram sieve)\n");
    return kUsage;
  }
  bool set = std::string(argv[1]) == "set";
  Common c;
  std::string tier = "ram", params;
  FlagSet f(set ? "kvctl policy set" : "kvctl policy get",
            set ? "Switch a tier's eviction policy on every shard (no block is dropped).\n"
                  "Usage: kvctl policy set --tier ram|disk lru|s3fifo|sieve [--param small_fraction=0.2]"
                : "Show each tier's eviction policy on every shard.");
  c.Register(f, true, false);
  if (set) {
    f.Choice("tier", &tier, {"ram", "disk"}, "Tier to change");
    f.String("param", &params, "Policy parameters, name=value[,name=value]");
  }
  std::vector<std::string> pos;
  ParseFlagsOrExit(f, argc - 1, argv + 1, &pos);
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client(addr, c.ClientOptions());
    if (set) {
      if (pos.size() != 1) {
        std::fprintf(stderr, "kvctl policy set: name one policy: lru, s3fifo or sieve\n");
        return kUsage;
      }
      v1::SetPolicyRequest req;
      req.mutable_policy()->set_tier(tier == "ram" ? v1::TIER_RAM : v1::TIER_DISK);
      req.mutable_policy()->set_policy(pos[0]);
      for (absl::string_view kv : absl::StrSplit(params, ',', absl::SkipEmpty())) {
        std::vector<std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
        double v;
        if (p.size() != 2 || !absl::SimpleAtod(p[1], &v)) {
          std::fprintf(stderr, "kvctl policy set: --param \"%s\" is not name=number\n",
                       std::string(kv).c_str());
          return kUsage;
        }
        (*req.mutable_policy()->mutable_params())[p[0]] = v;
      }
      v1::SetPolicyResponse resp;
      auto ctx = client.Context();
      auto s = client.stub().SetPolicy(ctx.get(), req, &resp);
      if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
      if (!c.json) std::printf("%s: %s tier now uses %s\n", addr.c_str(), tier.c_str(), resp.policy().policy().c_str());
      j[addr][tier] = resp.policy().policy();
    } else {
      v1::GetPolicyResponse resp;
      auto ctx = client.Context();
      auto s = client.stub().GetPolicy(ctx.get(), {}, &resp);
      if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
      for (const auto& p : resp.policies()) {
        std::string t = p.tier() == v1::TIER_RAM ? "ram" : "disk";
        std::string ps;
        for (const auto& [k, v] : p.params()) absl::StrAppend(&ps, " ", k, "=", v);
        if (!c.json) std::printf("%-22s %-5s %s%s\n", addr.c_str(), t.c_str(), p.policy().c_str(), ps.c_str());
        j[addr][t] = p.policy();
      }
    }
  }
  if (c.json) std::printf("%s\n", j.dump(2).c_str());
  return kOk;
}

absl::StatusOr<uint64_t> ParseNs(const std::string& s) {
  uint64_t v;
  if (s.empty() || !absl::SimpleHexAtoi(s, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("namespace \"", s, "\" is not a hex id"));
  }
  return v;
}

int Evict(int argc, const char* const* argv) {
  Common c;
  bool all = false, yes = false;
  std::string ns, keys;
  FlagSet f("kvctl evict",
            "Drop blocks from every tier of every shard: --all, --namespace NS, or --key NS:HASH "
            "(repeatable as a comma list). Asks for confirmation unless --yes.");
  c.Register(f, true, false);
  f.Bool("all", &all, "Every block of every namespace");
  f.String("namespace", &ns, "Every block of this namespace (hex id)");
  f.String("key", &keys, "Blocks NS:HASH (hex), comma-separated");
  f.Bool("yes", &yes, "Do not ask");
  ParseFlagsOrExit(f, argc, argv);
  int targets = all + !ns.empty() + !keys.empty();
  if (targets != 1) {
    std::fprintf(stderr, "kvctl evict: give exactly one of --all, --namespace, --key\n");
    return kUsage;
  }
  v1::EvictRequest req;
  std::string what;
  if (all) {
    req.set_all(true);
    what = "EVERY block";
  } else if (!ns.empty()) {
    auto id = ParseNs(ns);
    if (!id.ok()) {
      std::fprintf(stderr, "kvctl evict: %s\n", std::string(id.status().message()).c_str());
      return kUsage;
    }
    req.set_namespace_id(*id);
    what = "every block of namespace " + ns;
  } else {
    for (absl::string_view k : absl::StrSplit(keys, ',', absl::SkipEmpty())) {
      std::vector<std::string> p = absl::StrSplit(k, ':');
      auto id = p.size() == 2 ? ParseNs(p[0]) : absl::StatusOr<uint64_t>(absl::InvalidArgumentError("x"));
      auto h = p.size() == 2 ? BlockHashFromHex(p[1]) : absl::StatusOr<BlockHash>(absl::InvalidArgumentError("x"));
      if (!id.ok() || !h.ok()) {
        std::fprintf(stderr, "kvctl evict: --key \"%s\" is not NS:HASH (hex namespace id, 32 hex digits)\n",
                     std::string(k).c_str());
        return kUsage;
      }
      auto* key = req.mutable_keys()->add_keys();
      key->set_namespace_id(*id);
      ToProto(*h, key->mutable_hash());
    }
    what = absl::StrCat(req.keys().keys_size(), " block(s)");
  }
  if (!yes) {
    if (!isatty(0)) {
      std::fprintf(stderr, "kvctl evict: would drop %s from %s; not a terminal, so pass --yes to confirm\n",
                   what.c_str(), c.stores.c_str());
      return kDeclined;
    }
    std::fprintf(stderr, "Drop %s from %s? Type yes to confirm: ", what.c_str(), c.stores.c_str());
    std::string answer;
    std::getline(std::cin, answer);
    if (answer != "yes") {
      std::fprintf(stderr, "kvctl evict: not confirmed; nothing dropped\n");
      return kDeclined;
    }
  }
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client(addr, c.ClientOptions());
    auto r = client.Evict(req);
    if (!r.ok() && !ns.empty() && r.status().code() == absl::StatusCode::kNotFound) {
      // A namespace only some shards have seen: nothing to drop on this one.
      if (!c.json) std::printf("%s: namespace %s is not registered here; nothing to drop\n", addr.c_str(), ns.c_str());
      j[addr] = {{"ram_blocks", 0}, {"disk_blocks", 0}, {"pinned_blocks", 0}};
      continue;
    }
    if (!r.ok()) return Report(r.status(), "store " + addr);
    if (!c.json) {
      std::printf("%s: dropped %lu RAM and %lu NVMe blocks; %lu pinned (freed when their leases end)\n",
                  addr.c_str(), r->ram_blocks(), r->disk_blocks(), r->pinned_blocks());
    }
    j[addr] = {{"ram_blocks", r->ram_blocks()}, {"disk_blocks", r->disk_blocks()},
               {"pinned_blocks", r->pinned_blocks()}};
  }
  if (c.json) std::printf("%s\n", j.dump(2).c_str());
  return kOk;
}

// Reads a token file (integers separated by spaces, commas or newlines) or a
// hash file (one 32-hex-digit hash per line).
absl::StatusOr<std::vector<uint32_t>> ReadTokens(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file \"", path, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<uint32_t> out;
  for (absl::string_view t : absl::StrSplit(ss.str(), absl::ByAnyChar(" ,\n\t\r"), absl::SkipEmpty())) {
    uint32_t v;
    if (!absl::SimpleAtoi(t, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("token file \"", path, "\": \"", t, "\" is not a token id"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<BlockHash>> ReadHashes(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read hash file \"", path, "\""));
  std::vector<BlockHash> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto h = BlockHashFromHex(line);
    if (!h.ok()) return absl::InvalidArgumentError(absl::StrCat("hash file \"", path, "\": ", h.status().message()));
    out.push_back(*h);
  }
  return out;
}

// --tokens FILE --block-tokens N, or --hashes FILE: the chain of a prompt.
absl::StatusOr<std::vector<BlockHash>> Chain(uint64_t ns, const std::string& tokens,
                                             const std::string& hashes, int64_t block_tokens) {
  if (tokens.empty() == hashes.empty()) {
    return absl::InvalidArgumentError("give exactly one of --tokens FILE and --hashes FILE");
  }
  if (!hashes.empty()) return ReadHashes(hashes);
  auto t = ReadTokens(tokens);
  if (!t.ok()) return t.status();
  return ChainHashes(ns, *t, static_cast<uint32_t>(block_tokens));
}

int Lookup(int argc, const char* const* argv) {
  Common c;
  std::string ns, tokens, hashes;
  int64_t block_tokens = 16;
  FlagSet f("kvctl lookup", "Which blocks of a prompt each store shard holds, and in which tier.");
  c.Register(f, true, false);
  f.String("namespace", &ns, "Namespace id (hex)");
  f.String("tokens", &tokens, "File of token ids (hashed with --block-tokens)");
  f.String("hashes", &hashes, "File of block hashes, one per line (32 hex digits)");
  f.Int("block-tokens", &block_tokens, 1, 65536, "Tokens per block for --tokens");
  ParseFlagsOrExit(f, argc, argv);
  auto id = ParseNs(ns);
  if (!id.ok()) {
    std::fprintf(stderr, "kvctl lookup: --namespace: %s\n", std::string(id.status().message()).c_str());
    return kUsage;
  }
  auto chain = Chain(*id, tokens, hashes, block_tokens);
  if (!chain.ok()) {
    std::fprintf(stderr, "kvctl lookup: %s\n", std::string(chain.status().message()).c_str());
    return kUsage;
  }
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client(addr, c.ClientOptions());
    auto tiers = client.Lookup(*id, *chain);
    if (!tiers.ok()) return Report(tiers.status(), "store " + addr);
    nlohmann::json blocks = nlohmann::json::array();
    for (size_t i = 0; i < chain->size(); ++i) {
      std::string where = i < tiers->size() ? ((*tiers)[i] == v1::TIER_RAM ? "ram" : "disk") : "absent";
      blocks.push_back({{"index", i}, {"hash", ToHex((*chain)[i])}, {"tier", where}});
      if (!c.json) std::printf("%-22s %5zu %s %s\n", addr.c_str(), i, ToHex((*chain)[i]).c_str(), where.c_str());
    }
    j[addr] = {{"present_prefix", tiers->size()}, {"blocks", blocks}};
    if (!c.json) std::printf("%s: leading %zu of %zu blocks present\n", addr.c_str(), tiers->size(), chain->size());
  }
  if (c.json) std::printf("%s\n", j.dump(2).c_str());
  return kOk;
}

std::unique_ptr<v1::Router::Stub> RouterStub(const Common& c) {
  return v1::Router::NewStub(OpenChannel(c.router, c.Security()));
}

int Workers(int argc, const char* const* argv) {
  Common c;
  FlagSet f("kvctl workers", "The router's view of its sources: workers and store shards.");
  c.Register(f, false, true);
  ParseFlagsOrExit(f, argc, argv);
  auto stub = RouterStub(c);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(c.timeout_ms));
  v1::ListWorkersResponse resp;
  auto s = stub->ListWorkers(&ctx, {}, &resp);
  if (!s.ok()) return Report(FromGrpc(s), "router " + c.router);
  if (c.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& w : resp.sources()) {
      j.push_back({{"id", w.source_id()},
                   {"kind", w.kind() == v1::SOURCE_STORE ? "store" : "worker"},
                   {"endpoint", w.endpoint()},
                   {"namespace", NamespaceName(w.namespace_id())},
                   {"indexed_blocks", w.indexed_blocks()},
                   {"running_requests", w.load().running_requests()},
                   {"queued_prefill_tokens", w.load().queued_prefill_tokens()},
                   {"free_gpu_pages", w.load().free_gpu_pages()},
                   {"last_heartbeat_ms", w.last_seen_ms()},
                   {"connected", w.connected()},
                   {"resyncing", w.resyncing()}});
    }
    std::printf("%s\n", nlohmann::json{{"sources", j}}.dump(2).c_str());
    return kOk;
  }
  std::printf("%-24s %-6s %-22s %-16s %8s %7s %8s %9s %8s\n", "id", "kind", "endpoint", "namespace",
              "blocks", "running", "queued", "free pages", "last hb");
  for (const auto& w : resp.sources()) {
    std::printf("%-24s %-6s %-22s %016lx %8lu %7u %8lu %9lu %6lums%s\n", w.source_id().c_str(),
                w.kind() == v1::SOURCE_STORE ? "store" : "worker", w.endpoint().c_str(),
                w.namespace_id(), w.indexed_blocks(), w.load().running_requests(),
                w.load().queued_prefill_tokens(), w.load().free_gpu_pages(), w.last_seen_ms(),
                w.connected() ? "" : " (disconnected)");
  }
  return kOk;
}

int Route(int argc, const char* const* argv) {
  Common c;
  std::string ns, tokens, hashes;
  int64_t prompt_tokens = 0;
  FlagSet f("kvctl route", "Ask the router where a prompt would go, with every candidate's cost.");
  c.Register(f, false, true);
  f.String("namespace", &ns, "Namespace id (hex)");
  f.String("tokens", &tokens, "File of token ids");
  f.String("hashes", &hashes, "File of block hashes, one per line (32 hex digits)");
  f.Int("prompt-tokens", &prompt_tokens, 0, int64_t{1} << 32, "Prompt length with --hashes");
  ParseFlagsOrExit(f, argc, argv);
  auto id = ParseNs(ns);
  if (!id.ok() || tokens.empty() == hashes.empty()) {
    std::fprintf(stderr, "kvctl route: give --namespace (hex) and exactly one of --tokens, --hashes\n");
    return kUsage;
  }
  v1::RouteRequest req;
  req.set_namespace_id(*id);
  if (!tokens.empty()) {
    auto t = ReadTokens(tokens);
    if (!t.ok()) {
      std::fprintf(stderr, "kvctl route: %s\n", std::string(t.status().message()).c_str());
      return kUsage;
    }
    for (uint32_t x : *t) req.mutable_tokens()->add_ids(x);
  } else {
    auto h = ReadHashes(hashes);
    if (!h.ok()) {
      std::fprintf(stderr, "kvctl route: %s\n", std::string(h.status().message()).c_str());
      return kUsage;
    }
    for (const auto& x : *h) ToProto(x, req.mutable_hashes()->add_hashes());
    req.set_prompt_tokens(static_cast<uint64_t>(prompt_tokens));
  }
  auto stub = RouterStub(c);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(c.timeout_ms));
  v1::RouteResponse r;
  auto s = stub->Route(&ctx, req, &r);
  if (!s.ok()) return Report(FromGrpc(s), "router " + c.router);
  const char* reasons[] = {"?", "lowest cost", "tie break (stable hash of the deepest matched block)",
                           "balance guard (load spread over threshold)", "sampled (temperature)"};
  if (c.json) {
    nlohmann::json cands = nlohmann::json::array();
    for (const auto& x : r.candidates()) {
      cands.push_back({{"worker", x.worker_id()}, {"gpu_blocks", x.gpu_blocks()},
                       {"store_blocks", x.store_blocks()}, {"prefill_tokens", x.prefill_tokens()},
                       {"load_tokens", x.load_tokens()}, {"cost", x.cost()}});
    }
    std::printf("%s\n", nlohmann::json{{"worker", r.worker_id()}, {"endpoint", r.endpoint()},
                                       {"gpu_hit_blocks", r.gpu_hit_blocks()},
                                       {"store_hit_blocks", r.store_hit_blocks()},
                                       {"prefill_tokens", r.prefill_tokens()},
                                       {"reason", reasons[std::clamp<int>(r.reason(), 0, 4)]},
                                       {"candidates", cands}}.dump(2).c_str());
    return kOk;
  }
  std::printf("-> %s (%s): %u blocks on GPU, %u from the store, %lu tokens to prefill; %s\n\n",
              r.worker_id().c_str(), r.endpoint().c_str(), r.gpu_hit_blocks(), r.store_hit_blocks(),
              r.prefill_tokens(), reasons[std::clamp<int>(r.reason(), 0, 4)]);
  std::printf("%-24s %10s %12s %14s %12s %12s\n", "candidate", "GPU blocks", "store blocks",
              "prefill tokens", "load tokens", "cost");
  for (const auto& x : r.candidates()) {
    std::printf("%-24s %10u %12u %14lu %12lu %12.1f\n", x.worker_id().c_str(), x.gpu_blocks(),
                x.store_blocks(), x.prefill_tokens(), x.load_tokens(), x.cost());
  }
  return kOk;
}

int Namespaces(int argc, const char* const* argv) {
  Common c;
  FlagSet f("kvctl namespaces", "The namespaces each store shard knows.");
  c.Register(f, true, false);
  ParseFlagsOrExit(f, argc, argv);
  nlohmann::json j;
  for (const auto& addr : c.StoreList()) {
    StoreClient client(addr, c.ClientOptions());
    v1::ListNamespacesResponse resp;
    auto ctx = client.Context();
    auto s = client.stub().ListNamespaces(ctx.get(), {}, &resp);
    if (!s.ok()) return Report(FromGrpc(s), "store " + addr);
    for (const auto& n : resp.namespaces()) {
      std::string id = NamespaceName(n.namespace_id());
      j[addr].push_back({{"id", id}, {"model", n.spec().model()}, {"dtype", n.spec().dtype()},
                         {"block_tokens", n.spec().block_tokens()}, {"block_bytes", n.block_bytes()}});
      if (!c.json) {
        std::printf("%-22s %s %s %s %u tokens/block, %s/block\n", addr.c_str(), id.c_str(),
                    n.spec().model().c_str(), n.spec().dtype().c_str(), n.spec().block_tokens(),
                    FormatBytes(n.block_bytes()).c_str());
      }
    }
  }
  if (c.json) std::printf("%s\n", j.dump(2).c_str());
  return kOk;
}

int Health(int argc, const char* const* argv) {
  Common c;
  std::string service;
  FlagSet f("kvctl health",
            "grpc.health.v1 status of one kvtier server (store, router or worker) at ADDR:\n"
            "exit 0 SERVING, 1 not serving, 3 unreachable. For probes: works over TLS.\n"
            "Usage: kvctl health ADDR [--service kvtier.v1.Store/disk]");
  c.Register(f, false, false);
  f.String("service", &service, "Service to ask about (empty: the whole server)");
  std::vector<std::string> pos;
  ParseFlagsOrExit(f, argc, argv, &pos);
  if (pos.size() != 1) {
    std::fprintf(stderr, "kvctl health: give exactly one ADDR (HOST:PORT)\n");
    return kUsage;
  }
  auto stub = grpc::health::v1::Health::NewStub(OpenChannel(pos[0], c.Security()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(c.timeout_ms));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (auto s = stub->Check(&ctx, req, &resp); !s.ok()) return Report(FromGrpc(s), pos[0]);
  bool serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  if (c.json) {
    std::printf("%s\n", nlohmann::json{{"address", pos[0]}, {"service", service}, {"status", name}}.dump().c_str());
  } else {
    std::printf("%s%s%s: %s\n", pos[0].c_str(), service.empty() ? "" : " ", service.c_str(), name.c_str());
  }
  return serving ? kOk : kRefused;
}

void Usage(FILE* out) {
  std::fputs(
      "Usage: kvctl COMMAND [flags]    (kvctl COMMAND --help for a command's flags)\n\n"
      "Store shards (--store ADDR[,ADDR...] or KVTIER_STORE, default 127.0.0.1:7400):\n"
      "  stats        per-tier statistics per shard and summed (--watch, --json)\n"
      "  policy get   each tier's eviction policy\n"
      "  policy set   --tier ram|disk lru|s3fifo|sieve [--param name=value]\n"
      "  evict        --all | --namespace NS | --key NS:HASH   (asks unless --yes)\n"
      "  lookup       which blocks of a prompt are where (--tokens FILE | --hashes FILE)\n"
      "  namespaces   the registered namespaces\n"
      "Router (--router ADDR or KVTIER_ROUTER, default 127.0.0.1:7500):\n"
      "  workers      the router's sources: endpoint, namespace, blocks, load, last heartbeat\n"
      "  route        explain one routing decision with every candidate's cost\n"
      "Any server:\n"
      "  health ADDR  grpc.health.v1 status (--service NAME); for probes\n"
      "TLS: --tls-ca FILE (connect over TLS), --tls-cert/--tls-key (mutual TLS), or\n"
      "KVTIER_TLS_CA/KVTIER_TLS_CERT/KVTIER_TLS_KEY.\n\n"
      "Exit codes: 0 ok, 1 refused by a service, 2 bad usage, 3 unreachable, 4 not confirmed.\n",
      out);
}

}  // namespace
}  // namespace kvtier::cli

int main(int argc, char** argv) {
  using namespace kvtier::cli;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    Usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? kUsage : kOk;
  }
  std::string cmd = argv[1];
  const char* const* sub = argv + 1;
  int n = argc - 1;
  if (cmd == "stats") return Stats(n, sub);
  if (cmd == "policy") return Policy(n, sub);
  if (cmd == "evict") return Evict(n, sub);
  if (cmd == "lookup") return Lookup(n, sub);
  if (cmd == "namespaces") return Namespaces(n, sub);
  if (cmd == "workers") return Workers(n, sub);
  if (cmd == "route") return Route(n, sub);
  if (cmd == "health") return Health(n, sub);
  std::fprintf(stderr, "kvctl: unknown command \"%s\"\n\n", cmd.c_str());
  Usage(stderr);
  return kUsage;
}
