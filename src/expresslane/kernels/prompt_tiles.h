// The tiled prompt attention's micro-kernels (prompt_attention.h), AVX-512: scores of a
// tile's query rows (in vector lanes) against a block of keys, each key value broadcast, and
// probabilities times values into the tile's accumulator; with float32 products, and with
// AVX-512 BF16 dot products on pairs (two dimensions of q.k, two keys of p.v) where built.
// Every output lane is one row's own chain of operations, whatever the rows beside it.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "decode_ops.h"

namespace expresslane {

#ifdef __AVX512F__
// e^x for 16 floats: exp8's polynomial and clamp (decode_ops.h ops::exp_poly), 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  using namespace ops::exp_poly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kMin)), _mm512_set1_ps(kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// The element types the kernels multiply: float32 values, or bf16 pairs in a 32-bit lane (a
// row's two dimensions of q, or two keys' probabilities / values), multiplied by AVX-512 BF16
// dot products. lanes: 16 elements; splat: one element in every lane; madd: acc + a * b.
inline __m512 lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 splat(float x) { return _mm512_set1_ps(x); }
inline __m512 madd(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
#ifdef __AVX512BF16__
inline __m512bh lanes(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh splat(uint32_t x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
inline __m512 madd(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }
#endif

// st[c][rows] = sum over i < n in order of qt[i][rows] * keys[c][i], for KC keys and R vectors
// of 16 rows; qt and st rows `stride` elements apart. n: D float32 elements, or D/2 bf16 pairs.
template <int R, int KC, typename E>
inline void score_keys(const E* qt, int64_t stride, int64_t n, const E* const* keys, float* st) {
  __m512 acc[KC][R];
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    decltype(lanes(qt)) qv[R];
    for (int r = 0; r < R; ++r) qv[r] = lanes(qt + i * stride + 16 * r);
    for (int c = 0; c < KC; ++c) {
      const auto kv = splat(keys[c][i]);
      for (int r = 0; r < R; ++r) acc[c][r] = madd(acc[c][r], qv[r], kv);
    }
  }
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(st + c * stride + 16 * r, acc[c][r]);
}

// score_keys for nk keys, KC = 6 at a time (12 accumulators at R = 2).
template <int R, typename E>
inline void score_block(const E* qt, int64_t stride, int64_t n, const E* const* keys, int64_t nk, float* st) {
  constexpr int KC = 6;
  int64_t c = 0;
  for (; c + KC <= nk; c += KC) score_keys<R, KC>(qt, stride, n, keys + c, st + c * stride);
  switch (nk - c) {
    case 5: return score_keys<R, 5>(qt, stride, n, keys + c, st + c * stride);
    case 4: return score_keys<R, 4>(qt, stride, n, keys + c, st + c * stride);
    case 3: return score_keys<R, 3>(qt, stride, n, keys + c, st + c * stride);
    case 2: return score_keys<R, 2>(qt, stride, n, keys + c, st + c * stride);
    case 1: return score_keys<R, 1>(qt, stride, n, keys + c, st + c * stride);
    default: return;
  }
}

// ot[d0..d0+4)[rows] = ot * alpha + sum over j < n in order of p[j][rows] * values[j][d], for R
// vectors of 16 rows: n keys of float32 probabilities and value rows, or n pairs of keys (a
// row's two probabilities in one lane, values[j][d] the two keys' value d).
template <int R, typename E>
inline void weigh_block(const E* p, int64_t stride, const E* const* values, int64_t n, int64_t d0, const float* alpha,
                        float* ot) {
  constexpr int DC = 4;
  __m512 acc[DC][R];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_loadu_ps(alpha + 16 * r);
    for (int i = 0; i < DC; ++i) acc[i][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * stride + 16 * r), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    decltype(lanes(p)) pv[R];
    for (int r = 0; r < R; ++r) pv[r] = lanes(p + j * stride + 16 * r);
    for (int i = 0; i < DC; ++i) {
      const auto v = splat(values[j][d0 + i]);
      for (int r = 0; r < R; ++r) acc[i][r] = madd(acc[i][r], pv[r], v);
    }
  }
  for (int i = 0; i < DC; ++i)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(ot + (d0 + i) * stride + 16 * r, acc[i][r]);
}

#ifdef __AVX512BF16__
// Lane l of the result: bf16(a[l]) in its lower half, bf16(b[l]) in its upper (to nearest even).
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
constexpr bool kBf16Products = true;
#else
constexpr bool kBf16Products = false;
#endif
#endif

}  // namespace expresslane
