/*
 * rms_norm_bwd.cu — RMSNorm backward: dx (with an optional gradient added) and the fp32 partials of dw
 * per block, then column_partials.cuh's sum_column_partials to sum them. The math, layout and work split
 * are described at the top of rms_norm.cu.
 */
#include "rms_norm.cuh"

#include "column_partials.cuh"

namespace lsmini {
namespace {

// NW > 0: rows of warps (rms_norm.cuh): NW warps a row (blockDim = (32·NW, kWarpRows / NW)) of exactly 32·NW·VPT
// vectors, thread x owning vectors x + 32·NW·k: no bounds checks, the weight held in registers, and each row's
// warps walking their rows with no block barrier until the partials; two warps or more meet at a named barrier of
// their own row for its sum. NW = 0: a group of row_groups.cuh (blockDim.x ≥ 32 threads a row, VPT a power of two,
// a block barrier a row when the group is wider than a warp). ADD: add is given (not null).
// partials: [gridDim.x, hidden] fp32, or null when dw is not wanted.
template <typename T, typename W, int VEC, int VPT, int NW, bool ADD>
__global__ void __launch_bounds__(NW > 0 ? 32 * kWarpRows : kRmsBwdMaxThreads)
rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                    const float* __restrict__ rstd, const T* __restrict__ add, T* __restrict__ dx,
                    float* __restrict__ partials, int64_t rows, int hidden) {
  wait_for_previous_kernel();  // before any access to global memory
  constexpr bool WARP = NW > 0;
  static_assert(NW <= 1 || (NW <= 4 && kWarpRows <= 4 * NW), "named barriers 1-4: one a row");
  __shared__ float smem[32];
  __shared__ float slot[2][NW > 1 ? kWarpRows / NW : 1][NW > 1 ? NW : 1];  // rows of warps: their sums, by row parity
  int parity = 0;
  extern __shared__ float fold[];  // [R][hidden] when R > 1 and partials are wanted
  const int nvec = hidden / VEC;
  const float inv_h = 1.f / hidden;
  const int G = WARP ? 32 * NW : blockDim.x;
  auto in_row = [&](int c) { return WARP || c < nvec; };
  // The scalar path's long rows (more than 16 elements a thread: hidden > 8192 not a multiple of the vector
  // width, or unaligned pointers, a rare fallback) keep their loops rolled: fully unrolled, their arrays
  // spill anyway, and those instantiations dominate this file's compile time.
  constexpr int kUnroll = (VEC == 1 && VPT > 16) ? 1 : VPT;
  // Short rows load the next row before this row's reduction, so that the loads overlap it; long rows keep
  // enough bytes in flight on their own and would run out of registers. Warp rows of 32 elements a thread
  // prefetch too (they hold more than 128 registers either way), those of 24 do not: the prefetch would take
  // them past 128 registers and halve the blocks an SM holds.
  constexpr bool kPrefetch = VPT * VEC <= 16 || (WARP && VPT * VEC == 32);

  float acc[VPT][VEC];  // Σ dy·x̂ over the rows this thread visits, per owned column
#pragma unroll kUnroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[k][j] = 0.f;
  float wr[WARP ? VPT : 1][VEC];  // the warp path's weight, in registers
  if constexpr (WARP) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) load_or<W, VEC>(weight, threadIdx.x + k * G, 1.f, wr[k]);
  }
  auto weight_at = [&](int k, int c, float (&w)[VEC]) {
    if constexpr (WARP) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[j] = wr[k][j];
    } else {
      load_or<W, VEC>(weight, c, 1.f, w);
    }
  };

  Pack<T, VEC> xv[VPT], dv[VPT];
  float r = 0.f;
  auto load_row = [&](int64_t row, Pack<T, VEC>(&xs)[VPT], Pack<T, VEC>(&ds)[VPT], float& rs) {
    if (row >= rows) return;
    rs = rstd[row];
#pragma unroll kUnroll
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * G;
      if (in_row(c)) {
        xs[k] = *reinterpret_cast<const Pack<T, VEC>*>(x + row * hidden + c * VEC);
        ds[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + row * hidden + c * VEC);
      }
    }
  };

  // Groups: the loop bound is uniform over the block (group_sum has barriers); rows past the end idle. Warps
  // stop at their own last row.
  const int64_t stride = int64_t(gridDim.x) * blockDim.y;
  const int64_t first = int64_t(blockIdx.x) * blockDim.y;
  if constexpr (kPrefetch) load_row(first + threadIdx.y, xv, dv, r);
  for (int64_t base = first; base < rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    if (WARP && !valid) break;
    Pack<T, VEC> xn[VPT], dn[VPT];
    float rn = 0.f;
    if constexpr (kPrefetch) {
      load_row(row + stride, xn, dn, rn);
    } else {
      load_row(row, xv, dv, r);
    }

    float s = 0.f;  // Σ g·x̂ over the thread's elements
#pragma unroll kUnroll
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * G;
      if (valid && in_row(c)) {
        float xf[VEC], df[VEC], w[VEC];
        unpack(xv[k], xf);
        unpack(dv[k], df);
        weight_at(k, c, w);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xh = xf[j] * r;
          s += df[j] * w[j] * xh;
          acc[k][j] += df[j] * xh;
        }
      }
    }
    if constexpr (NW > 1) {
      s = row_warps_sum<NW>(warp_sum(s), slot[parity]);
      parity ^= 1;
    } else {
      s = WARP ? warp_sum(s) : group_sum(s, smem);
    }
    if (valid) {
      // dx = r·g − x̂·(r·mean(g·x̂)) + add
      const float c_b = -r * s * inv_h;
      T* dxr = dx + row * hidden;
#pragma unroll kUnroll
      for (int k = 0; k < VPT; ++k) {
        const int c = threadIdx.x + k * G;
        if (in_row(c)) {
          float xf[VEC], df[VEC], w[VEC], out[VEC];
          unpack(xv[k], xf);
          unpack(dv[k], df);
          weight_at(k, c, w);
          if constexpr (ADD) {
            load_pack<T, VEC>(add + row * hidden + c * VEC, out);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) out[j] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] += fmaf(r, df[j] * w[j], xf[j] * r * c_b);
          store_pack<T, VEC>(dxr + c * VEC, out);
        }
      }
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        xv[k] = xn[k];
        dv[k] = dn[k];
      }
      r = rn;
    }
  }

  if (partials == nullptr) return;
  allow_dependent_launch();  // what is left is the partial row: the column sums may be scheduled
  // The thread's sums go straight into the block's partial row when the block holds one row, else into
  // shared memory, to be folded over its R rows in the order y = 0, 1, … (deterministic for a given grid).
  const int R = blockDim.y;
  float* prow = partials + int64_t(blockIdx.x) * hidden;
  float* dst = R == 1 ? prow : fold + threadIdx.y * hidden;
#pragma unroll kUnroll
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * G;
    if (in_row(c))
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[c * VEC + j] = acc[k][j];
  }
  if (R == 1) return;
  __syncthreads();
  for (int col = threadIdx.y * G + threadIdx.x; col < hidden; col += G * R) {
    float t = 0.f;
    for (int y = 0; y < R; ++y) t += fold[y * hidden + col];
    prow[col] = t;
  }
}

template <typename T, typename W, int VEC, int VPT, int NW>
cudaError_t bwd_launch(dim3 block, const T* dy, const T* x, const W* w, const float* rstd, const T* add, T* dx,
                       float* partials, int64_t rows, int hidden, int64_t max_parts, int64_t* parts_used,
                       cudaStream_t stream) {
  auto launch = [&](auto kernel) {
    const size_t fold_bytes = (partials && block.y > 1) ? size_t(block.y) * hidden * sizeof(float) : 0;  // ≤ 32 KB
    // One resident wave of blocks, each walking its rows grid-stride; no more blocks than partial rows or rows.
    int64_t grid = int64_t(sm_count()) * resident_blocks_per_sm(kernel, block.x * block.y, fold_bytes);
    if (partials) grid = std::min(grid, max_parts);
    grid = std::min(grid, (rows + block.y - 1) / block.y);
    *parts_used = grid;
    return launch_dependent(kernel, dim3(unsigned(grid)), block, fold_bytes, stream, dy, x, w, rstd, add, dx, partials,
                            rows, hidden);
  };
  return add ? launch(rms_norm_bwd_kernel<T, W, VEC, VPT, NW, true>)
             : launch(rms_norm_bwd_kernel<T, W, VEC, VPT, NW, false>);
}

template <typename T, typename W, int VEC>
cudaError_t bwd_dispatch(const T* dy, const T* x, const W* w, const float* rstd, const T* add, T* dx,
                         float* partials, int64_t rows, int hidden, int64_t max_parts, int64_t* parts_used,
                         cudaStream_t stream) {
  const int nvec = hidden / VEC;
  // Rows of warps on the vector path (the scalar fallback keeps to the groups: fewer instantiations).
  if constexpr (VEC > 1) {
    auto warps = [&](auto nw) {
      constexpr int NW = decltype(nw)::value;
      return with_count<(NW > 1 ? 2 : 1), kWarpRowMaxVpt>(nvec / (32 * NW), [&](auto vpt) {
        return bwd_launch<T, W, VEC, decltype(vpt)::value, NW>(dim3(32 * NW, kWarpRows / NW), dy, x, w, rstd, add,
                                                               dx, partials, rows, hidden, max_parts, parts_used,
                                                               stream);
      });
    };
    switch (bwd_row_warps(nvec)) {
      case 1: return warps(std::integral_constant<int, 1>{});
      case 2: return warps(std::integral_constant<int, 2>{});
      case 4: return warps(std::integral_constant<int, 4>{});
      default: break;
    }
  }
  const RowGroups cfg = row_groups(hidden, VEC, kRmsBwdMaxThreads, 16);
  return with_vpt<1, (VEC == 1 ? 64 : 64 / VEC)>(cfg.vpt, [&](auto vpt) {
    return bwd_launch<T, W, VEC, decltype(vpt)::value, 0>(dim3(cfg.G, cfg.R), dy, x, w, rstd, add, dx, partials,
                                                          rows, hidden, max_parts, parts_used, stream);
  });
}

}  // namespace

int64_t rms_norm_bwd_partial_rows(int64_t rows) {
  const int64_t cap = int64_t(8) * sm_count();  // ≥ resident blocks: G·R ≥ 256 threads, ≤ 2048 per SM
  return rows < cap ? rows : cap;
}

template <typename T, typename W>
cudaError_t launch_rms_norm_bwd(const T* dy, const T* x, const W* weight, const float* rstd, const T* add, T* dx,
                                W* dweight, float* partials, int64_t rows, int hidden, ColumnSums* sums,
                                cudaStream_t stream) {
  if (hidden <= 0 || hidden > kRmsNormMaxHidden) return cudaErrorInvalidValue;
  if (dweight && (!weight || (rows > 0 && !partials))) return cudaErrorInvalidValue;
  if (!dweight) partials = nullptr;
  int64_t parts = 0;  // rows == 0: no partial rows, and the column sums write zeros
  if (rows > 0) {
    const int64_t max_parts = rms_norm_bwd_partial_rows(rows);
    const cudaError_t err =
        rms_norm_vectorizable<T, W>(hidden, weight, {dy, x, add, dx})
            ? bwd_dispatch<T, W, Vec16<T>::value>(dy, x, weight, rstd, add, dx, partials, rows, hidden, max_parts,
                                                  &parts, stream)
            : bwd_dispatch<T, W, 1>(dy, x, weight, rstd, add, dx, partials, rows, hidden, max_parts, &parts, stream);
    if (err != cudaSuccess) return err;
  }
  if (!dweight) return cudaSuccess;
  return finish_column_partials<W>(partials, parts, hidden, dweight, sums, stream);
}

#define LSMINI_INSTANTIATE_RMS_NORM_BWD(T, W)                                                                   \
  template cudaError_t launch_rms_norm_bwd<T, W>(const T*, const T*, const W*, const float*, const T*, T*, W*, \
                                                 float*, int64_t, int, ColumnSums*, cudaStream_t);
LSMINI_FOR_RMS_NORM_TYPES(LSMINI_INSTANTIATE_RMS_NORM_BWD)

}  // namespace lsmini
