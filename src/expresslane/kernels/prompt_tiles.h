// The tiled prompt attention's micro-kernels (prompt_attention.h), AVX-512: scores of a
// tile's query rows (in vector lanes) against a block of keys, each key value broadcast, and
// probabilities times values into the tile's accumulator; with float32 products, and with
// AVX-512 BF16 dot products on pairs (two dimensions of q.k, two keys of p.v) where built.
// Every output lane is one row's own chain of operations, whatever the rows beside it.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace expresslane {

#ifdef __AVX512F__
// e^x for 16 floats: decode_ops.h exp8's polynomial and clamp, 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// st[c][rows] = sum over d in order of qt[d][rows] * keys[c][d], for KC keys and R vectors of
// 16 rows; qt and st rows `stride` floats apart.
template <int R, int KC>
inline void score_keys(const float* qt, int64_t stride, int64_t D, const float* const* keys, float* st) {
  __m512 acc[KC][R];
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[R];
    for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_ps(qt + d * stride + 16 * r);
    for (int c = 0; c < KC; ++c) {
      const __m512 kv = _mm512_set1_ps(keys[c][d]);
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_fmadd_ps(qv[r], kv, acc[c][r]);
    }
  }
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(st + c * stride + 16 * r, acc[c][r]);
}

template <int R>
inline void score_block(const float* qt, int64_t stride, int64_t D, const float* const* keys, int64_t nk, float* st) {
  constexpr int KC = 6;
  int64_t c = 0;
  for (; c + KC <= nk; c += KC) score_keys<R, KC>(qt, stride, D, keys + c, st + c * stride);
  switch (nk - c) {
    case 5: return score_keys<R, 5>(qt, stride, D, keys + c, st + c * stride);
    case 4: return score_keys<R, 4>(qt, stride, D, keys + c, st + c * stride);
    case 3: return score_keys<R, 3>(qt, stride, D, keys + c, st + c * stride);
    case 2: return score_keys<R, 2>(qt, stride, D, keys + c, st + c * stride);
    case 1: return score_keys<R, 1>(qt, stride, D, keys + c, st + c * stride);
    default: return;
  }
}

// ot[d0..d0+4)[rows] = ot * alpha + sum over j in order of p[j][rows] * values[j][d], for R
// vectors of 16 rows.
template <int R>
inline void weigh_block(const float* p, int64_t stride, const float* const* values, int64_t nk, int64_t d0,
                        const float* alpha, float* ot) {
  constexpr int DC = 4;
  __m512 acc[DC][R];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_loadu_ps(alpha + 16 * r);
    for (int i = 0; i < DC; ++i) acc[i][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * stride + 16 * r), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 pv[R];
    for (int r = 0; r < R; ++r) pv[r] = _mm512_loadu_ps(p + j * stride + 16 * r);
    for (int i = 0; i < DC; ++i) {
      const __m512 v = _mm512_set1_ps(values[j][d0 + i]);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(pv[r], v, acc[i][r]);
    }
  }
  for (int i = 0; i < DC; ++i)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(ot + (d0 + i) * stride + 16 * r, acc[i][r]);
}

#ifdef __AVX512BF16__
// st[c][rows] = sum over d pairs in order of the bf16 dot products of qt[i][rows] (a row's q
// values 2i and 2i+1 in one lane) and keys[c]'s pair i, for KC keys and R vectors of 16 rows.
template <int R, int KC>
inline void score_keys_bf16(const uint32_t* qt, int64_t stride, int64_t D, const uint32_t* const* keys, float* st) {
  __m512 acc[KC][R];
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512bh qv[R];
    for (int r = 0; r < R; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qt + i * stride + 16 * r);
    for (int c = 0; c < KC; ++c) {
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(keys[c][i]));
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], qv[r], kv);
    }
  }
  for (int c = 0; c < KC; ++c)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(st + c * stride + 16 * r, acc[c][r]);
}

template <int R>
inline void score_block_bf16(const uint32_t* qt, int64_t stride, int64_t D, const uint32_t* const* keys, int64_t nk,
                             float* st) {
  constexpr int KC = 6;
  int64_t c = 0;
  for (; c + KC <= nk; c += KC) score_keys_bf16<R, KC>(qt, stride, D, keys + c, st + c * stride);
  switch (nk - c) {
    case 5: return score_keys_bf16<R, 5>(qt, stride, D, keys + c, st + c * stride);
    case 4: return score_keys_bf16<R, 4>(qt, stride, D, keys + c, st + c * stride);
    case 3: return score_keys_bf16<R, 3>(qt, stride, D, keys + c, st + c * stride);
    case 2: return score_keys_bf16<R, 2>(qt, stride, D, keys + c, st + c * stride);
    case 1: return score_keys_bf16<R, 1>(qt, stride, D, keys + c, st + c * stride);
    default: return;
  }
}

// weigh_block with bf16 products: p holds a row's probabilities of keys 2m and 2m+1 in one
// lane, values[m][d] the two keys' value d.
template <int R>
inline void weigh_block_bf16(const uint32_t* p, int64_t stride, const uint32_t* values, int64_t pairs, int64_t D,
                             int64_t d0, const float* alpha, float* ot) {
  constexpr int DC = 4;
  __m512 acc[DC][R];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_loadu_ps(alpha + 16 * r);
    for (int i = 0; i < DC; ++i) acc[i][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * stride + 16 * r), a);
  }
  for (int64_t m = 0; m < pairs; ++m) {
    __m512bh pv[R];
    for (int r = 0; r < R; ++r) pv[r] = (__m512bh)_mm512_loadu_si512(p + m * stride + 16 * r);
    for (int i = 0; i < DC; ++i) {
      const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(values[m * D + d0 + i]));
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], pv[r], v);
    }
  }
  for (int i = 0; i < DC; ++i)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(ot + (d0 + i) * stride + 16 * r, acc[i][r]);
}

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
