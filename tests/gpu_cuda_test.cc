// gpu/ CUDA kernels against the CPU implementations, byte for byte (ctest
// label gpu). Skipped, with a message, where there is no GPU or no nvcc.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpu/kernels.h"
#include "gpu/kv_layout.h"
#include "tests/gpu_test_util.h"

namespace kvtier::gpu {
namespace {

#ifdef KVTIER_HAVE_CUDA
// CUDA against CPU, byte for byte (ctest label gpu).
TEST(GpuCuda, KernelsMatchTheCpuByteForByte) {
  if (!CudaAvailable()) GTEST_SKIP() << "no GPU visible: CUDA kernels compiled but not run here";
  std::mt19937_64 rng(4);
  for (int round = 0; round < 20; ++round) {
    KvLayout l = RandomLayout(rng, static_cast<Dtype>(round % 2));
    auto cache = RandomCache(rng, l);
    std::vector<uint32_t> pages;
    for (int i = 0; i < 1 + static_cast<int>(rng() % 6); ++i) pages.push_back(rng() % l.num_pages);
    const size_t n = pages.size();
    // Device copies of the cache, the page list, block and packed buffers.
    std::vector<uint8_t*> dbases(l.layers), dblocks(n), dpacked(n);
    for (uint32_t i = 0; i < l.layers; ++i) {
      cudaMalloc(&dbases[i], l.layer_bytes());
      cudaMemcpy(dbases[i], cache[i].data(), l.layer_bytes(), cudaMemcpyHostToDevice);
    }
    for (size_t i = 0; i < n; ++i) {
      cudaMalloc(&dblocks[i], l.block_bytes());
      cudaMalloc(&dpacked[i], l.packed_bytes());
    }
    uint8_t **d_bases, **d_blocks, **d_packed;
    uint32_t* d_pages;
    cudaMalloc(&d_bases, l.layers * sizeof(void*));
    cudaMalloc(&d_blocks, n * sizeof(void*));
    cudaMalloc(&d_packed, n * sizeof(void*));
    cudaMalloc(&d_pages, n * 4);
    cudaMemcpy(d_bases, dbases.data(), l.layers * sizeof(void*), cudaMemcpyHostToDevice);
    cudaMemcpy(d_blocks, dblocks.data(), n * sizeof(void*), cudaMemcpyHostToDevice);
    cudaMemcpy(d_packed, dpacked.data(), n * sizeof(void*), cudaMemcpyHostToDevice);
    cudaMemcpy(d_pages, pages.data(), n * 4, cudaMemcpyHostToDevice);
    ASSERT_TRUE(GatherCuda(l, d_bases, d_pages, n, d_blocks, nullptr).ok());
    ASSERT_TRUE(PackInt8Cuda(l, d_blocks, n, d_packed, nullptr).ok());
    cudaDeviceSynchronize();
    std::vector<const uint8_t*> bases;
    for (auto& v : cache) bases.push_back(v.data());
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint8_t> cpu(l.block_bytes()), gpu(l.block_bytes());
      uint8_t* cp = cpu.data();
      GatherCpu(l, bases.data(), &pages[i], 1, &cp);
      cudaMemcpy(gpu.data(), dblocks[i], l.block_bytes(), cudaMemcpyDeviceToHost);
      ASSERT_EQ(cpu, gpu) << "gather, round " << round;
      std::vector<uint8_t> cpk(l.packed_bytes()), gpk(l.packed_bytes());
      ASSERT_TRUE(PackInt8Cpu(l, cpu.data(), cpk.data()).ok());
      cudaMemcpy(gpk.data(), dpacked[i], l.packed_bytes(), cudaMemcpyDeviceToHost);
      ASSERT_EQ(cpk, gpk) << "pack, round " << round;
    }
    ASSERT_TRUE(UnpackInt8Cuda(l, d_packed, n, d_blocks, nullptr).ok());
    ASSERT_TRUE(ScatterCuda(l, d_bases, d_pages, n, d_blocks, nullptr).ok());
    cudaDeviceSynchronize();
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint8_t> cpk(l.packed_bytes()), cun(l.block_bytes()), gun(l.block_bytes());
      cudaMemcpy(cpk.data(), dpacked[i], l.packed_bytes(), cudaMemcpyDeviceToHost);
      ASSERT_TRUE(UnpackInt8Cpu(l, cpk.data(), cun.data()).ok());
      cudaMemcpy(gun.data(), dblocks[i], l.block_bytes(), cudaMemcpyDeviceToHost);
      ASSERT_EQ(cun, gun) << "unpack, round " << round;
    }
    for (auto* p : dbases) cudaFree(p);
    for (size_t i = 0; i < n; ++i) {
      cudaFree(dblocks[i]);
      cudaFree(dpacked[i]);
    }
    cudaFree(d_bases);
    cudaFree(d_blocks);
    cudaFree(d_packed);
    cudaFree(d_pages);
  }
}
#else
TEST(GpuCuda, KernelsMatchTheCpuByteForByte) {
  GTEST_SKIP() << "built without nvcc: no CUDA kernels to test";
}
#endif

}  // namespace
}  // namespace kvtier::gpu
