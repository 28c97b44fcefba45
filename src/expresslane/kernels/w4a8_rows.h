// The integer passes of the 4-bit kernels (fp4_cpu.cpp: E2M1 codes; int4_cpu.cpp: integer
// codes of GGUF blocks), as llama.cpp does for Q4_0 x Q8_0: activations quantized to int8 per
// 32 values once per call (w4a8_activations.h), and weights meet them in unsigned x signed
// byte dot products (vpdpbusd, or vpmaddubsw + vpmaddwd). Its error against float activations
// is their rounding, about 0.2% of a dot product.
// Layout choices keep a pair of 32-weight groups at ~15 instructions:
// - two groups (32 code bytes) are expanded per 256-bit load: the low nibbles give the even
//   elements of both groups, the high nibbles the odd ones; nibbles are never re-interleaved,
//   the activations are stored in that order instead ([even j | even j+1 | odd j | odd j+1]
//   per pair; a last unpaired group [even | odd]);
// - a kernel's `Codes` say how a nibble becomes the unsigned byte the dot product wants: a
//   byte shuffle through a table (FP4: the doubled E2M1 values + 12, the + 12 coming back out
//   as 12 x the activations' sums per int32 lane, precomputed per call), or as it is (integer
//   codes 0..15);
// - the block scales of a run of whole rows are decoded before their groups are visited (by
//   the kernel: `dec`, floats [R, K/BS]); a pair then multiplies its 4 (BS 16) or 2 weight
//   scales by the activations'.
// Each (weight row, activation row) ends as 8 float lanes handed to the kernel's `finish`.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "w4a8_activations.h"

namespace expresslane::w4a8 {

constexpr int64_t kAhead = 4;  // software prefetch distance, in passes of R weight rows

// Codes that are their own unsigned value (no shuffle, no sums to take back out).
struct PlainCodes {
  static constexpr bool kShuffle = false;
  static __m128i table() { return _mm_setzero_si128(); }
};

template <typename Codes>
inline __m256i expand(__m256i nibbles, __m256i lut) {
  if constexpr (Codes::kShuffle) return _mm256_shuffle_epi8(lut, nibbles);
  return nibbles;
}

// The int32 start of a dot product: minus the offsets' sums where the table adds them.
template <typename Codes>
inline __m256i start(const int32_t* corr) {
  const __m256i zero = _mm256_setzero_si256();
  if constexpr (Codes::kShuffle) return _mm256_sub_epi32(zero, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr)));
  return zero;
}

// Byte dot products, each int32 lane the sum of 4 adjacent unsigned x signed byte products
// (of a and b, plus those of c and d for a pair) added to acc. With AVX-512 VNNI one
// instruction does what vpmaddubsw + vpmaddwd do; the integers are the same (no int16
// saturation is reachable: at most 2 x 24 x 127 per int16 lane, 4 of them summed).
inline __m256i group_dot(__m256i acc, __m256i a, __m256i b, __m256i ones) {
#ifdef __AVX512VNNI__
  (void)ones;
  return _mm256_dpbusd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
#endif
}

inline __m256i pair_dot(__m256i acc, __m256i a, __m256i b, __m256i c, __m256i d, __m256i ones) {
#ifdef __AVX512VNNI__
  (void)ones;
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, a, b), c, d);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a, b), _mm256_maddubs_epi16(c, d));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
#endif
}

// Rows m0.. of a QuantizedX.
struct XRows {
  const int8_t* q;
  const int32_t* corr;
  const float* scale;
  int64_t scale_stride;  // floats per row of `scale`
};

// The parts of `rows_i8`, inlined into it (the same code as one function): passes over the
// groups of a quad, of a pair and the last unpaired group, from group j on.
#define EXPRESSLANE_INLINE inline __attribute__((always_inline))

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <typename Codes, int M, int R, int BS>
EXPRESSLANE_INLINE void quads_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K, int64_t& j,
                                 __m512 (&acc4)[R][M]) {
  const int64_t groups = K / 32, nb = K / BS;
  // Quads: lane l of the 16 int32 lanes covers elements 8 (l % 4) .. + 7 of group j + l / 4
  // (lanes 0-7 the first pair, as in pairs_i8, 8-15 the second), so BS 16 lanes take block
  // scales b0 + l / 2 and BS 32 lanes b0 + l / 4.
  const __m512i lut4 = _mm512_broadcast_i32x4(Codes::table());
  const __m512i low4x = _mm512_set1_epi8(0x0F);
  const __m512i spread4 = BS == 16 ? _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  auto expand4 = [&](__m512i nibbles) {
    if constexpr (Codes::kShuffle) return _mm512_shuffle_epi8(lut4, nibbles);
    return nibbles;
  };
  for (; j + kQuadGroups <= groups; j += kQuadGroups) {
    const int64_t b0 = j * 32 / BS;
    const char* ahead = reinterpret_cast<const char*>(codes) + kAhead * R * (K / 2) + R * 16 * j;
    for (int i = 0; i < R * 64; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_loadu_si512(codes + r * (K / 2) + 16 * j);
      const __m512i even = expand4(_mm512_and_si512(b, low4x));
      const __m512i odd = expand4(_mm512_and_si512(_mm512_srli_epi16(b, 4), low4x));
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xq.q + m * K + 32 * j;
        const float* ws = dec + r * nb + b0;
        const float* xs = xq.scale + m * xq.scale_stride + b0;
        const __m512 scales = BS == 16
            ? _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(ws), _mm256_loadu_ps(xs)))
            : _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(ws), _mm_loadu_ps(xs)));
        const __m512 s = _mm512_permutexvar_ps(spread4, scales);
        __m512i dot = _mm512_setzero_si512();
        if constexpr (Codes::kShuffle) dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(xq.corr + (m * groups + j) * 8));
        dot = _mm512_dpbusd_epi32(dot, even, _mm512_loadu_si512(x));
        dot = _mm512_dpbusd_epi32(dot, odd, _mm512_loadu_si512(x + 64));
        acc4[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc4[r][m]);
      }
    }
  }
}
#endif

template <typename Codes, int M, int R, int BS>
EXPRESSLANE_INLINE void pairs_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K, int64_t& j,
                                 __m256 (&acc)[R][M]) {
  const __m128i lut128 = Codes::table();
  const __m256i lut = _mm256_set_m128i(lut128, lut128);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = K / 32, nb = K / BS;
  // Groups j, j + 1: int32 lane l covers elements 8 (l % 4) .. + 7 of group j + l / 4, so
  // BS 16 lanes take block scales 2j + l / 2, BS 32 lanes j + l / 4.
  const __m256i spread = BS == 16 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  auto pair_scales = [&](const float* w, const float* x) {  // the pair's 4 (BS 16) or 2 block scales
    if (BS == 16) return _mm_mul_ps(_mm_loadu_ps(w), _mm_loadu_ps(x));
    const auto two = [](const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); };
    return _mm_mul_ps(two(w), two(x));
  };
  for (; j + 2 <= groups; j += 2) {
    const int64_t b0 = j * 32 / BS;  // the pair's first block
    // the R rows kAhead passes on, front to back at the pace these are read: one sequential
    // stream far enough ahead to cover DRAM latency (M = 1 from DRAM: 33 against 29 GB/s
    // prefetching the next R rows)
    const char* ahead = reinterpret_cast<const char*>(codes) + kAhead * R * (K / 2) + R * 16 * j;
    for (int i = 0; i < R * 32; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = codes + r * (K / 2) + 16 * j;
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i even = expand<Codes>(_mm256_and_si256(b, low4), lut);
      const __m256i odd = expand<Codes>(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4), lut);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xq.q + m * K + 32 * j;
        const __m256 s = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(pair_scales(dec + r * nb + b0, xq.scale + m * xq.scale_stride + b0)), spread);
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
        const __m256i dot = pair_dot(start<Codes>(xq.corr + (m * groups + j) * 8), even, xe, odd, xo, ones);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][m]);
      }
    }
  }
}

template <typename Codes, int M, int R, int BS>
EXPRESSLANE_INLINE void last_group_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K, int64_t j,
                                      __m256 (&acc)[R][M]) {
  const __m128i lut128 = Codes::table();
  const __m256i lut = _mm256_set_m128i(lut128, lut128);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = K / 32, nb = K / BS;
  if (j < groups) {  // a last unpaired group: [even | odd], int32 lanes of 4 values
    const int64_t b0 = j * 32 / BS;
    // BS 16: lanes 0, 1, 4, 5 hold the first block's elements, lanes 2, 3, 6, 7 the second's
    const __m256i halves = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
    for (int r = 0; r < R; ++r) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * (K / 2) + 16 * j));
      const __m128i lo = _mm_and_si128(b, _mm256_castsi256_si128(low4));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm256_castsi256_si128(low4));
      const __m256i w = expand<Codes>(_mm256_set_m128i(hi, lo), lut);
      for (int m = 0; m < M; ++m) {
        const float* xs = xq.scale + m * xq.scale_stride + b0;
        const float* ws = dec + r * nb + b0;
        const __m256 s = BS == 16 ? _mm256_permutevar8x32_ps(
                                        _mm256_castps128_ps256(_mm_mul_ps(
                                            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ws))),
                                            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xs))))),
                                        halves)
                                  : _mm256_set1_ps(ws[0] * xs[0]);
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q + m * K + 32 * j));
        const __m256i dot = group_dot(start<Codes>(xq.corr + (m * groups + j) * 8), w, xv, ones);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][m]);
      }
    }
  }
}

// R consecutive weight rows (their codes at `codes`, block scales decoded in `dec`) against M
// activation rows: finish(r, m, lanes) takes each pair's 8 float lanes, whose sum is the dot
// product up to the kernel's own scales and terms. A block's weight scale times the
// activations' scale of that block gives the scale of an int32 partial sum. With several
// weight rows per pass the activation loads are shared and the loop and reduction costs are
// paid once per R rows: at K = 576 this was 1.6x faster than a row at a time.
template <typename Codes, int M, int R, int BS, typename Finish>
inline void rows_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K,
                    const Finish& finish) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t j = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc4[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc4[r][m] = _mm512_setzero_ps();
  quads_i8<Codes, M, R, BS>(xq, codes, dec, K, j, acc4);
#endif
  pairs_i8<Codes, M, R, BS>(xq, codes, dec, K, j, acc);
  last_group_i8<Codes, M, R, BS>(xq, codes, dec, K, j, acc);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      // the quads' 16 lanes folded onto the pairs' 8 (fixed order, every M alike)
      const __m512 a4 = acc4[r][m];
      acc[r][m] = _mm256_add_ps(acc[r][m], _mm256_add_ps(_mm512_castps512_ps256(a4), _mm512_extractf32x8_ps(a4, 1)));
#endif
      finish(r, m, acc[r][m]);
    }
}

// The passes over M activation rows (rows m0.. of xq) and the weight rows [n0, n1) split
// across threads: per chunk of up to 64 rows, decode(c0, c1, dec) writes their block scales
// (floats [c1 - c0, K/BS]; from dec + 64 K/BS + 8 on it may keep `extra` floats per row of
// its own), then rows_i8 runs R rows at a time, finish(n, m, lanes, the row's scales) for row n.
template <typename Codes, int M, int BS, typename Decode, typename Finish>
void gemv_i8(const QuantizedX& xq, int64_t m0, const uint8_t* codes, int64_t K, int64_t N, int64_t extra,
             const Decode& decode, const Finish& finish) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;  // weight rows per pass; R * M accumulators
  const int64_t groups = K / 32, nb = K / BS, n8 = (nb + 7) / 8 * 8;
  const XRows x{xq.q.data() + m0 * K, xq.corr.data() + m0 * groups * 8, xq.scale.data() + m0 * n8, n8};
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    std::vector<float> dec(64 * (nb + extra) + 16);
    for (int64_t c0 = n0; c0 < n1; c0 += 64) {
      const int64_t c1 = std::min(n1, c0 + 64);
      decode(c0, c1, dec.data());
      auto rows = [&](auto r_count, int64_t n) {
        constexpr int RC = decltype(r_count)::value;
        const float* d = dec.data() + (n - c0) * nb;
        rows_i8<Codes, M, RC, BS>(x, codes + n * (K / 2), d, K,
                                  [&](int r, int m, __m256 lanes) { finish(n + r, m, lanes, d + r * nb); });
      };
      int64_t n = c0;
      for (; n + R <= c1; n += R) rows(std::integral_constant<int, R>{}, n);
      for (; n < c1; ++n) rows(std::integral_constant<int, 1>{}, n);
    }
  });
}

}  // namespace expresslane::w4a8
