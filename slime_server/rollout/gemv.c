/* The decode step's matmuls: y[m, n] = epilogue(sum_k pre(x)[m, k] * W[n, k]) for a few rows m.

   Why: at decode a matmul reads each weight once for a handful of rows of x, so its speed is the speed
   at which the weights stream in. torch's fp32 kernels read them at 17 (MKL) to 31 (oneDNN) GB/s on the
   2-core AMD EPYC the benchmarks ran on; this loop at ~40, its bf16 twin at ~37 (half the bytes). The
   small ops around a matmul cost more than their arithmetic in torch (a call each, a bf16 conversion
   each), so the ones a Llama layer puts there are folded in:
     pre  0: x as given; 1: RMSNorm of x with weight pre_w and eps; 2: silu(gate) * up, x being [m, 2k]
          (gate | up, the fused gate/up matmul's output);
     epilogue: + bias (when given), then + resid (when given; [m, n], the residual stream).
   Rounding as the engine's torch ops round (lean_forward.py): fp32 throughout in fp32; in bf16 each op's
   result rounded to bf16 (nearest even) as torch rounds it: F.rms_norm's x * rsqrt(mean(x^2) + eps) * w in
   fp32, rounded once; silu(gate) rounded, times up, rounded; the matmul with its bias rounded once, its
   products accumulated in fp32 (AVX512-BF16); the residual sum rounded.

   Layout: W row-major with row stride ld (elements; rows may be views into a fused tensor), x, resid and
   y contiguous. Each thread takes a contiguous share of W's rows, R at a time, and every block of R rows
   is multiplied by all m rows of x (MX at a time) while it is in L1, so W is read from memory once
   whatever m is. gemv.py builds this for the machine it runs on; without AVX-512 (and AVX512-BF16 for the
   bf16 kernel) the symbols are absent and the engine keeps torch's ops. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define R 8  /* rows of W per block: 8 independent FMA chains per row of x; a block (R * k) stays in L1 */
#define MX 3 /* rows of x per pass over a block: R * MX accumulators + MX x vectors + a W vector fit the 32
                registers (MX 4 spills: SmolLM2 at 8 rows 24 ms of matmuls per step, 22.5 with MX 3) */
#define INLINE static inline __attribute__((always_inline))
#define PRE_NONE 0
#define PRE_RMSNORM 1
#define PRE_SILU_MUL 2

INLINE float silu(float g) { return g / (1.f + expf(-g)); }

/* exp of 16 floats (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial, scaled by 2^n;
   within 2 ulp of expf over the clamped range): libm's expf is scalar, and silu over a 1536-wide MLP row
   took 11 us a row with it. */
INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

/* out[j] = silu(g[j]) for j < k */
static void silu_row(const float* g, float* out, int64_t k) {
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    __m512 v = _mm512_loadu_ps(g + j);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(out + j, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  }
  for (; j < k; j++) out[j] = silu(g[j]);
}

/* ---------------------------------------------------------------------------------------------- fp32 */

/* pre(x) for fp32: rows of k into out (k elements each), or NULL when pre is none (x is used as is). */
static float* pre_f32(const float* x, int64_t m, int64_t k, int pre, const float* pre_w, float eps) {
  if (pre == PRE_NONE) return NULL;
  float* out = (float*)malloc((size_t)(m * k) * sizeof(float));
  if (out == NULL) return NULL;
  for (int64_t a = 0; a < m; a++) {
    if (pre == PRE_RMSNORM) {
      const float* xr = x + a * k;
      float ss = 0.f;
      for (int64_t j = 0; j < k; j++) ss += xr[j] * xr[j];
      float s = 1.f / sqrtf(ss / (float)k + eps);
      for (int64_t j = 0; j < k; j++) out[a * k + j] = pre_w[j] * (xr[j] * s);
    } else {
      const float* g = x + a * 2 * k;
      silu_row(g, out + a * k, k);
      for (int64_t j = 0; j < k; j++) out[a * k + j] *= g[k + j];
    }
  }
  return out;
}

/* One block of R rows of W times XS rows of x; XS and R are constants at every call, so the accumulators
   live in registers. */
INLINE void block_f32(const float* W, const float* x, float* y, const float* bias, const float* resid, int64_t o,
                      int64_t n, int64_t k, int64_t ld, const int XS) {
  __m512 acc[MX][R];
  int64_t k16 = k - k % 16;
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) acc[a][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k16; i += 16) {
    __m512 xv[MX];
    for (int a = 0; a < XS; a++) xv[a] = _mm512_loadu_ps(x + a * k + i);
    for (int r = 0; r < R; r++) {
      __m512 wv = _mm512_loadu_ps(W + (o + r) * ld + i);
      for (int a = 0; a < XS; a++) acc[a][r] = _mm512_fmadd_ps(wv, xv[a], acc[a][r]);
    }
  }
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) {
      float s = _mm512_reduce_add_ps(acc[a][r]);
      for (int64_t j = k16; j < k; j++) s += W[(o + r) * ld + j] * x[a * k + j];
      if (bias) s += bias[o + r];
      if (resid) s = resid[a * n + o + r] + s;
      y[a * n + o + r] = s;
    }
}

int slime_gemv_f32(const float* W, const float* x, float* y, int64_t m, int64_t n, int64_t k, int64_t ld,
                   int pre, const float* pre_w, float eps, const float* bias, const float* resid, int nthreads) {
  float* xp = pre_f32(x, m, k, pre, pre_w, eps);
  if (pre != PRE_NONE && xp == NULL) return 1;
  const float* xs = xp ? xp : x;
  int64_t blocks = n / R;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    for (int64_t m0 = 0; m0 < m; m0 += MX) {
      const float* xa = xs + m0 * k;
      float* ya = y + m0 * n;
      const float* ra = resid ? resid + m0 * n : NULL;
      switch (m - m0 < MX ? (int)(m - m0) : MX) {
        case 1: block_f32(W, xa, ya, bias, ra, b * R, n, k, ld, 1); break;
        case 2: block_f32(W, xa, ya, bias, ra, b * R, n, k, ld, 2); break;
        default: block_f32(W, xa, ya, bias, ra, b * R, n, k, ld, 3); break;
      }
    }
  }
  for (int64_t o = blocks * R; o < n; o++) /* the last n % R rows */
    for (int64_t a = 0; a < m; a++) {
      float s = 0.f;
      for (int64_t j = 0; j < k; j++) s += W[o * ld + j] * xs[a * k + j];
      if (bias) s += bias[o];
      if (resid) s = resid[a * n + o] + s;
      y[a * n + o] = s;
    }
  free(xp);
  return 0;
}

/* ---------------------------------------------------------------------------------------------- bf16 */
#if defined(__AVX512BF16__)
INLINE float bf(uint16_t v) {
  uint32_t b = (uint32_t)v << 16;
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}

INLINE uint16_t to_bf(float f) { /* round to nearest even, as torch; a NaN stays a NaN */
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static uint16_t* pre_bf16(const uint16_t* x, int64_t m, int64_t k, int pre, const uint16_t* pre_w, float eps) {
  if (pre == PRE_NONE) return NULL;
  uint16_t* out = (uint16_t*)malloc((size_t)(m * k) * sizeof(uint16_t));
  if (out == NULL) return NULL;
  for (int64_t a = 0; a < m; a++) {
    if (pre == PRE_RMSNORM) {
      const uint16_t* xr = x + a * k;
      float ss = 0.f;
      for (int64_t j = 0; j < k; j++) ss += bf(xr[j]) * bf(xr[j]);
      float s = 1.f / sqrtf(ss / (float)k + eps);
      for (int64_t j = 0; j < k; j++) out[a * k + j] = to_bf(bf(xr[j]) * s * bf(pre_w[j]));
    } else {
      const uint16_t* g = x + a * 2 * k;
      float* t = (float*)malloc((size_t)(2 * k) * sizeof(float));
      if (t == NULL) {
        free(out);
        return NULL;
      }
      for (int64_t j = 0; j < k; j++) t[k + j] = bf(g[j]);
      silu_row(t + k, t, k);
      for (int64_t j = 0; j < k; j++) out[a * k + j] = to_bf(bf(to_bf(t[j])) * bf(g[k + j]));
      free(t);
    }
  }
  return out;
}

INLINE void block_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, const uint16_t* bias,
                       const uint16_t* resid, int64_t o, int64_t n, int64_t k, int64_t ld, const int XS) {
  __m512 acc[MX][R];
  int64_t k32 = k - k % 32;
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) acc[a][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k32; i += 32) {
    __m512bh xv[MX];
    for (int a = 0; a < XS; a++) xv[a] = (__m512bh)_mm512_loadu_si512(x + a * k + i);
    for (int r = 0; r < R; r++) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(W + (o + r) * ld + i);
      for (int a = 0; a < XS; a++) acc[a][r] = _mm512_dpbf16_ps(acc[a][r], wv, xv[a]);
    }
  }
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) {
      float s = _mm512_reduce_add_ps(acc[a][r]);
      for (int64_t j = k32; j < k; j++) s += bf(W[(o + r) * ld + j]) * bf(x[a * k + j]);
      if (bias) s += bf(bias[o + r]);
      uint16_t v = to_bf(s);
      if (resid) v = to_bf(bf(resid[a * n + o + r]) + bf(v));
      y[a * n + o + r] = v;
    }
}

int slime_gemv_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t ld,
                    int pre, const uint16_t* pre_w, float eps, const uint16_t* bias, const uint16_t* resid,
                    int nthreads) {
  uint16_t* xp = pre_bf16(x, m, k, pre, pre_w, eps);
  if (pre != PRE_NONE && xp == NULL) return 1;
  const uint16_t* xs = xp ? xp : x;
  int64_t blocks = n / R;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    for (int64_t m0 = 0; m0 < m; m0 += MX) {
      const uint16_t* xa = xs + m0 * k;
      uint16_t* ya = y + m0 * n;
      const uint16_t* ra = resid ? resid + m0 * n : NULL;
      switch (m - m0 < MX ? (int)(m - m0) : MX) {
        case 1: block_bf16(W, xa, ya, bias, ra, b * R, n, k, ld, 1); break;
        case 2: block_bf16(W, xa, ya, bias, ra, b * R, n, k, ld, 2); break;
        default: block_bf16(W, xa, ya, bias, ra, b * R, n, k, ld, 3); break;
      }
    }
  }
  for (int64_t o = blocks * R; o < n; o++)
    for (int64_t a = 0; a < m; a++) {
      float s = 0.f;
      for (int64_t j = 0; j < k; j++) s += bf(W[o * ld + j]) * bf(xs[a * k + j]);
      if (bias) s += bf(bias[o]);
      uint16_t v = to_bf(s);
      if (resid) v = to_bf(bf(resid[a * n + o]) + bf(v));
      y[a * n + o] = v;
    }
  free(xp);
  return 0;
}
#endif
#endif
