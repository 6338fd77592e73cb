/* The decode step's matmuls: y[m, n] = epilogue(sum_k pre(x)[m, k] * W[n, k]) for a few rows m.

   Why: at decode a matmul reads each weight once for a handful of rows of x, so its speed is the speed
   at which the weights stream in; torch's fp32 kernels stream them slower than this loop (tools/bench_decode.py
   measures the engine end to end). The small ops around a matmul cost more than their arithmetic in torch (a
   call each, a bf16 conversion each), so the ones a Llama layer puts there are folded in:
     pre  0: x as given; 1: RMSNorm of x with weight pre_w and eps; 2: silu(gate) * up, x being [m, 2k]
          (gate | up, the fused gate/up matmul's output);
     epilogue: + bias (when given), then + resid (when given; [m, n], the residual stream).
   Rounding as the engine's torch ops round (lean_forward.py): fp32 throughout in fp32; in bf16 each op's
   result rounded to bf16 (nearest even) as torch rounds it: F.rms_norm's x * rsqrt(mean(x^2) + eps) * w in
   fp32, rounded once; silu(gate) rounded, times up, rounded; the matmul with its bias rounded once, its
   products (exact in fp32) accumulated in fp32; the residual sum rounded.

   One source for every CPU: the arithmetic is written with GCC/Clang vector extensions, whose width the
   compiler's target picks (64 bytes with AVX-512, 32 with AVX/AVX2, 16 with NEON or SSE2), so `cc -O3
   -march=native` gives each host its widest registers and its FMA. Only bf16 on AVX512-BF16 has a path of its
   own (vdpbf16ps: two products per lane per instruction); elsewhere bf16 weights are widened to fp32 as they
   load, which reads half of fp32's bytes. slime_gemv_target() names what a build was compiled for.

   Layout: W row-major with row stride ld (elements; rows may be views into a fused tensor), x, resid and
   y contiguous. Each thread takes a contiguous share of W's rows, R rows at a time, one from each of R runs
   (thread_rows), and every block of R rows is multiplied by all m rows of x (MX at a time) while it is in L1,
   so W is read from memory once whatever m is. R * MX accumulators + MX vectors of x + one of W fit the target's vector registers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VB 64
#define R 8  /* 8 * 3 accumulators + 3 x + 1 W of 32 zmm registers (MX 4 spills: 24 -> 22.5 ms a SmolLM2 step) */
#define MX 3
#define TARGET "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VB 32
#define R 4  /* 4 * 2 accumulators + 2 x + 1 W + the tail's temporaries of 16 ymm registers */
#define MX 2
#define TARGET "avx2"
#elif defined(__AVX__)
#define VB 32
#define R 4
#define MX 2
#define TARGET "avx"
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define VB 16
#define R 8  /* 32 q registers, as AVX-512's 32 */
#define MX 3
#define TARGET "neon"
#else
#define VB 16
#define R 4
#define MX 2
#define TARGET "generic"
#endif
#define VL (VB / 4) /* floats per vector */

typedef float vf __attribute__((vector_size(VB)));
typedef int32_t vi __attribute__((vector_size(VB)));
typedef uint32_t vu __attribute__((vector_size(VB)));

#define INLINE static inline __attribute__((always_inline))
#define PRE_NONE 0
#define PRE_RMSNORM 1
#define PRE_SILU_MUL 2

const char* slime_gemv_target(void) {
#if defined(__AVX512BF16__)
  return TARGET "+bf16";
#else
  return TARGET;
#endif
}

INLINE vf splat(float v) { return (vf){0} + v; }
INLINE vf loadf(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
INLINE void storef(float* p, vf v) { memcpy(p, &v, sizeof v); }
/* The sum of v's lanes, halving the vector until 4 lanes are left (a lane-by-lane loop is VL dependent scalar
   adds, as C's order asks, and a block finishes R * MX of them: a third of a 576-wide block's time). */
typedef float f4 __attribute__((vector_size(16)));
typedef float f8 __attribute__((vector_size(32)));
typedef float f16 __attribute__((vector_size(64)));
INLINE float fold4(f4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }
INLINE f4 fold8(f8 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7); }
INLINE f8 fold16(f16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
INLINE float hsum(vf v) {
#if VL == 16
  return fold4(fold8(fold16(v)));
#elif VL == 8
  return fold4(fold8(v));
#else
  return fold4(v);
#endif
}
INLINE vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

INLINE float silu(float g) { return g / (1.f + expf(-g)); }

/* exp of a vector (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial, scaled by 2^n in
   two halves so that 2^-149 and 2^128 stay representable; within 2 ulp of expf over the clamped range): libm's
   expf is scalar, and silu over a 1536-wide MLP row took 11 us a row with it. */
INLINE vf vexp(vf x) {
  x = vselect(x < -103.f, splat(-103.f), x);
  x = vselect(x > 88.7f, splat(88.7f), x);
  vf t = x * 1.44269504088896341f;
  vf n = (t + 12582912.f) - 12582912.f; /* round to nearest (1.5 * 2^23: no fast-math, so not folded away) */
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * (r * r) + (r + 1.f);
  vi e = __builtin_convertvector(n, vi);
  vi e1 = e >> 1;
  vf s1 = (vf)((e1 + 127) << 23), s2 = (vf)((e - e1 + 127) << 23);
  return y * s1 * s2;
}

/* out[j] = silu(g[j]) for j < k */
static void silu_row(const float* g, float* out, int64_t k) {
  int64_t j = 0;
  for (; j + VL <= k; j += VL) {
    vf v = loadf(g + j);
    storef(out + j, v / (1.f + vexp(-v)));
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
INLINE void block_f32(const float* W, const float* x, float* y, const float* bias, const float* resid, const int64_t* rows,
                      const int64_t* next, int64_t n, int64_t k, int64_t ld, const int XS) {
  vf acc[MX][R];
  int64_t kv = k - k % VL;
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) acc[a][r] = splat(0.f);
  for (int64_t i = 0; i < kv; i += VL) {
    vf xv[MX];
    for (int a = 0; a < XS; a++) xv[a] = loadf(x + a * k + i);
    for (int r = 0; r < R; r++) {
      vf wv = loadf(W + rows[r] * ld + i);
      if (next) __builtin_prefetch(W + next[r] * ld + i);
      for (int a = 0; a < XS; a++) acc[a][r] += wv * xv[a];
    }
  }
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) {
      float s = hsum(acc[a][r]);
      for (int64_t j = kv; j < k; j++) s += W[rows[r] * ld + j] * x[a * k + j];
      if (bias) s += bias[rows[r]];
      if (resid) s = resid[a * n + rows[r]] + s;
      y[a * n + rows[r]] = s;
    }
}

/* This thread's rows: a contiguous share of the first blocks * R rows, from lo, cut into R runs of chunk rows;
   block b takes row b of each run (lo + b + r * chunk). The R rows a block reads at once are then R long
   sequential streams through memory, where R adjacent rows are R short ones that all end every R rows: the
   prefetchers keep up with the long ones (3072x576 fp32 out of cache on the 2-core AMD EPYC: two threads 24-25
   GB/s with adjacent rows, 30-36 with runs; one thread 13-15 -> 23-25). */
INLINE void thread_rows(int64_t blocks, int64_t* lo, int64_t* chunk) {
#ifdef _OPENMP
  int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
  int64_t t = 0, nt = 1;
#endif
  int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
  *lo = b0 * R;
  *chunk = b1 - b0;
}

/* Block b's rows: row b of each run, run r starting SKEW * r rows further in (wrapping round), so that the R
   rows are not all a multiple of 4 KiB apart, which would put them in the same L1 sets */
#define SKEW 1
INLINE void block_rows(int64_t lo, int64_t chunk, int64_t b, int64_t* rows) {
  for (int r = 0; r < R; r++) rows[r] = lo + r * chunk + (b + SKEW * r) % chunk;
}

/* Each XS from 1 to MX as a constant, so block() unrolls for it. */
#define DISPATCH(block, XS_LEFT, ...)            \
  switch ((XS_LEFT) < MX ? (int)(XS_LEFT) : MX) { \
    case 1: block(__VA_ARGS__, 1); break;         \
    case 2: block(__VA_ARGS__, 2); break;         \
    default: block(__VA_ARGS__, MX); break;       \
  }

int slime_gemv_f32(const float* W, const float* x, float* y, int64_t m, int64_t n, int64_t k, int64_t ld,
                   int pre, const float* pre_w, float eps, const float* bias, const float* resid, int nthreads) {
  float* xp = pre_f32(x, m, k, pre, pre_w, eps);
  if (pre != PRE_NONE && xp == NULL) return 1;
  const float* xs = xp ? xp : x;
  int64_t blocks = n / R;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t lo, chunk, rows[R], next[R];
    thread_rows(blocks, &lo, &chunk);
    for (int64_t b = 0; b < chunk; b++) {
      block_rows(lo, chunk, b, rows);
      if (b + 1 < chunk) block_rows(lo, chunk, b + 1, next);
      for (int64_t m0 = 0; m0 < m; m0 += MX) {
        const float* ra = resid ? resid + m0 * n : NULL;
        const int64_t* pf = (m0 == 0 && b + 1 < chunk && m > MX) ? next : NULL;
        DISPATCH(block_f32, m - m0, W, xs + m0 * k, y + m0 * n, bias, ra, rows, pf, n, k, ld)
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
INLINE float bf(uint16_t v) {
  uint32_t b = (uint32_t)v << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

INLINE uint16_t to_bf(float f) { /* round to nearest even, as torch; a NaN stays a NaN */
  uint32_t b;
  memcpy(&b, &f, 4);
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

/* the block's fp32 sums, rounded as torch rounds a bf16 matmul (+ bias) and the residual add after it */
INLINE void finish_bf16(float s, const uint16_t* W, const uint16_t* x, uint16_t* y, const uint16_t* bias,
                        const uint16_t* resid, int64_t row, int64_t a, int64_t n, int64_t k, int64_t ld,
                        int64_t kv) {
  for (int64_t j = kv; j < k; j++) s += bf(W[row * ld + j]) * bf(x[a * k + j]);
  if (bias) s += bf(bias[row]);
  uint16_t v = to_bf(s);
  if (resid) v = to_bf(bf(resid[a * n + row]) + bf(v));
  y[a * n + row] = v;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* vdpbf16ps: 32 bf16 products a step, summed in pairs into 16 fp32 lanes */
INLINE void block_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, const uint16_t* bias,
                       const uint16_t* resid, const int64_t* rows, const int64_t* next, int64_t n, int64_t k, int64_t ld, const int XS) {
  __m512 acc[MX][R];
  int64_t k32 = k - k % 32;
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) acc[a][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k32; i += 32) {
    __m512bh xv[MX];
    for (int a = 0; a < XS; a++) xv[a] = (__m512bh)_mm512_loadu_si512(x + a * k + i);
    for (int r = 0; r < R; r++) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(W + rows[r] * ld + i);
      if (next) __builtin_prefetch(W + next[r] * ld + i);
      for (int a = 0; a < XS; a++) acc[a][r] = _mm512_dpbf16_ps(acc[a][r], wv, xv[a]);
    }
  }
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++)
      finish_bf16(_mm512_reduce_add_ps(acc[a][r]), W, x, y, bias, resid, rows[r], a, n, k, ld, k32);
}
#else
/* bf16 widened to fp32 as it loads (exact), multiplied and summed in fp32. A vector of 2 * VL bf16 read as VL
   32-bit lanes holds an even element in each lane's low half and an odd one in its high half: shifting left by
   16 and masking the low half off give both as floats with no shuffle, and a dot product needs no order. */
INLINE void block_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, const uint16_t* bias,
                       const uint16_t* resid, const int64_t* rows, const int64_t* next, int64_t n, int64_t k, int64_t ld, const int XS) {
  vf acc[MX][R];
  const int64_t step = 2 * VL;
  int64_t kv = k - k % step;
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) acc[a][r] = splat(0.f);
  for (int64_t i = 0; i < kv; i += step) {
    vf xe[MX], xo[MX];
    for (int a = 0; a < XS; a++) {
      vu v;
      memcpy(&v, x + a * k + i, sizeof v);
      xe[a] = (vf)(v << 16);
      xo[a] = (vf)(v & 0xffff0000u);
    }
    for (int r = 0; r < R; r++) {
      vu v;
      memcpy(&v, W + rows[r] * ld + i, sizeof v);
      if (next) __builtin_prefetch(W + next[r] * ld + i);
      vf we = (vf)(v << 16), wo = (vf)(v & 0xffff0000u);
      for (int a = 0; a < XS; a++) acc[a][r] += we * xe[a] + wo * xo[a];
    }
  }
  for (int a = 0; a < XS; a++)
    for (int r = 0; r < R; r++) finish_bf16(hsum(acc[a][r]), W, x, y, bias, resid, rows[r], a, n, k, ld, kv);
}
#endif

int slime_gemv_bf16(const uint16_t* W, const uint16_t* x, uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t ld,
                    int pre, const uint16_t* pre_w, float eps, const uint16_t* bias, const uint16_t* resid,
                    int nthreads) {
  uint16_t* xp = pre_bf16(x, m, k, pre, pre_w, eps);
  if (pre != PRE_NONE && xp == NULL) return 1;
  const uint16_t* xs = xp ? xp : x;
  int64_t blocks = n / R;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t lo, chunk, rows[R], next[R];
    thread_rows(blocks, &lo, &chunk);
    for (int64_t b = 0; b < chunk; b++) {
      block_rows(lo, chunk, b, rows);
      if (b + 1 < chunk) block_rows(lo, chunk, b + 1, next);
      for (int64_t m0 = 0; m0 < m; m0 += MX) {
        const uint16_t* ra = resid ? resid + m0 * n : NULL;
        const int64_t* pf = (m0 == 0 && b + 1 < chunk && m > MX) ? next : NULL;
        DISPATCH(block_bf16, m - m0, W, xs + m0 * k, y + m0 * n, bias, ra, rows, pf, n, k, ld)
      }
    }
  }
  for (int64_t o = blocks * R; o < n; o++)
    for (int64_t a = 0; a < m; a++) finish_bf16(0.f, W, xs, y, bias, resid, o, a, n, k, ld, 0);
  free(xp);
  return 0;
}

/* ---------------------------------------------------------------------------------------------- LoRA */
/* A decode batch's LoRA deltas, every row through its own adapter: y[i] += Bt[s_i]ᵀ (A[s_i] x[i]) for each row i
   whose slot s_i > 0 (0: the base, left alone). A is [slots, rp, k] (rp = nparts * r rank rows: q's, k's, v's for
   a fused qkv); Bt[p] is part p's [slots, r, outs[p]] (B transposed, scaling folded in), its outputs laid one after
   another in y's row (stride ldy). Rows run in parallel; each reads its adapter's A and B once, B as r axpys. */
int slime_lora_f32(const float* x, int64_t m, int64_t k, const int64_t* slots, const float* A, int64_t rp,
                   int64_t nparts, const int64_t* bt, const int64_t* outs, int64_t r, float* y, int64_t ldy,
                   int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t i = 0; i < m; i++) {
    const int64_t s = slots[i];
    if (s <= 0) continue;
    const float* a = A + s * rp * k;
    const float* xi = x + i * k;
    float h[rp];
    for (int64_t j = 0; j < rp; j++) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t t = 0; t < k; t++) acc += a[j * k + t] * xi[t];
      h[j] = acc;
    }
    float* yi = y + i * ldy;
    for (int64_t p = 0; p < nparts; p++) {
      const int64_t n = outs[p];
      const float* b = (const float*)(intptr_t)bt[p] + s * r * n;
      for (int64_t j = 0; j < r; j++) {
        const float hj = h[p * r + j];
        const float* bj = b + j * n;
#pragma omp simd
        for (int64_t o = 0; o < n; o++) yi[o] += hj * bj[o];
      }
      yi += n;
    }
  }
  return 0;
}
