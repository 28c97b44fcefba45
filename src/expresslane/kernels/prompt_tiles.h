// The tiled prompt attention's micro-kernels (prompt_attention.h): scores of a tile's query
// rows (in vector lanes) against a block of keys, each key value broadcast, and probabilities
// times values into the tile's accumulator; with float32 products, and with AVX-512 BF16 dot
// products on pairs (two dimensions of q.k, two keys of p.v) where built. Sixteen rows make
// one vector: an __m512 on AVX-512 builds, two __m256 on AVX2 ones (the same operations lane
// by lane). Every output lane is one row's own chain of operations, whatever the rows beside
// it.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "decode_ops.h"

namespace expresslane {

#ifdef __AVX512F__
using F16 = __m512;
constexpr bool kPairedVectors = true;  // 32 registers: the kernels may take two vectors of rows
inline F16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline F16 vset(float x) { return _mm512_set1_ps(x); }
inline F16 vadd(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 vsub(F16 a, F16 b) { return _mm512_sub_ps(a, b); }
inline F16 vmul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 vmax(F16 a, F16 b) { return _mm512_max_ps(a, b); }
inline F16 vfma(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }

// 16 rows' positions; v in the lanes whose position is >= key (the row sees that key), else
// `hidden`.
using I16 = __m512i;
inline I16 vpositions(const int32_t* p) { return _mm512_loadu_si512(p); }
inline F16 vseen(I16 pos, int32_t key, F16 v, F16 hidden) {
  return _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(_mm512_set1_epi32(key), pos), hidden, v);
}

// e^x for 16 floats: exp8's polynomial and clamp (decode_ops.h ops::exp_poly), 16 lanes at a time.
inline F16 exp16(F16 x) {
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
#else
struct F16 {
  __m256 lo, hi;
};
constexpr bool kPairedVectors = false;  // 16 ymm registers: one vector of rows at a time
inline F16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F16 vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 vadd(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 vsub(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 vmul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 vmax(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 vfma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }

struct I16 {
  __m256i lo, hi;
};
inline I16 vpositions(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline F16 vseen(I16 pos, int32_t key, F16 v, F16 hidden) {
  const __m256i k = _mm256_set1_epi32(key);  // key > pos: not seen
  return {_mm256_blendv_ps(v.lo, hidden.lo, _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, pos.lo))),
          _mm256_blendv_ps(v.hi, hidden.hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, pos.hi)))};
}

inline F16 exp16(F16 x) { return {ops::exp8(x.lo), ops::exp8(x.hi)}; }
#endif

// The element types the kernels multiply: float32 values, or bf16 pairs in a 32-bit lane (a
// row's two dimensions of q, or two keys' probabilities / values), multiplied by AVX-512 BF16
// dot products. lanes: 16 elements; splat: one element in every lane; madd: acc + a * b.
inline F16 lanes(const float* p) { return vload(p); }
inline F16 splat(float x) { return vset(x); }
inline F16 madd(F16 acc, F16 a, F16 b) { return vfma(a, b, acc); }
#ifdef __AVX512BF16__
inline __m512bh lanes(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh splat(uint32_t x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
inline __m512 madd(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }
#endif

// st[c][rows] = sum over i < n in order of qt[i][rows] * keys[c][i], for KC keys and R vectors
// of 16 rows; qt and st rows `stride` elements apart. n: D float32 elements, or D/2 bf16 pairs.
template <int R, int KC, typename E>
inline void score_keys(const E* qt, int64_t stride, int64_t n, const E* const* keys, float* st) {
  F16 acc[KC][R];
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = vset(0.0f);
  for (int64_t i = 0; i < n; ++i) {
    decltype(lanes(qt)) qv[R];
    for (int r = 0; r < R; ++r) qv[r] = lanes(qt + i * stride + 16 * r);
    for (int c = 0; c < KC; ++c) {
      const auto kv = splat(keys[c][i]);
      for (int r = 0; r < R; ++r) acc[c][r] = madd(acc[c][r], qv[r], kv);
    }
  }
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) vstore(st + c * stride + 16 * r, acc[c][r]);
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
  F16 acc[DC][R];
  for (int r = 0; r < R; ++r) {
    const F16 a = vload(alpha + 16 * r);
    for (int i = 0; i < DC; ++i) acc[i][r] = vmul(vload(ot + (d0 + i) * stride + 16 * r), a);
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
    for (int r = 0; r < R; ++r) vstore(ot + (d0 + i) * stride + 16 * r, acc[i][r]);
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

}  // namespace expresslane
