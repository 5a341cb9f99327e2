// kvtier-bench dataplane: put and get throughput of kvtier's data plane
// (BeginPut/BeginGet + transfer + Commit/End) over TCP (the socket data
// plane, the default, and the UCX RMA one, --data-plane ucx, side by side:
// the socket row's ratio to the UCX row is the cost of a store that checks
// every transfer), over shared memory, and of the inline gRPC path, for
// several block sizes and batch sizes, each beside references measured in
// the same run, with ratios. Buffers are larger than the CPU caches
// (--working-set).
//
// What each row is compared with, and why (a ratio against a crippled or an
// impossible reference says nothing):
//  - raw RMA, always: a RawRma (bench/raw_rma.h) over the same store, with
//    the same DataClientOptions (so the same transport and shared-memory
//    choice) and the same registered buffers, moving every block of the case
//    once with no control plane in the loop: the data plane's own ceiling.
//    Socket and inline-gRPC rows are compared with the UCX TCP one (a
//    socket store serves no RMA).
//  - the socket data plane under TLS (--transports tls: the store with
//    --data-tls and TLS gRPC, certificates made here with openssl) beside the
//    plaintext socket row of the same case: what encryption costs; and
//    nginx serving a body of the block's size over HTTP and HTTPS (a
//    worker per core, sendfile, wrk with keep-alive connections): what TLS
//    costs a server that is good at moving bytes, on this machine.
//  - the transport's ceiling for distinct buffers: ucx_perftest (ucp_put_bw /
//    ucp_get over TCP, started here) for TCP and inline gRPC; for shared
//    memory, memcpy of the same working set between distinct buffers, since
//    ucx_perftest over shm reuses one cache-resident buffer (40-120 GB/s, a
//    figure no transfer of distinct blocks can reach), and a same-host client
//    maps the store's arena, so the shm path is a memcpy through the mapping.
//  - Redis at its best on this machine (redis-server and redis-benchmark
//    started here): per block size, the best SET and the best GET over
//    1/4/8 connections x pipeline depth 1/4/16, each printed with the
//    configuration that gave it. (One connection at -P = batch made Redis
//    collapse on large values: 0.2 GB/s at 1 MiB, -P 32.)
// ucx_perftest and Redis run only with --references (the default), and a
// reference that cannot be measured fails the run; the raw RMA loop is ours
// and cheap, so it always runs.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/dataplane_report.h"
#include "bench/raw_rma.h"
#include "client/store_data_client.h"
#include "common/config.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/rpc/tls.h"
#include "testing/process.h"

namespace kvtier::bench {
namespace {

struct Transport {
  std::string name;        // row label
  std::string ucx_tls;     // for kvtier (needs a sockaddr-capable transport too)
  std::string data_plane;  // the store's --data-plane
  bool tls = false;        // the store's --data-tls (and TLS gRPC)
};

// A CA and a certificate it signs for 127.0.0.1 in `dir` (ca.pem,
// store.pem, store.key), made with openssl as an operator would.
absl::Status MakeCertificates(const std::string& dir) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string cmd = absl::StrCat(
      "cd '", dir, "' && printf 'subjectAltName=IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' ",
      "> store.ext && openssl req -x509 ", ec, " -keyout ca.key -out ca.pem -days 1 -subj /CN=ca",
      " && openssl req ", ec, " -keyout store.key -out store.csr -subj /CN=store",
      " && openssl x509 -req -in store.csr -CA ca.pem -CAkey ca.key -set_serial 1 -days 1 ",
      "-extfile store.ext -out store.pem 2>&1");
  ShellResult r = RunShell(cmd);
  if (r.exit_code != 0) return absl::InternalError("openssl: " + r.out);
  return absl::OkStatus();
}

// Times `ops` operations of `batch` blocks, all submitted at once.
template <typename Submit>
absl::StatusOr<double> TimeOps(uint64_t blocks, int64_t batch, Submit submit) {
  auto start = Clock::now();
  std::vector<std::future<absl::Status>> pending;
  for (uint64_t first = 0; first < blocks; first += batch) {
    pending.push_back(submit(first, std::min<uint64_t>(batch, blocks - first)));
  }
  for (auto& f : pending) {
    if (auto s = f.get(); !s.ok()) return s;
  }
  return Seconds(start);
}

}  // namespace

int RunDataPlaneBench(int argc, const char* const* argv) {
  std::string sizes_flag = "256KiB,1MiB,4MiB", batches_flag = "1,32", transports_flag = "tcp,shm";
  uint64_t working_set = 512ull << 20;
  bool quick = false, json = false, inline_path = true, references = true;
  std::string store_bin;
  bool verify_commits = true;
  int64_t repeats = 3;
  FlagSet flags("kvtier-bench dataplane",
                "Put/get throughput of kvtier's data plane (UCX TCP and shared memory) and inline\n"
                "gRPC path beside the raw RMA loop over the same endpoints (the data plane's\n"
                "ceiling), ucx_perftest over TCP, memcpy of distinct buffers (the shared-memory\n"
                "ceiling), Redis at its best and Mooncake Store over TCP, in one run.");
  flags.String("sizes", &sizes_flag, "Block sizes, comma-separated");
  flags.String("batches", &batches_flag, "Blocks per operation, comma-separated");
  flags.String("transports", &transports_flag,
               "Transports: tcp (UCX and the socket data plane), tls (the socket data plane "
               "over TLS), shm (shared memory)");
  flags.Bytes("working-set", &working_set, "Bytes moved per case (larger than the CPU caches)");
  flags.Bool("inline", &inline_path, "Also measure the inline gRPC path");
  flags.Bool("references", &references,
             "Run ucx_perftest, redis-benchmark and Mooncake Store beside (the raw RMA loop "
             "always runs)");
  flags.Bool("quick", &quick, "A reduced set (256KiB and 1MiB, 48 MiB per case) in under a minute");
  flags.Bool("json", &json, "Print JSON");
  flags.String("store-bin", &store_bin, "kvtier-store binary [default: next to this one]");
  flags.Bool("verify-commits", &verify_commits, "Run the store with --verify-commits");
  flags.Int("repeats", &repeats, 1, 100,
            "Rounds per case, each of the project's path then the raw RMA loop; the best "
            "round of each is reported (this VM's throughput swings by 2x between rounds)");
  ParseFlagsOrExit(flags, argc, argv);
  SetLogQuiet(true);
  if (quick) {
    sizes_flag = "256KiB,1MiB";
    working_set = 48ull << 20;
  }
  if (store_bin.empty()) store_bin = DefaultBinary("cachestore", "kvtier-store");
  auto sizes_or = ParseSizeList("sizes", sizes_flag);
  auto batches_or = ParseIntList("batches", batches_flag, 1, 1 << 20);
  for (const absl::Status& s : {sizes_or.status(), batches_or.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  const std::vector<uint64_t>& sizes = *sizes_or;
  const std::vector<int64_t>& batches = *batches_or;
  std::vector<Transport> transports;
  bool have_tcp = false, have_shm = false, have_tls = false;
  for (absl::string_view t : absl::StrSplit(transports_flag, ',', absl::SkipEmpty())) {
    if (t == "tcp") {
      transports.push_back({"ucx-tcp", "tcp", "ucx"});
      transports.push_back({"socket", "tcp", "socket"});
      have_tcp = true;
    } else if (t == "tls") {
      transports.push_back({"socket-tls", "tcp", "socket", /*tls=*/true});
      have_tls = true;
    } else if (t == "shm") {
      transports.push_back({"shm", "sm", "socket"});
      have_shm = true;
    } else {
      std::fprintf(stderr,
                   "kvtier-bench dataplane: flag --transports: \"%s\" is not tcp, tls or shm\n",
                   std::string(t).c_str());
      return 2;
    }
  }
  TempDir dir;
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  auto blocks_of = [&](uint64_t size) { return std::max<uint64_t>(32, working_set / size); };
  uint64_t case_bytes = 0;
  for (uint64_t size : sizes) case_bytes = std::max(case_bytes, blocks_of(size) * size);
  // Three working sets plus slack: a case's blocks, the raw RMA's reserved
  // slots beside them, and room for the next case's fresh keys should the
  // Evict between cases leave some blocks behind (still pinned).
  const uint64_t ram = 3 * case_bytes + 64 * max_size;

  std::vector<Row> rows;
  uint64_t salt = 1;

  auto measure = [&](const std::string& path, const std::string& tls, const std::string& data_plane,
                     bool data_tls = false) -> int {
    setenv("UCX_TLS", tls.c_str(), 1);
    std::vector<std::string> args = {
        "--data-dir=" + dir.sub("store-" + path),
        absl::StrCat("--ram-bytes=", ram),
        absl::StrCat("--ram-slab-bytes=", std::max<uint64_t>(4 << 20, max_size)),
        "--data-listen=127.0.0.1:0",
        "--data-plane=" + data_plane,
        "--hugepages=false",
        "--ram-policy=lru",
        absl::StrCat("--verify-commits=", verify_commits ? "true" : "false"),
        absl::StrCat("--max-message-bytes=", std::max<uint64_t>(64 << 20, 40 * max_size))};
    ChannelSecurity security;
    if (data_tls) {
      if (auto s = MakeCertificates(dir.path()); !s.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      args.insert(args.end(), {"--tls-cert=" + dir.sub("store.pem"),
                               "--tls-key=" + dir.sub("store.key"), "--data-tls"});
      TlsFlags t;
      t.ca_file = dir.sub("ca.pem");
      auto sec = ClientSecurity(t);
      if (!sec.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s\n",
                     std::string(sec.status().message()).c_str());
        return 1;
      }
      security = std::move(*sec);
    }
    auto store = LocalServer::Start(store_bin, dir.sub("store-" + path), args);
    if (!store.ok()) {
      std::fprintf(stderr, "kvtier-bench dataplane: %s: %s\n", path.c_str(),
                   std::string(store.status().message()).c_str());
      return 1;
    }
    DataClientOptions o;
    o.max_inflight_bytes = 256ull << 20;
    o.deadline_ms = 60000;
    o.shared_memory = path == "shm" ? DataClientOptions::SharedMemory::kOn
                                    : DataClientOptions::SharedMemory::kOff;
    o.security = security;
    StoreDataClient client((*store)->address(), o);
    StoreClientOptions so;
    so.security = security;
    so.max_message_bytes = static_cast<int>(std::max<uint64_t>(64 << 20, 40 * max_size));
    so.deadline_ms = 60000;
    StoreClient inline_client((*store)->address(), so);
    bool is_inline = path == "inline-grpc";
    // RMA needs a UCX store; the shared-memory path's raw loop is memcpys
    // through the mapped arena.
    const bool raw_here = !is_inline && (data_plane == "ucx" || path == "shm");
    for (uint64_t size : sizes) {
      auto spec = SpecForBlockBytes(size, "kvtier-bench-dataplane");
      if (!spec.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s\n",
                     std::string(spec.status().message()).c_str());
        return 2;
      }
      auto ns = client.control().RegisterNamespace(*spec);
      if (!ns.ok()) {
        std::fprintf(stderr, "kvtier-bench dataplane: %s %s: register namespace: %s\n",
                     path.c_str(), FormatBytes(size).c_str(),
                     std::string(ns.status().message()).c_str());
        return 1;
      }
      const uint64_t blocks = blocks_of(size);
      HugeBuffer src(blocks * size), dst(blocks * size);
      for (uint64_t i = 0; i < blocks; ++i)
        FillBlock(ns->id, BlockHash{i, 0}, src.data() + i * size, size);
      if (!is_inline) {
        for (auto* buf : {&src, &dst}) {
          if (auto s = client.RegisterMemory(buf->data(), buf->size()); !s.ok()) {
            std::fprintf(stderr, "kvtier-bench dataplane: %s %s: register memory: %s\n",
                         path.c_str(), FormatBytes(size).c_str(), std::string(s.message()).c_str());
            return 1;
          }
        }
      }
      if (!is_inline) {
        // Connect every lane before timing (as the raw loop's connection is):
        // a connection is made once per client, not per transfer. One put
        // and one get per lane, of a block that is evicted with the case.
        std::vector<std::future<absl::StatusOr<PutOutcome>>> warm;
        for (int lane = 0; lane < 4; ++lane) {
          warm.push_back(client.Put(ns->id, size,
                                    {{BlockHash{~0ull, static_cast<uint64_t>(lane)}, src.data()}}));
        }
        for (auto& f : warm) {
          if (auto r = f.get(); !r.ok()) {
            std::fprintf(stderr, "kvtier-bench dataplane: %s %s: warm-up put: %s\n", path.c_str(),
                         FormatBytes(size).c_str(), std::string(r.status().message()).c_str());
            return 1;
          }
        }
        for (int lane = 0; lane < 4; ++lane) {
          (void)client
              .Get(ns->id, size, {{BlockHash{~0ull, static_cast<uint64_t>(lane)}, dst.data()}})
              .get();
        }
      }
      for (int64_t batch : batches) {
        double best_gbps[2] = {0, 0}, best_raw[2] = {0, 0};
        for (int64_t rep = 0; rep < repeats; ++rep) {
          const uint64_t round = salt++;
          auto hash = [&](uint64_t i) { return BlockHash{round, i}; };
          absl::StatusOr<double> put_s, get_s;
          if (is_inline) {
            put_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<std::pair<BlockHash, std::string_view>> b;
              for (uint64_t i = first; i < first + n; ++i) {
                b.emplace_back(hash(i), std::string_view(
                                            reinterpret_cast<char*>(src.data() + i * size), size));
              }
              std::promise<absl::Status> p;
              auto r = inline_client.PutInline(ns->id, b);
              p.set_value(r.ok() ? absl::OkStatus() : r.status());
              return p.get_future();
            });
            get_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<BlockHash> hs;
              for (uint64_t i = first; i < first + n; ++i) hs.push_back(hash(i));
              std::promise<absl::Status> p;
              auto r = inline_client.GetInline(ns->id, hs);
              p.set_value(!r.ok()          ? r.status()
                          : r->size() == n ? absl::OkStatus()
                                           : absl::DataLossError("short inline read"));
              return p.get_future();
            });
          } else {
            put_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<PutBlock> b;
              for (uint64_t i = first; i < first + n; ++i)
                b.push_back({hash(i), src.data() + i * size});
              auto f = client.Put(ns->id, size, std::move(b));
              return std::async(std::launch::deferred, [f = std::move(f), n]() mutable {
                auto r = f.get();
                if (!r.ok()) return r.status();
                return r->written == n
                           ? absl::OkStatus()
                           : absl::ResourceExhaustedError("store did not take every block");
              });
            });
            get_s = TimeOps(blocks, batch, [&](uint64_t first, uint64_t n) {
              std::vector<GetBlock> b;
              for (uint64_t i = first; i < first + n; ++i)
                b.push_back({hash(i), dst.data() + i * size});
              auto f = client.Get(ns->id, size, std::move(b));
              return std::async(std::launch::deferred, [f = std::move(f), n]() mutable {
                auto r = f.get();
                if (!r.ok()) return r.status();
                return r->blocks == n ? absl::OkStatus() : absl::DataLossError("short read");
              });
            });
            if (get_s.ok() && std::memcmp(src.data(), dst.data(), src.size()) != 0) {
              get_s = absl::DataLossError("bytes read back differ from bytes written");
            }
          }
          for (auto* r : {&put_s, &get_s}) {
            if (!r->ok()) {
              std::fprintf(stderr, "kvtier-bench dataplane: %s %s batch %ld: %s\n", path.c_str(),
                           FormatBytes(size).c_str(), batch,
                           std::string(r->status().message()).c_str());
              return 1;
            }
          }
          // The raw RMA ceiling of the blocks just written, over the same
          // transport. It does not depend on the batch, but it is measured per
          // case (simple, and "the same run" for each row); its pins and
          // reservations end before the Evict below.
          RawRates raw;
          if (raw_here) {
            std::vector<BlockHash> hashes;
            hashes.reserve(blocks);
            for (uint64_t i = 0; i < blocks; ++i) hashes.push_back(hash(i));
            auto r =
                MeasureRawRma((*store)->address(), o, ns->id, size, hashes, round << 32, src, dst);
            if (!r.ok()) {
              std::fprintf(stderr, "kvtier-bench dataplane: %s %s batch %ld: %s\n", path.c_str(),
                           FormatBytes(size).c_str(), batch,
                           std::string(r.status().message()).c_str());
              return 1;
            }
            raw = *r;
          }
          for (int k = 0; k < 2; ++k) {
            const double secs = k == 0 ? *put_s : *get_s;
            best_gbps[k] = std::max(best_gbps[k], blocks * static_cast<double>(size) / secs / 1e9);
            best_raw[k] = std::max(best_raw[k], k == 0 ? raw.put_gbps : raw.get_gbps);
          }
          v1::EvictRequest all;
          all.set_all(true);
          if (auto ev = client.control().Evict(all); !ev.ok()) {
            std::fprintf(stderr, "kvtier-bench dataplane: %s %s batch %ld: evict: %s\n",
                         path.c_str(), FormatBytes(size).c_str(), batch,
                         std::string(ev.status().message()).c_str());
            return 1;
          }
        }
        for (int k = 0; k < 2; ++k) {
          Row row;
          row.path = path;
          row.block_bytes = size;
          row.batch = batch;
          row.op = k == 0 ? "put" : "get";
          row.gbps = best_gbps[k];
          row.blocks_per_s = best_gbps[k] * 1e9 / static_cast<double>(size);
          row.raw_gbps = best_raw[k];
          rows.push_back(row);
        }
      }
    }
    return 0;
  };

  for (const auto& t : transports) {
    if (int rc = measure(t.name, t.ucx_tls, t.data_plane, t.tls); rc != 0) return rc;
  }
  if (inline_path) {
    if (int rc = measure("inline-grpc", "tcp", "socket"); rc != 0) return rc;
  }
  References refs;
  RefPlan plan{sizes,    batches,  blocks_of,   dir.path(), repeats,
               have_tcp, have_shm, inline_path, have_tls,   references};
  if (auto st = MeasureReferences(plan, &refs); !st.ok()) {
    std::fprintf(stderr, "kvtier-bench dataplane: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  AttachReferences(refs, &rows);
  PrintDataPlaneReport(rows, refs, working_set, json);
  return 0;
}

}  // namespace kvtier::bench
