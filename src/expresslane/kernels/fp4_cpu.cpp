// Small-batch linear layers with block-scaled 4-bit weights (MXFP4 / NVFP4) for CPUs with
// AVX2 + FMA: y = x W^T (+ b), x float32 [M, K], W as E2M1 codes two per byte [N, K/2] (low
// nibble first), one scale byte per block [N, K/block] (E8M0 exponent or E4M3 bits) and one
// float32 scale per output row (NVFP4's tensor scale). y float32 [M, N].
//
// Codes are expanded in registers: split into nibbles and looked up with one byte shuffle in a
// table of the E2M1 values doubled to integers (0, 1, 2, 3, 4, 6, 8, 12 and negatives; the
// block scale is halved to match). When K is a multiple of 32 they meet int8-quantized
// activations in a byte dot product (`rows_i8`); otherwise they are widened to float32
// and fed to FMAs (`row_kernel`). Partial sums are scaled once per block. The weight is never
// expanded in memory, so a decode step reads 4.25-4.5 bits per weight instead of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common.h"
#include "constants.h"
#include "fp4_activations.h"
#include "kernels.h"

namespace {

using expresslane::ScaleKind;
using namespace expresslane::fp4;
using expresslane::value;

alignas(16) const int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Scale byte -> float, halved to undo the doubled E2M1 table.
const float* scale_table(ScaleKind kind) {
  static const std::array<std::array<float, 256>, 2> tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int i = 0; i < 256; ++i) {
      t[value(ScaleKind::kE8M0)][i] = i == 255 ? NAN : std::ldexp(0.5f, i - 127);
      t[value(ScaleKind::kE4M3)][i] = 0.5f * expresslane::e4m3_table()[i];
    }
    return t;
  }();
  return tables[value(kind)].data();
}

using expresslane::hsum;

// 16 codes (8 bytes) -> 16 int8 values, element order preserved.
inline __m128i expand16(const uint8_t* p, __m128i lut, __m128i low4) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(b, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
  return _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
}

template <int M>
inline void fma16(__m128i v, const float* x, int64_t K, int64_t k, __m256* blk) {
  const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  for (int m = 0; m < M; ++m) {
    blk[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), blk[m]);
    blk[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), blk[m]);
  }
}

template <int M, int BS>
inline void row_kernel(const float* x, const uint8_t* codes, const uint8_t* scales, const float* table,
                       float row_scale, float* y, int64_t K, int64_t N, int64_t n, const float* bias) {
  const __m128i lut = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Doubled));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t blocks = K / BS;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = codes + b * (BS / 2);
    _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
    __m256 blk[M];
    for (int m = 0; m < M; ++m) blk[m] = _mm256_setzero_ps();
    for (int h = 0; h < BS / 16; ++h) fma16<M>(expand16(p + 8 * h, lut, low4), x, K, b * BS + 16 * h, blk);
    const __m256 s = _mm256_set1_ps(table[scales[b]]);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(blk[m], s, acc[m]);
  }
  for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) * row_scale + (bias ? bias[n] : 0.0f);
}

// The integer path, used when K is a multiple of 32, as llama.cpp does for Q4_0 x Q8_0:
// activations are quantized to int8 per 32 values (scale amax/127, round to nearest) once
// per call, and weights meet them in unsigned x signed byte dot products (vpmaddubsw). Its
// error against the float path is the activation rounding, about 0.2% of a dot product.
// Layout choices keep a pair of 32-weight groups at ~15 instructions:
// - two groups (32 code bytes) are expanded per 256-bit load: the low nibbles give the even
//   elements of both groups, the high nibbles the odd ones, one byte shuffle each; nibbles
//   are never re-interleaved, the activations are stored in that order instead
//   ([even j | even j+1 | odd j | odd j+1] per pair; a last unpaired group [even | odd]);
// - the shuffle table holds the doubled E2M1 values + 12 (0..24, unsigned, as vpmaddubsw
//   wants); the + 12 comes back out as 12 x the activations' sums per int32 lane,
//   precomputed per call;
// - the block scales of a run of whole rows are decoded eight at a time before their groups
//   are visited; a pair then multiplies its 4 (NVFP4) or 2 weight scales by the activations'.
constexpr int64_t kAhead = 4;  // software prefetch distance, in passes of R weight rows
alignas(16) const int8_t kE2M1Offset[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// Eight scale bytes -> eight floats, halved to undo the doubled E2M1 table. Block scales are
// nonnegative. E4M3: normal values by moving the bits into place, subnormals (exponent 0,
// value m / 512) by conversion. E8M0: 2^(e - 128), with e <= 1 (2^-126 and less) read as 0 and
// e = 255 (NaN) as 2^127.
inline __m256 decode_scales8(const uint8_t* p, ScaleKind kind) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (kind == ScaleKind::kE8M0) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_max_epi32(c, _mm256_set1_epi32(1)), _mm256_set1_epi32(1)), 23));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(c, 20), _mm256_set1_epi32(119 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(1.0f / 1024.0f));
  return _mm256_blendv_ps(subnormal, normal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
}

// n consecutive scale bytes (the block scales of several whole rows) -> floats.
void decode_scales(const uint8_t* scales, int64_t n, ScaleKind kind, const float* table, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, decode_scales8(scales + i, kind));
  for (; i < n; ++i) out[i] = table[scales[i]];
}

// Byte dot products, each int32 lane the sum of 4 adjacent unsigned x signed byte products
// (of a and b, plus those of c and d for a pair). With AVX-512 VNNI one instruction does what
// vpmaddubsw + vpmaddwd do; the integers are the same (no int16 saturation is reachable: at
// most 2 x 24 x 127 per int16 lane, 4 of them summed).
inline __m256i group_dot(__m256i a, __m256i b, __m256i ones) {
#ifdef __AVX512VNNI__
  (void)ones;
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones);
#endif
}

inline __m256i pair_dot(__m256i a, __m256i b, __m256i c, __m256i d, __m256i ones) {
#ifdef __AVX512VNNI__
  (void)ones;
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b), c, d);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, b), _mm256_maddubs_epi16(c, d)), ones);
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
template <int M, int R, int BS>
EXPRESSLANE_INLINE void quads_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K, int64_t& j,
                                 __m512 (&acc4)[R][M]) {
  const int64_t groups = K / 32, nb = K / BS;
  // Quads: lane l of the 16 int32 lanes covers elements 8 (l % 4) .. + 7 of group j + l / 4
  // (lanes 0-7 the first pair, as in pairs_i8, 8-15 the second), so NVFP4 lanes take block scales
  // b0 + l / 2 and MXFP4 lanes b0 + l / 4.
  const __m128i lut128 = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset));
  const __m512i lut4 = _mm512_broadcast_i32x4(lut128);
  const __m512i low4x = _mm512_set1_epi8(0x0F);
  const __m512i spread4 = BS == 16 ? _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (; j + kQuadGroups <= groups; j += kQuadGroups) {
    const int64_t b0 = j * 32 / BS;
    const char* ahead = reinterpret_cast<const char*>(codes) + kAhead * R * (K / 2) + R * 16 * j;
    for (int i = 0; i < R * 64; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_loadu_si512(codes + r * (K / 2) + 16 * j);
      const __m512i even = _mm512_shuffle_epi8(lut4, _mm512_and_si512(b, low4x));
      const __m512i odd = _mm512_shuffle_epi8(lut4, _mm512_and_si512(_mm512_srli_epi16(b, 4), low4x));
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xq.q + m * K + 32 * j;
        const float* ws = dec + r * nb + b0;
        const float* xs = xq.scale + m * xq.scale_stride + b0;
        const __m512 scales = BS == 16
            ? _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(ws), _mm256_loadu_ps(xs)))
            : _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(ws), _mm_loadu_ps(xs)));
        const __m512 s = _mm512_permutexvar_ps(spread4, scales);
        const __m512i corr = _mm512_loadu_si512(xq.corr + (m * groups + j) * 8);
        const __m512i dot = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), corr), even, _mm512_loadu_si512(x)), odd,
            _mm512_loadu_si512(x + 64));
        acc4[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc4[r][m]);
      }
    }
  }
}
#endif

template <int M, int R, int BS>
EXPRESSLANE_INLINE void pairs_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K, int64_t& j,
                                 __m256 (&acc)[R][M]) {
  const __m128i lut128 = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset));
  const __m256i lut = _mm256_set_m128i(lut128, lut128);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = K / 32, nb = K / BS;
  // Groups j, j + 1: int32 lane l covers elements 8 (l % 4) .. + 7 of group j + l / 4, so
  // NVFP4 lanes take block scales 2j + l / 2, MXFP4 lanes j + l / 4.
  const __m256i spread = BS == 16 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  auto pair_scales = [&](const float* w, const float* x) {  // the pair's 4 (NVFP4) or 2 block scales
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
      const __m256i even = _mm256_shuffle_epi8(lut, _mm256_and_si256(b, low4));
      const __m256i odd = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xq.q + m * K + 32 * j;
        const __m256 s = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(pair_scales(dec + r * nb + b0, xq.scale + m * xq.scale_stride + b0)), spread);
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
        const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.corr + (m * groups + j) * 8));
        const __m256i dot = _mm256_sub_epi32(pair_dot(even, xe, odd, xo, ones), corr);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][m]);
      }
    }
  }
}

template <int M, int R, int BS>
EXPRESSLANE_INLINE void last_group_i8(const XRows& xq, const uint8_t* codes, const float* dec, int64_t K, int64_t j,
                                      __m256 (&acc)[R][M]) {
  const __m128i lut128 = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset));
  const __m256i lut = _mm256_set_m128i(lut128, lut128);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = K / 32, nb = K / BS;
  if (j < groups) {  // a last unpaired group: [even | odd], int32 lanes of 4 values
    const int64_t b0 = j * 32 / BS;
    // NVFP4: lanes 0, 1, 4, 5 hold the first block's elements, lanes 2, 3, 6, 7 the second's
    const __m256i halves = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
    for (int r = 0; r < R; ++r) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * (K / 2) + 16 * j));
      const __m128i lo = _mm_and_si128(b, _mm256_castsi256_si128(low4));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm256_castsi256_si128(low4));
      const __m256i w = _mm256_shuffle_epi8(lut, _mm256_set_m128i(hi, lo));
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
        const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.corr + (m * groups + j) * 8));
        const __m256i dot = _mm256_sub_epi32(group_dot(w, xv, ones), corr);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][m]);
      }
    }
  }
}

// R consecutive weight rows (n..) against M activation rows. A block's weight scale times the
// activations' scale of that block gives the scale of an int32 partial sum. With several
// weight rows per pass the activation loads are shared and the loop and reduction costs are
// paid once per R rows: at K = 576 this was 1.6x faster than a row at a time.
template <int M, int R, int BS>
inline void rows_i8(const XRows& xq, const uint8_t* codes, const float* dec, float* y, int64_t K, int64_t N,
                    int64_t n, const float* row_scales, const float* bias) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t j = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc4[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc4[r][m] = _mm512_setzero_ps();
  quads_i8<M, R, BS>(xq, codes, dec, K, j, acc4);
#endif
  pairs_i8<M, R, BS>(xq, codes, dec, K, j, acc);
  last_group_i8<M, R, BS>(xq, codes, dec, K, j, acc);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      // the quads' 16 lanes folded onto the pairs' 8 (fixed order, every M alike)
      const __m512 a4 = acc4[r][m];
      acc[r][m] = _mm256_add_ps(acc[r][m], _mm256_add_ps(_mm512_castps512_ps256(a4), _mm512_extractf32x8_ps(a4, 1)));
#endif
      y[m * N + n + r] = hsum(acc[r][m]) * row_scales[n + r] + (bias ? bias[n + r] : 0.0f);
    }
}

template <int M, int BS>
void gemv_i8(const QuantizedX& xq, int64_t row0, const uint8_t* codes, const uint8_t* scales,
             const float* row_scales, ScaleKind kind, const float* table, float* y, int64_t K, int64_t N,
             const float* bias) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;  // weight rows per pass; R * M accumulators
  const int64_t groups = K / 32, nb = K / BS, n8 = (nb + 7) / 8 * 8;
  const XRows x{xq.q.data() + row0 * K, xq.corr.data() + row0 * groups * 8, xq.scale.data() + row0 * n8, n8};
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    // the block scales of up to 64 rows at a time, decoded once
    std::vector<float> dec(64 * nb + 8);
    for (int64_t c0 = n0; c0 < n1; c0 += 64) {
      const int64_t c1 = std::min(n1, c0 + 64);
      decode_scales(scales + c0 * nb, (c1 - c0) * nb, kind, table, dec.data());
      int64_t n = c0;
      for (; n + R <= c1; n += R)
        rows_i8<M, R, BS>(x, codes + n * (K / 2), dec.data() + (n - c0) * nb, y, K, N, n, row_scales, bias);
      for (; n < c1; ++n)
        rows_i8<M, 1, BS>(x, codes + n * (K / 2), dec.data() + (n - c0) * nb, y, K, N, n, row_scales, bias);
    }
  });
}

template <int M, int BS>
void gemv(const float* x, const uint8_t* codes, const uint8_t* scales, const float* row_scales,
          const float* table, float* y, int64_t K, int64_t N, const float* bias) {
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      row_kernel<M, BS>(x, codes + n * (K / 2), scales + n * (K / BS), table, row_scales[n], y, K, N, n, bias);
  });
}

template <int BS>
void run(const float* x, const uint8_t* codes, const uint8_t* scales, const float* row_scales, ScaleKind kind,
         const float* table, float* y, int64_t M, int64_t K, int64_t N, const float* bias) {
  if (K % 32 == 0) {
    const QuantizedX xq = quantize_activations(x, M, K, BS);
    expresslane::for_row_blocks<kI8Rows>(M, [&](int64_t m0, int64_t mb) {
      float* yp = y + m0 * N;
      switch (mb) {
        case 1: gemv_i8<1, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
        case 2: gemv_i8<2, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
        case 3: gemv_i8<3, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        case 4: gemv_i8<4, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
        case 5: gemv_i8<5, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
        case 6: gemv_i8<6, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
        case 7: gemv_i8<7, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
        default: gemv_i8<8, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
#else
        default: gemv_i8<4, BS>(xq, m0, codes, scales, row_scales, kind, table, yp, K, N, bias); break;
#endif
      }
    });
    return;
  }
  expresslane::for_row_blocks(M, [&](int64_t m0, int64_t mb) {
    const float* xp = x + m0 * K;
    float* yp = y + m0 * N;
    switch (mb) {
      case 1: gemv<1, BS>(xp, codes, scales, row_scales, table, yp, K, N, bias); break;
      case 2: gemv<2, BS>(xp, codes, scales, row_scales, table, yp, K, N, bias); break;
      case 3: gemv<3, BS>(xp, codes, scales, row_scales, table, yp, K, N, bias); break;
      default: gemv<4, BS>(xp, codes, scales, row_scales, table, yp, K, N, bias); break;
    }
  });
}

}  // namespace

torch::Tensor fp4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor row_scales,
                         c10::optional<torch::Tensor> bias, int64_t block, int64_t scale_kind) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && scales.dtype() == torch::kUInt8, "codes, scales: uint8");
  TORCH_CHECK(block == 16 || block == 32, "block size 16 or 32");
  TORCH_CHECK(scale_kind == value(ScaleKind::kE8M0) || scale_kind == value(ScaleKind::kE4M3),
              "scale kind 0 (E8M0) or 1 (E4M3)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % block == 0 && codes.size(1) * 2 == K && scales.size(1) * block == K, "shapes");
  TORCH_CHECK(row_scales.dtype() == torch::kFloat32 && row_scales.numel() == N, "row scales");
  x = x.contiguous();
  codes = codes.contiguous();
  scales = scales.contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_holder;
  const float* b = expresslane::float_bias(bias, bias_holder);
  const ScaleKind kind = static_cast<ScaleKind>(scale_kind);
  const float* table = scale_table(kind);
  auto* run_fn = block == 16 ? &run<16> : &run<32>;
  run_fn(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), row_scales.data_ptr<float>(),
         kind, table, y.data_ptr<float>(), M, K, N, b);
  return y;
}
