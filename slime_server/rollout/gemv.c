/* Matrix-vector products for the CPU engine's decode step: y[m, n] = sum_k x[m, k] * W[n, k], m small.

   Why: at decode a matmul reads each weight once for a handful of rows of x, so its speed is the speed
   at which the weights stream in. torch's fp32 kernels read them at 17 (MKL) to 31 (oneDNN) GB/s on the
   2-core AMD EPYC the benchmarks ran on; this loop at ~40, its bf16 twin at ~35 (half the bytes).

   Layout: W row-major with row stride ld (elements; rows may be views into a fused tensor), x and y
   contiguous [m, k] and [m, n]. Each thread takes a contiguous share of W's rows, R at a time, and every
   block of R rows is multiplied by all m rows of x (MX at a time) while it is in L1, so W is read from
   memory once whatever m is. fp32: fp32 products and sums. bf16: W and x bf16, products accumulated in
   fp32 (AVX512-BF16 dot products), y rounded to bf16 (nearest even): what torch's bf16 matmul computes, up
   to the order of the sums. gemv.py builds this for the machine it runs on; without AVX-512 (and
   AVX512-BF16 for the bf16 kernel) the symbols are absent and the engine keeps torch's matmuls. */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define R 8  /* rows of W per block: 8 independent FMA chains per row of x; a block (R * k) stays in L1 */
#define MX 3 /* rows of x per pass over a block: R * MX accumulators + MX x vectors + a W vector fit the 32
                registers (MX 4 spills: SmolLM2 at 8 rows 24 ms of matmuls per step, 22.5 with MX 3) */
#define INLINE static inline __attribute__((always_inline))

/* One block of R rows of W times XS rows of x; XS and R are constants at every call, so the accumulators
   live in registers. */
INLINE void block_f32(const float* W, const float* x, float* y, int64_t o, int64_t n, int64_t k, int64_t ld,
                      const int XS) {
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
      y[a * n + o + r] = s;
    }
}

int slime_gemv_f32(const float* W, const float* x, float* y, int64_t m, int64_t n, int64_t k, int64_t ld,
                   int nthreads) {
  int64_t blocks = n / R;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    for (int64_t m0 = 0; m0 < m; m0 += MX) {
      const float* xa = x + m0 * k;
      float* ya = y + m0 * n;
      switch (m - m0 < MX ? (int)(m - m0) : MX) {
        case 1: block_f32(W, xa, ya, b * R, n, k, ld, 1); break;
        case 2: block_f32(W, xa, ya, b * R, n, k, ld, 2); break;
        default: block_f32(W, xa, ya, b * R, n, k, ld, 3); break;
      }
    }
  }
  for (int64_t o = blocks * R; o < n; o++) /* the last n % R rows */
    for (int64_t a = 0; a < m; a++) {
      float s = 0.f;
      for (int64_t j = 0; j < k; j++) s += W[o * ld + j] * x[a * k + j];
      y[a * n + o] = s;
    }
  return 0;
}

#if defined(__AVX512BF16__)
INLINE float bf16_to_f32(uint16_t v) {
  uint32_t b = (uint32_t)v << 16;
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}

INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; a NaN stays a NaN */
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

INLINE void block_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, int64_t o, int64_t n, int64_t k,
                       int64_t ld, const int XS) {
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
      for (int64_t j = k32; j < k; j++) s += bf16_to_f32(W[(o + r) * ld + j]) * bf16_to_f32(x[a * k + j]);
      y[a * n + o + r] = f32_to_bf16(s);
    }
}

int slime_gemv_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t ld,
                    int nthreads) {
  int64_t blocks = n / R;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    for (int64_t m0 = 0; m0 < m; m0 += MX) {
      const uint16_t* xa = x + m0 * k;
      uint16_t* ya = y + m0 * n;
      switch (m - m0 < MX ? (int)(m - m0) : MX) {
        case 1: block_bf16(W, xa, ya, b * R, n, k, ld, 1); break;
        case 2: block_bf16(W, xa, ya, b * R, n, k, ld, 2); break;
        default: block_bf16(W, xa, ya, b * R, n, k, ld, 3); break;
      }
    }
  }
  for (int64_t o = blocks * R; o < n; o++)
    for (int64_t a = 0; a < m; a++) {
      float s = 0.f;
      for (int64_t j = 0; j < k; j++) s += bf16_to_f32(W[o * ld + j]) * bf16_to_f32(x[a * k + j]);
      y[a * n + o] = f32_to_bf16(s);
    }
  return 0;
}
#endif
#endif
