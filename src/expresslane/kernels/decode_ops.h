// The decode step's small operations as plain loops over float32 rows (AVX2 + FMA).
//
// At decode batch sizes each of these touches a few KB; issued as ATen ops they cost 5-15 us
// apiece in dispatch and allocation, more than the arithmetic. Lengths must be multiples of 8.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "common.h"

namespace expresslane::ops {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum(_mm256_add_ps(s0, s1));
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

// y = x * w / sqrt(mean(x^2) + eps); y may be x
inline void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}

// Rotate-half RoPE in place: t = t * cos + roll(t, D/2) * sin, where `sin` already carries the
// sign of the rotation (negative first half), as in models/layers.py.
inline void rope(float* t, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = t[i], b = t[i + half];
    t[i] = a * cos[i] + b * sin[i];
    t[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// e^x: x = n ln2 + r with |r| <= ln2 / 2; e^r by the minimax polynomial of Cephes' expf, 2^n
// put into the exponent bits; x clamped to [-87, 88] first (so e^-inf is ~1e-38, not 0).
// Within 1.2e-7 relative of exp (float64). exp8 here, exp16 (prompt_tiles.h) take these.
namespace exp_poly {
constexpr float kMin = -87.0f, kMax = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln2 in two, so n * hi is exact
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

// e^x for eight floats (exp_poly). A scalar std::exp costs ~15 ns: at ~3,000 per layer (SiLU,
// softmax) that was ~1 ms of a decode step.
inline __m256 exp8(__m256 x) {
  using namespace exp_poly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kMin)), _mm256_set1_ps(kMax));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// y = silu(g) * u
inline void silu_mul(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
}

// gpt-oss's expert activation (models/gpt_oss.py) over gate_up's interleaved outputs
// gu = [g0, u0, g1, u1, ...] (2n floats): y = (clamp(u, ±limit) + 1) * g * sigmoid(alpha g),
// g clamped above at limit, in the reference's order of operations.
inline void clamped_swiglu(const float* gu, float* y, int64_t n, float alpha, float limit) {
  const __m256 one = _mm256_set1_ps(1.0f), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
  const __m256 a = _mm256_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 p = _mm256_loadu_ps(gu + 2 * i), q = _mm256_loadu_ps(gu + 2 * i + 8);
    // even and odd floats of p and q, back in order across the 128-bit halves
    const __m256 g = _mm256_min_ps(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(p, q, 0x88)), 0xD8)), hi);
    const __m256 u = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(p, q, 0xDD)), 0xD8));
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, a)))));
    const __m256 up = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(u, lo), hi), one);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(up, _mm256_mul_ps(g, sig)));
  }
}

// s[0..n) = exp(s[0..n) - max), any n >= 1; returns their sum, the max in *max.
inline float exp_shifted(float* s, int64_t n, float* max) {
  // the max in 8 lanes (exact in any order; one scalar chain ran ~3 cycles per score)
  __m256 mx = _mm256_set1_ps(s[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = lanes[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; i < n; ++i) total += (s[i] = std::exp(s[i] - m));
  *max = m;
  return total;
}

// s[0..n) = softmax(s[0..n)), any n >= 1
inline void softmax(float* s, int64_t n) {
  float m;
  const float total = exp_shifted(s, n, &m);
  int64_t i = 0;
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  for (; i < n; ++i) s[i] *= 1.0f / total;
}

// The index of the first maximum of x[0..n), n >= 1, as torch.argmax (which counts a NaN as
// the maximum: the first NaN's index). Two passes: the maximum, in four independent chains,
// then the first element equal to it. ATen's argmax took 6 us for one row of 8,192 logits.
inline int64_t argmax(const float* x, int64_t n) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
  if (n >= 32) {
    __m256 m[4], unordered = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) m[j] = _mm256_loadu_ps(x + 8 * j);
    for (int j = 0; j < 4; ++j) unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(m[j], m[j], _CMP_UNORD_Q));
    for (i = 32; i + 32 <= n; i += 32)
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m[j] = _mm256_max_ps(m[j], v);
      }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    for (float v : lanes) top = std::max(top, v);
    nan = _mm256_movemask_ps(unordered) != 0;
  }
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  int64_t p = 0;
  if (nan) {
    while (!std::isnan(x[p])) ++p;
    return p;
  }
  const __m256 t = _mm256_set1_ps(top);
  for (; p + 8 <= n; p += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + p), t, _CMP_EQ_OQ));
    if (hits) return p + __builtin_ctz(hits);
  }
  while (x[p] != top) ++p;
  return p;
}

inline void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
}

}  // namespace expresslane::ops
