/*
 * activations.cuh — the elementwise activations of the fused kernels and their derivatives, in fp32:
 *
 *   gelu (exact):  a(v) = v·Φ(v) = ½v(1 + erf(v/√2)),         a'(v) = Φ(v) + v·φ(v)
 *   gelu_tanh:     a(v) = ½v(1 + tanh(u)) = v·σ(2u), u = √(2/π)(v + 0.044715 v³), a'(v) by the chain rule
 *   silu:          a(v) = v·σ(v),  σ(v) = 1/(1 + e^{−v}),      a'(v) = σ(v)·(1 + v·(1 − σ(v)))
 *
 * Used by bias_act_dropout.cu (act(x + bias)) and glu.cu (act(gate)·up). Each `<act>_and_grad` returns a(v)
 * and writes a'(v) from the same exponential, for a backward that needs both; `<act>_grad` is a'(v) alone
 * (the compiler drops the unused value).
 *
 * Numerics, chosen to stay as accurate as PyTorch's own fp32 activations under --use_fast_math:
 * - Φ comes from a short erfc approximation (normal_cdf) rather than erff, for speed.
 * - gelu_tanh has no tanh: ½v(1 + tanh(u)) = v·σ(2u), one exponential (__expf) and one division. tanhf
 *   under fast-math is tanh.approx (≈ 2^-11 relative error), too coarse; an accurate tanh (from expm1f)
 *   costs several times more and made the fused kernel compute-bound. The sigmoid form also has no
 *   cancellation in 1 + tanh(u) for negative v, where PyTorch's fp32 formula loses digits.
 * - silu is v / (1 + e^{−v}) with an IEEE division (__fdiv_rn, which fast-math leaves alone), PyTorch's
 *   formula and rounding: only e^{−v} differs, from __expf (ex2.approx of −v·log2 e: relative error
 *   ≈ 2^-22 + |v|·2^-24, which matters only where e^{−v} is not small next to 1, i.e. where |silu| < 0.3).
 *   fast-math's approximate division (≤ 2 ulp) would make silu's error near |v| ≈ 16 about twice PyTorch's.
 *   silu' is PyTorch's silu_backward formula with σ = __frcp_rn(1 + e^{−v}). e^{−v} overflows to inf below
 *   v ≈ −88, giving σ = 0 and a = −0 (PyTorch: the same limit); NaN propagates.
 */
#pragma once

#include <cuda_runtime.h>

namespace lsmini {
namespace {

constexpr float kSqrt1_2 = 0.70710678118654752f;      // 1/√2
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1/√(2π)
constexpr float kSqrt2_Pi = 0.79788456080286536f;     // √(2/π)
constexpr float kGeluTanhCubic = 0.044715f;

// Φ(v), the standard normal CDF, via erfc(z) ≈ t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))·e^{−z²},
// t = 1/(1 + p·z), z = |v|/√2 (Abramowitz & Stegun 7.1.26, |error| ≤ 1.5e-7). Why not erff: libdevice's
// erff costs ≈ 30 instructions per element here, which with Philox makes the fused kernel compute-
// bound on an H200; this costs ≈ 12 plus two MUFU ops, and its error (≤ 5e-7 on gelu over [−12, 12],
// checked against float64) is below PyTorch's own fp32 gelu error. The same e^{−v²/2} is the normal
// density's numerator, so the backward gets φ(v) for one multiply. NaN propagates; ±inf give 1 / 0.
__device__ __forceinline__ float normal_cdf(float v, float* gauss) {
  // Constants folded so each step is one FMA/MUL: p/√2 (z = |v|/√2), the a_k halved (Φ = ½·erfc),
  // −½·log2(e) (e^{−v²/2} as one ex2).
  constexpr float p_s = 0.3275911f * kSqrt1_2;
  constexpr float a1 = 0.5f * 0.254829592f, a2 = 0.5f * -0.284496736f, a3 = 0.5f * 1.421413741f,
                  a4 = 0.5f * -1.453152027f, a5 = 0.5f * 1.061405429f;
  constexpr float kNegHalfLog2e = -0.72134752044448170f;
  const float t = 1.f / fmaf(p_s, fabsf(v), 1.f);
  const float q = fmaf(fmaf(fmaf(fmaf(a5, t, a4), t, a3), t, a2), t, a1) * t;
  *gauss = exp2f(v * v * kNegHalfLog2e);
  const float half_erfc = q * *gauss;
  return v >= 0.f ? 1.f - half_erfc : half_erfc;
}

// ---- gelu (exact) ----
__device__ __forceinline__ float gelu(float v) {
  float gauss;
  return v * normal_cdf(v, &gauss);
}

__device__ __forceinline__ float gelu_and_grad(float v, float* grad) {
  float gauss;
  const float cdf = normal_cdf(v, &gauss);
  *grad = fmaf(v * kInvSqrt2Pi, gauss, cdf);  // Φ(v) + v·φ(v)
  return v * cdf;
}

__device__ __forceinline__ float gelu_grad(float v) {
  float grad;
  gelu_and_grad(v, &grad);
  return grad;
}

// ---- gelu_tanh ----
// e^{−2u} with 2u = 2·√(2/π)·(v + 0.044715·v³), the exponent capped at 80: below v ≈ −9.7, σ(2u) < 2e-35
// and gelu_tanh is 0 to fp32 precision, and the cap keeps e and e·σ² (the derivative) finite. NaN passes
// through v in the callers; v = −inf gives −inf (PyTorch's formula: NaN), non-finite either way.
__device__ __forceinline__ float gelu_tanh_exp(float v, float v2) {
  return __expf(fminf(-2.f * kSqrt2_Pi * fmaf(kGeluTanhCubic * v, v2, v), 80.f));
}

__device__ __forceinline__ float gelu_tanh(float v) { return __fdividef(v, 1.f + gelu_tanh_exp(v, v * v)); }

__device__ __forceinline__ float gelu_tanh_and_grad(float v, float* grad) {
  // a = v·s, s = σ(2u); a' = s + v·2u'·(1 − s)·s with 1 − s = e·s (no cancellation; e·s ≤ 1 and is
  // formed first: e·s·s could overflow or underflow) and 2u' = 2·√(2/π)·(1 + 3·0.044715·v²)
  const float v2 = v * v;
  const float e = gelu_tanh_exp(v, v2);
  const float s = __fdividef(1.f, 1.f + e);
  const float du2 = 2.f * kSqrt2_Pi * fmaf(3.f * kGeluTanhCubic, v2, 1.f);
  *grad = fmaf(v * du2 * (e * s), s, s);
  return v * s;
}

__device__ __forceinline__ float gelu_tanh_grad(float v) {
  float grad;
  gelu_tanh_and_grad(v, &grad);
  return grad;
}

// ---- silu ----
__device__ __forceinline__ float silu(float v) { return __fdiv_rn(v, 1.f + __expf(-v)); }

__device__ __forceinline__ float silu_and_grad(float v, float* grad) {
  const float d = 1.f + __expf(-v);
  const float s = __frcp_rn(d);  // σ(v)
  *grad = s * fmaf(v, 1.f - s, 1.f);
  return __fdiv_rn(v, d);
}

}  // namespace
}  // namespace lsmini
