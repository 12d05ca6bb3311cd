/*
 * layernorm_fwd_shapes.cu — LayerNorm forward (fp16 rows, fp16 γ/β) in three kernel shapes beside lsmini's
 * launch_layernorm_fwd, in one process, as % of a device-to-device cudaMemcpy. Not part of the build: a
 * measurement to steer the forward's changes (docs/performance-notes.md says what such measurements decided).
 *
 *   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
 *        -Icsrc/kernels benchmarks/probes/layernorm_fwd_shapes.cu csrc/kernels/layernorm.cu -o /tmp/ln_shapes
 *   /tmp/ln_shapes
 *
 * Shapes, over 65536 rows of hidden 512, 1024 and 4096 (the math is the kernel's: shifted one-pass sums,
 * biased variance, y = (x − μ)·r·γ + β):
 *   warp_row        one warp a row held in registers, 8 rows a 256-thread block, no block barrier;
 *   warp_row_capped the same at ≤ 40 registers (__launch_bounds__(256, 6));
 *   staged_rows     persistent blocks; the bulk copy engine loads tiles of WARPS consecutive rows into
 *                   STAGES shared-memory stages (mbarrier), each warp reduces its row out of shared memory
 *                   and writes y over it, one thread stores the tile with one bulk copy and refills the
 *                   stage once the store has read it (sm_90).
 * Times are CUDA events around 50 back-to-back launches after 5 warm-up ones. Bytes: x read and y written
 * once, 8 bytes of μ and r a row.
 */
#include "layernorm.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    const cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                        \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));        \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Σ(x − shift) and Σ(x − shift)² over one 16-byte vector.
__device__ __forceinline__ void add_sums(uint4 xv, float shift, float& s, float& ss) {
  const __half2* h = reinterpret_cast<const __half2*>(&xv);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]);
    const float d0 = f.x - shift, d1 = f.y - shift;
    s += d0 + d1;
    ss += d0 * d0 + d1 * d1;
  }
}

// y for one 16-byte vector c of the row.
__device__ __forceinline__ uint4 normalize(uint4 xv, const __half* w, const __half* b, int c, float mu, float r) {
  const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w) + c), bv = __ldg(reinterpret_cast<const uint4*>(b) + c);
  const __half2 *h = reinterpret_cast<const __half2*>(&xv), *wh = reinterpret_cast<const __half2*>(&wv),
                *bh = reinterpret_cast<const __half2*>(&bv);
  uint4 out;
  __half2* oh = reinterpret_cast<__half2*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]), ww = __half22float2(wh[j]), bb = __half22float2(bh[j]);
    oh[j] = __floats2half2_rn((f.x - mu) * r * ww.x + bb.x, (f.y - mu) * r * ww.y + bb.y);
  }
  return out;
}

template <int H>
__device__ __forceinline__ void warp_row_body(const __half* x, const __half* w, const __half* b, __half* y,
                                              float* mean, float* rstd, int64_t rows, float eps) {
  constexpr int VPT = H / 8 / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows) return;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * H);
  uint4 xv[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) xv[k] = xr[lane + 32 * k];
  const float shift = __half2float(x[row * H]);
  float s = 0.f, ss = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) add_sums(xv[k], shift, s, ss);
  s = warp_sum(s);
  ss = warp_sum(ss);
  const float mu_s = s / H, r = rsqrtf(fmaxf(ss / H - mu_s * mu_s, 0.f) + eps), mu = shift + mu_s;
  if (lane == 0) mean[row] = mu, rstd[row] = r;
#pragma unroll
  for (int k = 0; k < VPT; ++k)
    reinterpret_cast<uint4*>(y + row * H)[lane + 32 * k] = normalize(xv[k], w, b, lane + 32 * k, mu, r);
}

template <int H>
__global__ void __launch_bounds__(256) warp_row(const __half* x, const __half* w, const __half* b, __half* y,
                                                float* mean, float* rstd, int64_t rows, float eps) {
  warp_row_body<H>(x, w, b, y, mean, rstd, rows, eps);
}

template <int H>
__global__ void __launch_bounds__(256, 6) warp_row_capped(const __half* x, const __half* w, const __half* b,
                                                          __half* y, float* mean, float* rstd, int64_t rows,
                                                          float eps) {
  warp_row_body<H>(x, w, b, y, mean, rstd, rows, eps);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

template <int H, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) staged_rows(const __half* x, const __half* w, const __half* b,
                                                          __half* y, float* mean, float* rstd, int64_t tiles,
                                                          float eps) {
  constexpr int VPT = H / 8 / 32;
  constexpr uint32_t kTile = WARPS * H * 2;
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ __align__(8) uint64_t full[STAGES];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto tile_of = [&](int i) { return int64_t(blockIdx.x) + int64_t(i) * gridDim.x; };
  auto load = [&](int i) {
    const int64_t t = tile_of(i);
    if (t >= tiles) return;
    const uint32_t bar = smem_addr(&full[i % STAGES]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kTile) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(stages + (i % STAGES) * kTile)), "l"(x + t * WARPS * H), "r"(kTile), "r"(bar)
                 : "memory");
  };
  if (threadIdx.x == 0) {
    for (int k = 0; k < STAGES; ++k)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&full[k])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int i = 0; i < STAGES; ++i) load(i);
  }
  __syncthreads();
  for (int i = 0; tile_of(i) < tiles; ++i) {
    const int64_t t = tile_of(i);
    unsigned char* stage = stages + (i % STAGES) * kTile;
    uint4* rs = reinterpret_cast<uint4*>(stage + warp * H * 2);
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT_%=;\n}\n"
                 :: "r"(smem_addr(&full[i % STAGES])), "r"((i / STAGES) & 1)
                 : "memory");
    const float shift = __half2float(*reinterpret_cast<const __half*>(rs));
    float s = 0.f, ss = 0.f;
#pragma unroll 4
    for (int k = 0; k < VPT; ++k) add_sums(rs[lane + 32 * k], shift, s, ss);
    s = warp_sum(s);
    ss = warp_sum(ss);
    const float mu_s = s / H, r = rsqrtf(fmaxf(ss / H - mu_s * mu_s, 0.f) + eps), mu = shift + mu_s;
    const int64_t row = t * WARPS + warp;
    if (lane == 0) mean[row] = mu, rstd[row] = r;
#pragma unroll 4
    for (int k = 0; k < VPT; ++k) rs[lane + 32 * k] = normalize(rs[lane + 32 * k], w, b, lane + 32 * k, mu, r);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // y in shared memory, before the bulk store
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                   :: "l"(y + t * WARPS * H), "r"(smem_addr(stage)), "r"(kTile)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      if (i > 0) {  // refill the previous tile's stage once its store has read it
        asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        load(i - 1 + STAGES);
      }
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

constexpr int64_t kRows = 65536;
constexpr float kEps = 1e-5f;
int g_sms = 0;
double g_copy_gbs = 0;
__half *g_x, *g_y, *g_w, *g_b;
float *g_mean, *g_rstd;

template <typename F>
float time_ms(F launch) {
  for (int i = 0; i < 5; ++i) launch();
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < 50; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms / 50;
}

// Runs launch once, compares y with ref (when given), times it and prints one row.
template <typename F>
std::vector<__half> row(const char* name, int hidden, int regs, F launch, const std::vector<__half>* ref) {
  const size_t n = size_t(kRows) * hidden;
  CHECK(cudaMemset(g_y, 0, n * 2));
  launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<__half> y(n);
  CHECK(cudaMemcpy(y.data(), g_y, n * 2, cudaMemcpyDeviceToHost));
  float diff = 0.f;
  if (ref)
    for (size_t i = 0; i < n; ++i) diff = std::max(diff, std::fabs(__half2float(y[i]) - __half2float((*ref)[i])));
  const float ms = time_ms(launch);
  const double gbs = (4.0 * hidden + 8) * kRows / ms / 1e6;
  std::printf("  %-48s %4d regs  %.4f ms  %5.0f GB/s  %5.1f%% of copy", name, regs, ms, gbs, 100 * gbs / g_copy_gbs);
  if (ref) std::printf("  max |y - warp_row| %.3g", diff);
  std::printf("\n");
  return y;
}

template <typename K>
int regs_of(K kernel) {
  cudaFuncAttributes a;
  CHECK(cudaFuncGetAttributes(&a, kernel));
  return a.numRegs;
}

template <int H, int WARPS, int STAGES>
void staged(const std::vector<__half>& ref) {
  auto kernel = staged_rows<H, WARPS, STAGES>;
  const int smem = WARPS * H * 2 * STAGES;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, WARPS * 32, smem));
  const int64_t tiles = kRows / WARPS;
  const int grid = int(std::min<int64_t>(tiles, int64_t(per_sm) * g_sms));
  char name[96];
  std::snprintf(name, sizeof(name), "staged_rows %2d rows a tile, %d stages (%d/SM)", WARPS, STAGES, per_sm);
  row(name, H, regs_of(kernel), [&] {
    kernel<<<grid, WARPS * 32, smem>>>(g_x, g_w, g_b, g_y, g_mean, g_rstd, tiles, kEps);
  }, &ref);
}

template <int H>
void hidden_size() {
  std::printf("hidden %d, %lld rows\n", H, (long long)kRows);
  const int blocks = int(kRows / 8);
  const std::vector<__half> ref = row("warp_row", H, regs_of(warp_row<H>), [&] {
    warp_row<H><<<blocks, 256>>>(g_x, g_w, g_b, g_y, g_mean, g_rstd, kRows, kEps);
  }, nullptr);
  row("warp_row_capped", H, regs_of(warp_row_capped<H>), [&] {
    warp_row_capped<H><<<blocks, 256>>>(g_x, g_w, g_b, g_y, g_mean, g_rstd, kRows, kEps);
  }, &ref);
  row("lsmini launch_layernorm_fwd", H, 0, [&] {
    CHECK((lsmini::launch_layernorm_fwd<__half, __half>(g_x, g_w, g_b, g_y, g_mean, g_rstd, kRows, H, kEps, 0)));
  }, &ref);
  if constexpr (H <= 1024) {
    staged<H, 8, 4>(ref);
    staged<H, 16, 4>(ref);
    staged<H, 4, 8>(ref);
  } else {
    staged<H, 8, 3>(ref);
    staged<H, 4, 4>(ref);
    staged<H, 2, 6>(ref);
  }
}

}  // namespace

int main() {
  CHECK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t n = size_t(kRows) * 4096;
  CHECK(cudaMalloc(&g_x, n * 2));
  CHECK(cudaMalloc(&g_y, n * 2));
  CHECK(cudaMalloc(&g_w, 4096 * 2));
  CHECK(cudaMalloc(&g_b, 4096 * 2));
  CHECK(cudaMalloc(&g_mean, kRows * 4));
  CHECK(cudaMalloc(&g_rstd, kRows * 4));
  std::vector<__half> h(n);
  uint32_t state = 7;
  for (size_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    h[i] = __float2half(((state >> 8) * (1.0f / 16777216.0f) - 0.5f) * 4.f);
  }
  CHECK(cudaMemcpy(g_x, h.data(), n * 2, cudaMemcpyHostToDevice));
  for (int i = 0; i < 4096; ++i) h[i] = __float2half(1.f + 0.001f * (i % 17));
  CHECK(cudaMemcpy(g_w, h.data(), 4096 * 2, cudaMemcpyHostToDevice));
  for (int i = 0; i < 4096; ++i) h[i] = __float2half(0.01f * (i % 13));
  CHECK(cudaMemcpy(g_b, h.data(), 4096 * 2, cudaMemcpyHostToDevice));

  const float copy_ms = time_ms([&] { CHECK(cudaMemcpyAsync(g_y, g_x, n * 2, cudaMemcpyDeviceToDevice)); });
  g_copy_gbs = 2.0 * n * 2 / copy_ms / 1e6;
  std::printf("cudaMemcpy device to device: %.0f GB/s\n", g_copy_gbs);
  hidden_size<512>();
  hidden_size<1024>();
  hidden_size<4096>();
  return 0;
}
