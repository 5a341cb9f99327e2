// gpu/page_copier.h: the host copier, and the CUDA copier over
// libkvtier_cuda (gpu/cuda_module.h) loaded with dlopen.
#include "gpu/page_copier.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gpu/cuda_module.h"

namespace kvtier::gpu {
namespace {

constexpr char kModule[] = "libkvtier_cuda.so";
constexpr char kHowToBuild[] =
    "build it on the GPU host with scripts/build_cuda_module.sh (nvcc only) and put it on the "
    "library path or in $KVTIER_CUDA_MODULE";

// The module's entry points, resolved once per process.
struct Module {
  decltype(&kvtier_cuda_abi) abi = nullptr;
  decltype(&kvtier_cuda_open) open = nullptr;
  decltype(&kvtier_cuda_close) close = nullptr;
  decltype(&kvtier_cuda_host_register) host_register = nullptr;
  decltype(&kvtier_cuda_host_unregister) host_unregister = nullptr;
  decltype(&kvtier_cuda_pointer_device) pointer_device = nullptr;
  decltype(&kvtier_cuda_copy) copy = nullptr;
  decltype(&kvtier_cuda_malloc) malloc = nullptr;
  decltype(&kvtier_cuda_free) free = nullptr;
  decltype(&kvtier_cuda_memcpy) memcpy = nullptr;
  decltype(&kvtier_cuda_time_memcpy) time_memcpy = nullptr;
};

// Beside the object holding this code: the Python extension's folder, or
// the program's.
std::string BesideThisLibrary() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&BesideThisLibrary), &info) == 0 || !info.dli_fname) {
    return "";
  }
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1) + kModule;
}

absl::StatusOr<const Module*> LoadModule() {
  static std::once_flag once;
  static absl::StatusOr<Module>* loaded = nullptr;
  std::call_once(once, [] {
    std::vector<std::string> tried;
    void* h = nullptr;
    if (const char* env = std::getenv("KVTIER_CUDA_MODULE"); env && *env) {
      tried.push_back(env);
    } else {
      tried.push_back(kModule);
      if (std::string beside = BesideThisLibrary(); !beside.empty()) tried.push_back(beside);
    }
    std::string errors;
    for (const std::string& path : tried) {
      h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h != nullptr) break;
      const char* e = dlerror();
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", e ? e : path);
    }
    if (h == nullptr) {
      loaded = new absl::StatusOr<Module>(absl::FailedPreconditionError(
          absl::StrCat("no CUDA module (", errors, "): ", kHowToBuild)));
      return;
    }
    Module m;
    bool missing = false;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      missing |= fn == nullptr;
    };
    get(m.abi, "kvtier_cuda_abi");
    get(m.open, "kvtier_cuda_open");
    get(m.close, "kvtier_cuda_close");
    get(m.host_register, "kvtier_cuda_host_register");
    get(m.host_unregister, "kvtier_cuda_host_unregister");
    get(m.pointer_device, "kvtier_cuda_pointer_device");
    get(m.copy, "kvtier_cuda_copy");
    get(m.malloc, "kvtier_cuda_malloc");
    get(m.free, "kvtier_cuda_free");
    get(m.memcpy, "kvtier_cuda_memcpy");
    get(m.time_memcpy, "kvtier_cuda_time_memcpy");
    if (missing || m.abi() != KVTIER_CUDA_ABI) {
      loaded = new absl::StatusOr<Module>(absl::FailedPreconditionError(
          absl::StrCat("the CUDA module found is of another version (ABI ", missing ? -1 : m.abi(),
                       ", this build needs ", KVTIER_CUDA_ABI, "): ", kHowToBuild)));
      return;
    }
    loaded = new absl::StatusOr<Module>(m);
  });
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

std::string Err(const char* e) { return e[0] ? e : "unknown CUDA error"; }

class HostCopier final : public PageCopier {
 public:
  const std::string& name() const override { return name_; }
  absl::Status CheckMemory(const KvLayout&, const PageMemory&) const override {
    return absl::OkStatus();  // host memory is all this copier ever touches
  }
  absl::Status RegisterHost(void*, size_t) override { return absl::OkStatus(); }
  void UnregisterHost(void*) override {}
  absl::Status Copy(bool gather, const KvLayout& l, const PageMemory& m, uint32_t layer_begin,
                    uint32_t layer_end, const uint32_t* pages, size_t count,
                    uint8_t* const* blocks) override {
    if (layer_end > l.layers || layer_begin > layer_end) {
      return absl::InvalidArgumentError(absl::StrCat("layers [", layer_begin, ", ", layer_end,
                                                     ") outside the ", l.layers, " of the cache"));
    }
    if (gather) {
      GatherLayersCpu(l, m, layer_begin, layer_end, pages, count, blocks);
    } else {
      ScatterLayersCpu(l, m, layer_begin, layer_end, pages, count, blocks);
    }
    return absl::OkStatus();
  }

 private:
  std::string name_ = "host";
};

class CudaCopier final : public PageCopier {
 public:
  CudaCopier(const Module* m, kvtier_cuda* c, int device)
      : m_(m), c_(c), device_(device), name_(absl::StrCat("cuda:", device)) {}
  ~CudaCopier() override {
    for (void* p : registered_) m_->host_unregister(c_, p);
    m_->close(c_);
  }
  const std::string& name() const override { return name_; }

  absl::Status CheckMemory(const KvLayout& l, const PageMemory& m) const override {
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const int on = m_->pointer_device(kv == 0 ? m.k[layer] : m.v[layer]);
        if (on != device_) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", layer, "'s ", kv == 0 ? "K" : "V", " memory is ",
                           on < 0 ? std::string("host memory") : absl::StrCat("on cuda:", on),
                           ", not on ", name_));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status RegisterHost(void* p, size_t n) override {
    char err[512] = "";
    if (m_->host_register(c_, p, n, err, sizeof err) != 0) {
      return absl::InternalError(absl::StrCat(name_, ": ", Err(err)));
    }
    std::lock_guard lk(mu_);
    registered_.push_back(p);
    return absl::OkStatus();
  }
  void UnregisterHost(void* p) override {
    std::lock_guard lk(mu_);
    auto it = std::find(registered_.begin(), registered_.end(), p);
    if (it == registered_.end()) return;
    registered_.erase(it);
    m_->host_unregister(c_, p);
  }

  absl::Status Copy(bool gather, const KvLayout& l, const PageMemory& m, uint32_t layer_begin,
                    uint32_t layer_end, const uint32_t* pages, size_t count,
                    uint8_t* const* blocks) override {
    kvtier_cuda_pages pm{l.layers, l.chunk_elems() * l.elem_bytes(), m.page_stride, m.k.data(),
                         m.v.data()};
    char err[512] = "";
    if (m_->copy(c_, &pm, gather ? 1 : 0, layer_begin, layer_end, pages, blocks, count, err,
                 sizeof err) != 0) {
      return absl::InternalError(absl::StrCat(name_, ": ", Err(err)));
    }
    return absl::OkStatus();
  }

 private:
  const Module* m_;
  kvtier_cuda* c_;
  int device_;
  std::string name_;
  std::mutex mu_;
  std::vector<void*> registered_;
};

class CudaDeviceImpl final : public CudaDevice {
 public:
  CudaDeviceImpl(const Module* m, kvtier_cuda* c) : m_(m), c_(c) {}
  ~CudaDeviceImpl() override { m_->close(c_); }
  absl::StatusOr<uint8_t*> Malloc(size_t n) override {
    char err[512] = "";
    void* p = m_->malloc(c_, n, err, sizeof err);
    if (p == nullptr) return absl::ResourceExhaustedError(Err(err));
    return static_cast<uint8_t*>(p);
  }
  void Free(void* p) override { m_->free(c_, p); }
  absl::Status Memcpy(void* dst, const void* src, size_t n) override {
    char err[512] = "";
    if (m_->memcpy(c_, dst, src, n, err, sizeof err) != 0) return absl::InternalError(Err(err));
    return absl::OkStatus();
  }
  absl::StatusOr<double> TimeMemcpy(void* dst, const void* src, size_t n, int reps) override {
    char err[512] = "";
    const double s = m_->time_memcpy(c_, dst, src, n, reps, err, sizeof err);
    if (s < 0) return absl::InternalError(Err(err));
    return s;
  }
  absl::Status RegisterHost(void* p, size_t n) override {
    char err[512] = "";
    if (m_->host_register(c_, p, n, err, sizeof err) != 0) return absl::InternalError(Err(err));
    return absl::OkStatus();
  }
  void UnregisterHost(void* p) override { m_->host_unregister(c_, p); }

 private:
  const Module* m_;
  kvtier_cuda* c_;
};

absl::StatusOr<std::pair<const Module*, kvtier_cuda*>> OpenDevice(int device) {
  auto m = LoadModule();
  if (!m.ok()) return m.status();
  char err[512] = "";
  kvtier_cuda* c = (*m)->open(device, err, sizeof err);
  if (c == nullptr) return absl::UnavailableError(absl::StrCat("cuda:", device, ": ", Err(err)));
  return std::make_pair(*m, c);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PageCopier>> OpenPageCopier(const std::string& device) {
  if (device == "host") return std::unique_ptr<PageCopier>(new HostCopier());
  int index = 0;
  if (device != "cuda") {
    if (device.rfind("cuda:", 0) != 0 || !absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("page copier \"", device, "\" is not \"host\", \"cuda\" or \"cuda:N\""));
    }
  }
  auto opened = OpenDevice(index);
  if (!opened.ok()) return opened.status();
  return std::unique_ptr<PageCopier>(new CudaCopier(opened->first, opened->second, index));
}

absl::StatusOr<int> PointerDevice(const void* p) {
  auto m = LoadModule();
  if (!m.ok()) return m.status();
  return (*m)->pointer_device(p);
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Open(int device) {
  auto opened = OpenDevice(device);
  if (!opened.ok()) return opened.status();
  return std::unique_ptr<CudaDevice>(new CudaDeviceImpl(opened->first, opened->second));
}

}  // namespace kvtier::gpu
