// kvtier-gpu-check: the connector's GPU path, proved in one run
// (scripts/gpu_check.sh starts the store and runs this; docs/engines.md).
//
// On `--device cuda:N` (libkvtier_cuda.so loaded, gpu/page_copier.h) or
// `--device host` (the same staged path over host memory, the CPU half that
// runs in make test):
//   1. kernels: the page copier's gather and scatter (whole blocks and a
//      layer range) against gpu::GatherCpu / ScatterCpu, byte for byte, in
//      vLLM's kv_first and blocks_first layouts and SGLang's split K/V;
//   2. through the store, for each prompt length: the pages of a request
//      saved (SaveFrom, WaitForSave), loaded into other pages (Lookup,
//      StartLoadInto, WaitForLoad), every byte compared; GB/s of each beside
//      cudaMemcpyAsync of the same bytes from pinned memory (memcpy on the
//      host), and the device leg alone (the copier between registered
//      staging and the pages) beside the same reference.
// The layer set is Llama-3-8B's: 32 layers, 8 KV heads, head size 128,
// bf16, blocks of 16 tokens (2 MiB a block). One line of JSON per result
// goes to --json (for docs/benchmarks.md). Exit 0 only when every byte
// matched.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/block_key.h"
#include "gpu/kv_layout.h"
#include "gpu/page_copier.h"
#include "worker/connector.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// How the CUDA module copies (KVTIER_CUDA_COPY): "dma" or "kernel".
std::string CopyMode() {
  const char* how = std::getenv("KVTIER_CUDA_COPY");
  return how != nullptr && std::strcmp(how, "dma") == 0 ? "dma" : "kernel";
}

struct Args {
  std::string store;
  std::string device = "host";
  std::vector<uint64_t> tokens = {4096, 32768};
  uint32_t layers = 32, kv_heads = 8, head_dim = 128, block_tokens = 16;
  uint64_t staging_blocks = 256;
  std::string json;
  bool mapped = true;
  bool writer_hashes = false;  // in-place saves hashed here, not by the store
  uint64_t pass = 0;           // --pass: new blocks for each pass on one store
};

// Memory for pages: the device's or the host's, freed at the end.
class Memory {
 public:
  explicit Memory(gpu::CudaDevice* dev) : dev_(dev) {}
  ~Memory() {
    for (uint8_t* p : owned_) dev_ ? dev_->Free(p) : std::free(p);
  }
  uint8_t* Alloc(size_t n) {
    uint8_t* p = nullptr;
    if (dev_) {
      auto got = dev_->Malloc(n);
      if (!got.ok()) Die(got.status().ToString());
      p = *got;
    } else {
      p = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
      if (!p) Die("out of host memory");
    }
    owned_.push_back(p);
    return p;
  }
  void ToDevice(uint8_t* dst, const uint8_t* src, size_t n) {
    if (!dev_) {
      std::memcpy(dst, src, n);
    } else if (auto s = dev_->Memcpy(dst, src, n); !s.ok()) {
      Die(s.ToString());
    }
  }
  void ToHost(uint8_t* dst, const uint8_t* src, size_t n) { ToDevice(dst, src, n); }
  [[noreturn]] static void Die(const std::string& why) {
    std::fprintf(stderr, "kvtier-gpu-check: %s\n", why.c_str());
    std::exit(2);
  }

 private:
  gpu::CudaDevice* dev_;
  std::vector<uint8_t*> owned_;
};

// An engine's KV cache in one of the accepted layouts, in Memory.
struct Cache {
  gpu::PageMemory pages;
  std::vector<std::pair<uint8_t*, size_t>> allocations;  // what to copy whole
};

Cache MakeCache(Memory& mem, const gpu::KvLayout& l, const std::string& layout) {
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  Cache c;
  for (uint32_t i = 0; i < l.layers; ++i) {
    if (layout == "split") {
      uint8_t* k = mem.Alloc(l.num_pages * chunk);
      uint8_t* v = mem.Alloc(l.num_pages * chunk);
      c.pages.k.push_back(k);
      c.pages.v.push_back(v);
      c.allocations.push_back({k, l.num_pages * chunk});
      c.allocations.push_back({v, l.num_pages * chunk});
      c.pages.page_stride = chunk;
    } else {
      uint8_t* base = mem.Alloc(2 * l.num_pages * chunk);
      c.pages.k.push_back(base);
      c.pages.v.push_back(layout == "kv_first" ? base + l.num_pages * chunk : base + chunk);
      c.pages.page_stride = layout == "kv_first" ? chunk : 2 * chunk;
      c.allocations.push_back({base, 2 * l.num_pages * chunk});
    }
  }
  return c;
}

// The same cache's bytes on the host (a mirror to compare with).
struct Mirror {
  std::vector<std::vector<uint8_t>> bytes;
  gpu::PageMemory pages;
};

Mirror MirrorOf(const Cache& c) {
  Mirror m;
  for (const auto& [p, n] : c.allocations) m.bytes.emplace_back(n);
  // Same offsets within each allocation.
  for (size_t l = 0; l < c.pages.k.size(); ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const uint8_t* ptr = kv == 0 ? c.pages.k[l] : c.pages.v[l];
      for (size_t a = 0; a < c.allocations.size(); ++a) {
        const auto& [base, n] = c.allocations[a];
        if (ptr >= base && ptr < base + n) {
          (kv == 0 ? m.pages.k : m.pages.v).push_back(m.bytes[a].data() + (ptr - base));
          break;
        }
      }
    }
  }
  m.pages.page_stride = c.pages.page_stride;
  return m;
}

// Bytes from a counter-based mix (splitmix64): fast enough for gigabytes.
void Randomize(std::vector<uint8_t>& v, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(v.data() + i, &z, 8);
  }
  for (; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + i);
}

void Emit(const Args& a, const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (!a.json.empty()) std::ofstream(a.json, std::ios::app) << line << "\n";
}

// 1. The copier against the CPU reference, byte for byte.
bool CheckKernels(const Args& a, gpu::CudaDevice* dev, gpu::PageCopier& copier) {
  bool all = true;
  gpu::KvLayout l{a.layers, a.kv_heads, a.head_dim, a.block_tokens, Dtype::kBf16, 64};
  const uint64_t bb = l.block_bytes();
  const uint32_t n = 24;
  std::vector<uint8_t> staging(n * bb);
  if (auto s = copier.RegisterHost(staging.data(), staging.size()); !s.ok())
    Memory::Die(s.ToString());
  std::vector<uint8_t*> blocks;
  for (uint32_t i = 0; i < n; ++i) blocks.push_back(staging.data() + i * bb);
  std::mt19937_64 rng(11);
  for (const std::string layout : {"kv_first", "blocks_first", "split"}) {
    Memory mem(dev);
    Cache c = MakeCache(mem, l, layout);
    Mirror m = MirrorOf(c);
    for (size_t i = 0; i < m.bytes.size(); ++i) {
      Randomize(m.bytes[i], 100 + i);
      mem.ToDevice(c.allocations[i].first, m.bytes[i].data(), m.bytes[i].size());
    }
    std::vector<uint32_t> pages(n);
    for (auto& p : pages) p = static_cast<uint32_t>(rng() % l.num_pages);
    // Gather: every layer, then a layer range.
    std::vector<uint8_t> want(n * bb);
    std::vector<uint8_t*> want_blocks;
    for (uint32_t i = 0; i < n; ++i) want_blocks.push_back(want.data() + i * bb);
    gpu::GatherCpu(l, m.pages, pages.data(), n, want_blocks.data());
    auto t = Clock::now();
    if (auto s = copier.Copy(true, l, c.pages, 0, l.layers, pages.data(), n, blocks.data());
        !s.ok()) {
      Memory::Die(s.ToString());
    }
    const double gather_s = Seconds(t);
    bool gather_same = std::memcmp(want.data(), staging.data(), want.size()) == 0;
    std::memset(staging.data(), 0, staging.size());
    const uint32_t lb = l.layers / 4, le = l.layers / 2 + 1;
    if (auto s = copier.Copy(true, l, c.pages, lb, le, pages.data(), n, blocks.data()); !s.ok()) {
      Memory::Die(s.ToString());
    }
    for (uint32_t i = 0; i < n && gather_same; ++i) {
      const uint64_t lo = lb * l.layer_page_bytes(), hi = le * l.layer_page_bytes();
      gather_same =
          std::memcmp(staging.data() + i * bb + lo, want.data() + i * bb + lo, hi - lo) == 0;
    }
    // Scatter: distinct pages (a page named twice has no defined winner).
    std::vector<uint32_t> distinct;
    for (uint32_t p = 0; p < l.num_pages && distinct.size() < n; p += 2)
      distinct.push_back(p + (rng() % 2));
    Randomize(staging, 7);
    gpu::ScatterLayersCpu(l, m.pages, 0, 3, distinct.data(), n, blocks.data());
    gpu::ScatterLayersCpu(l, m.pages, 3, l.layers, distinct.data(), n, blocks.data());
    t = Clock::now();
    for (auto [b, e] : {std::pair<uint32_t, uint32_t>{0, 3}, {3, l.layers}}) {
      if (auto s = copier.Copy(false, l, c.pages, b, e, distinct.data(), n, blocks.data());
          !s.ok()) {
        Memory::Die(s.ToString());
      }
    }
    const double scatter_s = Seconds(t);
    bool scatter_same = true;
    std::vector<uint8_t> back;
    for (size_t i = 0; i < c.allocations.size(); ++i) {
      back.assign(c.allocations[i].second, 0);
      mem.ToHost(back.data(), c.allocations[i].first, back.size());
      scatter_same &= back == m.bytes[i];
    }
    const bool same = gather_same && scatter_same;
    all &= same;
    Emit(a, absl::StrCat("{\"check\": \"kernels\", \"copy\": \"", CopyMode(), "\", \"device\": \"",
                         copier.name(), "\", \"layout\": \"", layout, "\", \"blocks\": ", n,
                         ", \"gather_identical\": ", gather_same ? "true" : "false",
                         ", \"scatter_identical\": ", scatter_same ? "true" : "false",
                         ", \"gather_ms\": ", gather_s * 1e3, ", \"scatter_ms\": ", scatter_s * 1e3,
                         "}"));
  }
  return all;
}

// 2. Save and load through the store, every byte compared, beside the
// reference copies of the same bytes.
bool CheckStore(const Args& a, gpu::CudaDevice* dev, uint64_t tokens, uint64_t salt) {
  const uint32_t n = static_cast<uint32_t>(tokens / a.block_tokens);
  gpu::KvLayout l{a.layers, a.kv_heads, a.head_dim, a.block_tokens, Dtype::kBf16, 2ull * n + 8};
  const uint64_t bb = l.block_bytes();
  Memory mem(dev);
  Cache c = MakeCache(mem, l, "kv_first");  // vLLM's GPU layout
  Mirror m = MirrorOf(c);
  for (size_t i = 0; i < m.bytes.size(); ++i) {
    Randomize(m.bytes[i], salt * 1000 + i);
    mem.ToDevice(c.allocations[i].first, m.bytes[i].data(), m.bytes[i].size());
  }
  worker::ConnectorOptions o;
  o.spec = NamespaceSpec{"gpu-check/llama-3-8b",
                         "bf16",
                         a.layers,
                         a.kv_heads,
                         a.head_dim,
                         a.block_tokens,
                         0,
                         1,
                         "",
                         "",
                         ""};
  o.num_pages = l.num_pages;
  o.stores = {a.store};
  o.offload = "write-through";
  o.staging_blocks = a.staging_blocks;
  o.data.deadline_ms = 60000;
  o.data.shared_memory =
      a.mapped ? DataClientOptions::SharedMemory::kOn : DataClientOptions::SharedMemory::kOff;
  o.engine_memory = c.pages;
  o.page_copier = a.device;
  o.in_place_store_hashes = !a.writer_hashes;
  auto conn = worker::KvConnector::Create(o);
  if (!conn.ok()) Memory::Die(conn.status().ToString());
  std::vector<uint32_t> tok(tokens);
  for (uint64_t i = 0; i < tokens; ++i) tok[i] = static_cast<uint32_t>((i * 7919 + salt) % 128000);
  const auto chain = ChainHashes(NamespaceId(o.spec), tok, a.block_tokens);
  std::vector<uint32_t> src(n), dst(n);
  for (uint32_t i = 0; i < n; ++i) {
    src[i] = 2 * i;  // interleaved, as an engine's free list hands them out
    dst[i] = 2 * i + 1;
  }
  double first_load_s = 0;
  // Warm-up: the connector's first put sets up its data plane (connects,
  // maps the store's arena), ~0.1 s that a running engine has long paid; a
  // save larger than the staging in that window takes it for a stalled
  // store and drops its tail. One block, saved and dropped from the timing.
  {
    std::vector<uint32_t> one(tok.begin(), tok.begin() + a.block_tokens);
    one[0] ^= 0x5a5a;
    const auto warm = ChainHashes(NamespaceId(o.spec), one, a.block_tokens);
    if (auto s = (*conn)->Lookup(99, warm, 0); !s.ok()) Memory::Die(s.status().ToString());
    if (auto s = (*conn)->SaveFrom(99, 0, {dst[0]}); !s.ok()) Memory::Die(s.ToString());
    if (auto s = (*conn)->WaitForSave(99); !s.ok()) Memory::Die(s.ToString());
    (*conn)->Finished(99);
    // And its first load registers the store's mapped arena with the GPU
    // (pinned for the copy kernels: once per arena, timed apart).
    auto back = (*conn)->Lookup(98, warm, 0);
    if (!back.ok()) Memory::Die(back.status().ToString());
    const auto w = Clock::now();
    if (auto s = (*conn)->StartLoadInto(98, {dst[0]}); !s.ok()) Memory::Die(s.ToString());
    if (auto s = (*conn)->WaitForLoad(98); !s.ok()) Memory::Die(s.status().ToString());
    first_load_s = Seconds(w);
    (*conn)->Finished(98);
  }
  const uint64_t in_place_before = (*conn)->stats().in_place_blocks;
  // Save: the step's copy out (SaveFrom), then the store's writes.
  if (auto s = (*conn)->Lookup(1, chain, 0); !s.ok()) Memory::Die(s.status().ToString());
  auto t = Clock::now();
  if (auto s = (*conn)->SaveFrom(1, 0, src); !s.ok()) Memory::Die(s.ToString());
  const double step_s = Seconds(t);
  if (auto s = (*conn)->WaitForSave(1); !s.ok()) Memory::Die(s.ToString());
  const double save_s = Seconds(t);
  (*conn)->Finished(1);
  // Load into other pages.
  auto found = (*conn)->Lookup(2, chain, 0);
  if (!found.ok()) Memory::Die(found.status().ToString());
  if (found->store_blocks != n) {
    Memory::Die(absl::StrCat("the store holds ", found->store_blocks, " of ", n, " blocks"));
  }
  t = Clock::now();
  if (auto s = (*conn)->StartLoadInto(2, dst); !s.ok()) Memory::Die(s.ToString());
  auto loaded = (*conn)->WaitForLoad(2);
  const double load_s = Seconds(t);
  if (!loaded.ok()) Memory::Die(loaded.status().ToString());
  (*conn)->Finished(2);
  const auto stats = (*conn)->stats();
  conn->reset();
  // Every byte: page dst[i] now equals page src[i].
  bool same = *loaded == n;
  std::vector<uint8_t> back;
  for (size_t i = 0; i < c.allocations.size() && same; ++i) {
    back.assign(c.allocations[i].second, 0);
    mem.ToHost(back.data(), c.allocations[i].first, back.size());
    std::memcpy(m.bytes[i].data(), back.data(), back.size());
  }
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  for (uint32_t layer = 0; layer < l.layers && same; ++layer) {
    for (uint32_t i = 0; i < n && same; ++i) {
      same = std::memcmp(m.pages.K(layer, src[i]), m.pages.K(layer, dst[i]), chunk) == 0 &&
             std::memcmp(m.pages.V(layer, src[i]), m.pages.V(layer, dst[i]), chunk) == 0;
    }
  }
  // References: the same bytes by cudaMemcpyAsync from pinned memory (or
  // memcpy), each way, and the device leg alone through the copier.
  const uint64_t bytes = uint64_t{n} * bb;
  std::vector<uint8_t> host(bytes);
  double h2d_s = 0, d2h_s = 0;
  uint8_t* dev_buf = mem.Alloc(bytes);
  if (dev) {
    if (auto s = dev->RegisterHost(host.data(), host.size()); !s.ok()) Memory::Die(s.ToString());
    auto h2d = dev->TimeMemcpy(dev_buf, host.data(), bytes, 3);
    auto d2h = dev->TimeMemcpy(host.data(), dev_buf, bytes, 3);
    if (!h2d.ok() || !d2h.ok()) Memory::Die("timing cudaMemcpyAsync failed");
    h2d_s = *h2d / 3;
    d2h_s = *d2h / 3;
    dev->UnregisterHost(host.data());
  } else {
    std::memcpy(dev_buf, host.data(), bytes);  // first touch
    t = Clock::now();
    std::memcpy(dev_buf, host.data(), bytes);
    h2d_s = Seconds(t);
    t = Clock::now();
    std::memcpy(host.data(), dev_buf, bytes);
    d2h_s = Seconds(t);
  }
  auto copier = gpu::OpenPageCopier(a.device);
  if (!copier.ok()) Memory::Die(copier.status().ToString());
  if (auto s = (*copier)->RegisterHost(host.data(), host.size()); !s.ok())
    Memory::Die(s.ToString());
  std::vector<uint8_t*> blocks;
  for (uint32_t i = 0; i < n; ++i) blocks.push_back(host.data() + uint64_t{i} * bb);
  t = Clock::now();
  if (auto s = (*copier)->Copy(false, l, c.pages, 0, l.layers, dst.data(), n, blocks.data());
      !s.ok()) {
    Memory::Die(s.ToString());
  }
  const double leg_in_s = Seconds(t);
  t = Clock::now();
  if (auto s = (*copier)->Copy(true, l, c.pages, 0, l.layers, src.data(), n, blocks.data());
      !s.ok()) {
    Memory::Die(s.ToString());
  }
  const double leg_out_s = Seconds(t);
  copier->reset();
  // The same legs by the copy engines (KVTIER_CUDA_COPY=dma: one batch of
  // chunk copies), for comparison; a device only.
  double dma_in_s = 0, dma_out_s = 0;
  if (dev) {
    const std::string mode = CopyMode();
    setenv("KVTIER_CUDA_COPY", "dma", 1);
    auto dma = gpu::OpenPageCopier(a.device);
    if (mode != "dma") unsetenv("KVTIER_CUDA_COPY");
    if (!dma.ok()) Memory::Die(dma.status().ToString());
    if (auto s = (*dma)->RegisterHost(host.data(), host.size()); !s.ok()) Memory::Die(s.ToString());
    (*dma)->Copy(false, l, c.pages, 0, l.layers, dst.data(), 1, blocks.data()).IgnoreError();
    t = Clock::now();
    absl::Status in = (*dma)->Copy(false, l, c.pages, 0, l.layers, dst.data(), n, blocks.data());
    dma_in_s = Seconds(t);
    t = Clock::now();
    absl::Status out = (*dma)->Copy(true, l, c.pages, 0, l.layers, src.data(), n, blocks.data());
    dma_out_s = Seconds(t);
    if (!in.ok() || !out.ok()) {
      std::fprintf(stderr, "kvtier-gpu-check: the copy engines' legs failed: %s / %s\n",
                   in.ToString().c_str(), out.ToString().c_str());
      dma_in_s = dma_out_s = 0;
    }
  }
  auto gbs = [&](double s) { return s > 0 ? bytes / s / 1e9 : 0.0; };
  Emit(a, absl::StrCat(
              "{\"check\": \"store\", \"device\": \"", a.device, "\", \"copy\": \"", CopyMode(),
              "\", \"hashes\": \"", a.writer_hashes ? "writer" : "store",
              "\", \"tokens\": ", tokens, ", \"blocks\": ", n, ", \"bytes\": ", bytes,
              ", \"identical\": ", same ? "true" : "false", ", \"transport\": \"",
              a.mapped ? "mapped" : "socket", "\", \"save_step_s\": ", step_s,
              ", \"save_s\": ", save_s, ", \"load_s\": ", load_s, ", \"save_gbs\": ", gbs(save_s),
              ", \"load_gbs\": ", gbs(load_s), ", \"ref_d2h_gbs\": ", gbs(d2h_s),
              ", \"ref_h2d_gbs\": ", gbs(h2d_s), ", \"save_ratio\": ", gbs(save_s) / gbs(d2h_s),
              ", \"load_ratio\": ", gbs(load_s) / gbs(h2d_s),
              ", \"copier_in_gbs\": ", gbs(leg_in_s), ", \"copier_out_gbs\": ", gbs(leg_out_s),
              ", \"copier_in_ratio\": ", gbs(leg_in_s) / gbs(h2d_s), ", \"copier_out_ratio\": ",
              gbs(leg_out_s) / gbs(d2h_s), ", \"load_scatter_ms\": ", stats.load_times.scatter_ms,
              ", \"load_rma_ms\": ", stats.load_times.transfer.rma_ms,
              ", \"load_checksum_ms\": ", stats.load_times.transfer.checksum_ms,
              ", \"save_gather_ms\": ", stats.offload_gather_ms,
              ", \"in_place_blocks\": ", stats.in_place_blocks - in_place_before,
              ", \"in_place_saved\": ", stats.in_place_saved,
              ", \"save_checksum_ms\": ", stats.offload_times.checksum_ms,
              ", \"save_control_ms\": ", stats.offload_times.control_ms,
              ", \"first_load_s\": ", first_load_s, ", \"dma_in_gbs\": ", gbs(dma_in_s),
              ", \"dma_out_gbs\": ", gbs(dma_out_s), "}"));
  return same;
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const char* name) -> std::string {
      const std::string prefix = std::string(name) + "=";
      return arg.rfind(prefix, 0) == 0 ? arg.substr(prefix.size()) : std::string("\x01");
    };
    std::string v;
    if ((v = value("--store")) != "\x01") {
      a.store = v;
    } else if ((v = value("--device")) != "\x01") {
      a.device = v;
    } else if ((v = value("--json")) != "\x01") {
      a.json = v;
    } else if ((v = value("--transport")) != "\x01") {
      a.mapped = v == "mapped";
    } else if ((v = value("--staging-blocks")) != "\x01") {
      if (!absl::SimpleAtoi(v, &a.staging_blocks) || a.staging_blocks == 0)
        Memory::Die("bad --staging-blocks");
    } else if ((v = value("--pass")) != "\x01") {
      if (!absl::SimpleAtoi(v, &a.pass) || a.pass > 1000) Memory::Die("bad --pass");
    } else if ((v = value("--hashes")) != "\x01") {
      if (v != "store" && v != "writer") Memory::Die("--hashes is store or writer");
      a.writer_hashes = v == "writer";
    } else if ((v = value("--layers")) != "\x01") {
      if (!absl::SimpleAtoi(v, &a.layers) || a.layers < 4) Memory::Die("--layers is at least 4");
    } else if ((v = value("--tokens")) != "\x01") {
      a.tokens.clear();
      for (absl::string_view t : absl::StrSplit(v, ',')) {
        uint64_t x = 0;
        if (!absl::SimpleAtoi(t, &x) || x < a.block_tokens) Memory::Die("bad --tokens");
        a.tokens.push_back(x);
      }
    } else {
      std::fprintf(
          stderr,
          "usage: kvtier-gpu-check --store=HOST:PORT [--device=cuda:0|host] "
          "[--tokens=4096,32768] [--layers=32] [--staging-blocks=256] "
          "[--transport=mapped|socket] [--hashes=store|writer] [--pass=N] [--json=FILE]\n");
      return 2;
    }
  }
  if (a.store.empty()) Memory::Die("--store is required");
  std::unique_ptr<gpu::CudaDevice> dev;
  if (a.device != "host") {
    int index = 0;
    if (a.device != "cuda" &&
        (a.device.rfind("cuda:", 0) != 0 || !absl::SimpleAtoi(a.device.substr(5), &index))) {
      Memory::Die("--device is host, cuda or cuda:N");
    }
    auto d = gpu::CudaDevice::Open(index);
    if (!d.ok()) Memory::Die(d.status().ToString());
    dev = std::move(*d);
  }
  auto copier = gpu::OpenPageCopier(a.device);
  if (!copier.ok()) Memory::Die(copier.status().ToString());
  bool ok = CheckKernels(a, dev.get(), **copier);
  copier->reset();
  // A later pass against the same store saves new blocks (not ones the
  // store holds already).
  uint64_t salt = (CopyMode() == "dma" ? 101 : 1) + (a.writer_hashes ? 201 : 0) + a.pass * 1000;
  for (uint64_t t : a.tokens) ok &= CheckStore(a, dev.get(), t, salt++);
  std::printf("kvtier-gpu-check: %s\n", ok ? "every byte matched" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) { return kvtier::Main(argc, argv); }
