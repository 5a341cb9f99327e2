#include <cstring>

#include "absl/strings/str_cat.h"
#include "bench/dataplane_report.h"
#include "bench/raw_rma.h"
#include "common/config.h"
#include "common/limits.h"

namespace kvtier::bench {

namespace {

// The store takes at most this many blocks per BeginGet / BeginPut.
constexpr size_t kMaxBlocksPerCall = limits::kMaxBlocksPerRequest;
// Blocks per raw Get/Put call (all posted, then waited): bounds the requests
// outstanding at once.
constexpr size_t kRawChunk = 1024;

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

absl::StatusOr<RawRates> MeasureRawRma(const std::string& store, const DataClientOptions& o,
                                       uint64_t ns, uint64_t size,
                                       const std::vector<BlockHash>& hashes, uint64_t first_put_id,
                                       HugeBuffer& src, HugeBuffer& dst) {
  auto raw = RawRma::Connect(store, o);
  if (!raw.ok()) return Annotate(raw.status(), "raw RMA connect");
  for (auto* buf : {&src, &dst}) {
    if (auto s = (*raw)->Register(buf->data(), buf->size()); !s.ok()) {
      return Annotate(s, "raw RMA register");
    }
  }
  const size_t blocks = hashes.size();
  if (blocks == 0) return absl::InvalidArgumentError("raw RMA: no blocks");
  std::vector<uint64_t> get_addrs, put_addrs;
  for (size_t first = 0; first < blocks; first += kMaxBlocksPerCall) {
    const size_t n = std::min(kMaxBlocksPerCall, blocks - first);
    std::vector<BlockHash> chunk(hashes.begin() + first, hashes.begin() + first + n);
    auto a = (*raw)->PinForGet(ns, chunk);
    if (!a.ok()) return Annotate(a.status(), "raw RMA pin");
    if (a->size() != n) {
      return absl::DataLossError(absl::StrCat("raw RMA pin: the store holds ", a->size(),
                                              " of the ", n, " blocks from block ", first));
    }
    get_addrs.insert(get_addrs.end(), a->begin(), a->end());
  }
  for (size_t first = 0; first < blocks; first += kMaxBlocksPerCall) {
    const size_t n = std::min(kMaxBlocksPerCall, blocks - first);
    auto a = (*raw)->ReserveForPut(ns, first_put_id + first, n);
    if (!a.ok()) return Annotate(a.status(), "raw RMA reserve");
    if (a->size() != n) {
      return absl::ResourceExhaustedError(
          absl::StrCat("raw RMA reserve: the store reserved ", a->size(), " of ", n, " slots"));
    }
    put_addrs.insert(put_addrs.end(), a->begin(), a->end());
  }
  auto split = [](const std::vector<uint64_t>& addrs) {
    std::vector<std::vector<uint64_t>> out;
    for (size_t first = 0; first < addrs.size(); first += kRawChunk) {
      out.emplace_back(addrs.begin() + first,
                       addrs.begin() + std::min(addrs.size(), first + kRawChunk));
    }
    return out;
  };
  const auto gets = split(get_addrs), puts = split(put_addrs);
  // One untimed block each way first (endpoint wire-up, remote key
  // unpacking, the arena mapping), so the ceiling is the steady state.
  if (auto s = (*raw)->Get({get_addrs[0]}, size, dst.data()); !s.ok()) {
    return Annotate(s, "raw RMA get");
  }
  if (auto s = (*raw)->Put({put_addrs[0]}, size, src.data()); !s.ok()) {
    return Annotate(s, "raw RMA put");
  }
  // The kvtier get left the right bytes in dst: clear them so the check
  // below sees what the raw get moved.
  std::memset(dst.data(), 0, dst.size());
  auto start = Clock::now();
  for (size_t c = 0; c < gets.size(); ++c) {
    if (auto s = (*raw)->Get(gets[c], size, dst.data() + c * kRawChunk * size); !s.ok()) {
      return Annotate(s, "raw RMA get");
    }
  }
  const double get_s = Seconds(start);
  if (std::memcmp(src.data(), dst.data(), blocks * size) != 0) {
    return absl::DataLossError("raw RMA get: bytes read back differ from bytes written");
  }
  start = Clock::now();
  for (size_t c = 0; c < puts.size(); ++c) {
    if (auto s = (*raw)->Put(puts[c], size, src.data() + c * kRawChunk * size); !s.ok()) {
      return Annotate(s, "raw RMA put");
    }
  }
  const double put_s = Seconds(start);
  const double bytes = static_cast<double>(blocks) * static_cast<double>(size);
  return RawRates{bytes / put_s / 1e9, bytes / get_s / 1e9};
}

absl::Status MeasureReferences(const RefPlan& p, References* out) {
  // memcpy of the same working set between distinct buffers in this
  // process: the ceiling of the shared-memory path (a memcpy through the
  // mapped arena), where ucx_perftest's one cache-resident buffer is not.
  if (p.have_shm) {
    for (uint64_t size : p.sizes) {
      const uint64_t blocks = p.blocks_of(size);
      HugeBuffer a(blocks * size, 1), b(blocks * size, 2);
      std::memcpy(b.data(), a.data(), a.size());  // warm both
      auto t = Clock::now();
      for (int rep = 0; rep < 3; ++rep) std::memcpy(b.data(), a.data(), a.size());
      out->memcpy_gbps[size] = 3.0 * a.size() / Seconds(t) / 1e9;
    }
  }
  // Redis at its best per size, and ucx_perftest over TCP (ucx-tcp and
  // inline-grpc rows) per size and direction.
  constexpr int64_t kRedisClients[] = {1, 4, 8};
  constexpr int64_t kRedisPipelines[] = {1, 4, 16};
  const bool want_perftest = p.have_tcp || p.inline_path;
  if (p.references) {
    for (const char* tool : {"redis-server", "redis-benchmark"}) {
      if (!HaveCommand(tool)) {
        return absl::FailedPreconditionError(absl::StrCat(
            tool, " is not installed (--references=false runs without Redis and ucx_perftest)"));
      }
    }
    if (want_perftest && !HaveCommand("ucx_perftest")) {
      return absl::FailedPreconditionError(
          "ucx_perftest is not installed (--references=false runs without Redis and "
          "ucx_perftest)");
    }
    for (uint64_t size : p.sizes) {
      const int64_t keys = static_cast<int64_t>(p.blocks_of(size));
      RedisBest best;
      std::string last_error;
      for (int64_t clients : kRedisClients) {
        for (int64_t pipeline : kRedisPipelines) {
          auto r = RedisSetGetRps(p.dir, size, keys, clients, pipeline);
          if (r.ok() && (r->first <= 0 || r->second <= 0)) {
            r = absl::InternalError("redis-benchmark reported no throughput");
          }
          if (!r.ok()) {
            last_error = std::string(r.status().message());
            std::fprintf(stderr,
                         "kvtier-bench dataplane: redis at %s, %ld clients, pipeline %ld: %s "
                         "(skipped)\n",
                         FormatBytes(size).c_str(), clients, pipeline, last_error.c_str());
            continue;
          }
          const double set = r->first * size / 1e9, get = r->second * size / 1e9;
          if (set > best.set_gbps) {
            best.set_gbps = set;
            best.set_clients = clients;
            best.set_pipeline = pipeline;
          }
          if (get > best.get_gbps) {
            best.get_gbps = get;
            best.get_clients = clients;
            best.get_pipeline = pipeline;
          }
        }
      }
      if (best.set_gbps <= 0 || best.get_gbps <= 0) {
        return absl::InternalError(absl::StrCat("redis at ", FormatBytes(size),
                                                ": every configuration failed (last: ", last_error,
                                                ")"));
      }
      out->redis_best[size] = best;
      if (!want_perftest) continue;
      for (const char* test : {"ucp_put_bw", "ucp_get"}) {
        auto bw = UcxPerftestBytesPerSec("tcp", test, size, keys);
        if (bw.ok() && *bw <= 0) bw = absl::InternalError("ucx_perftest reported no throughput");
        if (!bw.ok()) {
          return absl::Status(bw.status().code(),
                              absl::StrCat("ucx_perftest ", test, " over tcp at ",
                                           FormatBytes(size), ": ", bw.status().message()));
        }
        out->perftest[{size, test}] = *bw / 1e9;
      }
    }
  }
  // nginx over HTTP and HTTPS, the same body size, beside the TLS rows:
  // what TLS costs a server that is good at moving bytes.
  if (p.references && p.have_tls) {
    for (uint64_t size : p.sizes) {
      NginxFigures best;
      for (int64_t rep = 0; rep < p.repeats; ++rep) {
        auto n =
            NginxPlainTlsBytesPerSec(p.dir, p.dir + "/store.pem", p.dir + "/store.key", size, 4, 3);
        if (!n.ok()) {
          return absl::Status(n.status().code(), absl::StrCat("nginx at ", FormatBytes(size), ": ",
                                                              n.status().message()));
        }
        best.plain_gbps = std::max(best.plain_gbps, n->first / 1e9);
        best.tls_gbps = std::max(best.tls_gbps, n->second / 1e9);
      }
      out->nginx[size] = best;
    }
  }
  // Mooncake Store over TCP (its zero-copy batch calls, one client as here)
  // per size and batch, beside the TCP rows.
  if (p.references && (p.have_tcp || p.inline_path)) {
    for (uint64_t size : p.sizes) {
      for (int64_t batch : p.batches) {
        if (!out->mooncake_why.empty()) break;
        // The best of --repeats rounds, as for kvtier's paths.
        MooncakeFigures best;
        for (int64_t rep = 0; rep < p.repeats && out->mooncake_why.empty(); ++rep) {
          auto m = MooncakeStoreGbps(size, p.blocks_of(size), batch, 1);
          if (!m.ok()) {
            out->mooncake_why = std::string(m.status().message());
            std::fprintf(stderr, "kvtier-bench dataplane: Mooncake Store not measured: %s\n",
                         out->mooncake_why.c_str());
            break;
          }
          best.put_gbps = std::max(best.put_gbps, m->put_gbps);
          best.get_gbps = std::max(best.get_gbps, m->get_gbps);
        }
        if (out->mooncake_why.empty()) out->mooncake[{size, batch}] = best;
      }
    }
  }
  return absl::OkStatus();
}

void AttachReferences(const References& refs, std::vector<Row>* rows) {
  for (auto& r : *rows) {
    const bool put = r.op == "put";
    if (r.path != "shm") {
      if (auto m = refs.mooncake.find({r.block_bytes, r.batch}); m != refs.mooncake.end()) {
        r.mooncake_gbps = put ? m->second.put_gbps : m->second.get_gbps;
      }
    }
    if (r.path == "inline-grpc" || r.path == "socket" || r.path == "socket-tls") {
      // No raw RMA of its own: compared with UCX TCP's of the same case
      // (a socket row with the UCX data plane's own figure, a TLS row with
      // the plaintext socket's).
      for (const auto& t : *rows) {
        if (t.block_bytes != r.block_bytes || t.batch != r.batch || t.op != r.op) continue;
        if (t.path == "ucx-tcp") {
          r.raw_gbps = t.raw_gbps;
          if (r.path == "socket") r.ucx_gbps = t.gbps;
        }
        if (t.path == "socket" && r.path == "socket-tls") r.plain_gbps = t.gbps;
      }
    }
    if (r.path == "socket-tls" && !put) {
      if (auto n = refs.nginx.find(r.block_bytes); n != refs.nginx.end()) {
        r.nginx_tls_gbps = n->second.tls_gbps;
      }
    }
    if (auto rb = refs.redis_best.find(r.block_bytes); rb != refs.redis_best.end()) {
      r.redis_best_gbps = put ? rb->second.set_gbps : rb->second.get_gbps;
    }
    if (r.path == "shm") {
      r.memcpy_gbps =
          refs.memcpy_gbps.count(r.block_bytes) ? refs.memcpy_gbps.at(r.block_bytes) : 0;
    } else if (auto pf = refs.perftest.find({r.block_bytes, put ? "ucp_put_bw" : "ucp_get"});
               pf != refs.perftest.end()) {
      r.perftest_gbps = pf->second;
    }
  }
}

}  // namespace kvtier::bench
