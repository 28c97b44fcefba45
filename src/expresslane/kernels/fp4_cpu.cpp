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
#include "kernels.h"
#include "w4a8_rows.h"

namespace {

using expresslane::ScaleKind;
using namespace expresslane::w4a8;
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

// The integer path (w4a8_rows.h), used when K is a multiple of 32: codes through a byte
// shuffle of the doubled E2M1 values + 12 (0..24, unsigned, as the byte dot products want).
alignas(16) const int8_t kE2M1Offset[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

struct E2M1Codes {
  static constexpr bool kShuffle = true;
  static __m128i table() { return _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset)); }
};

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

template <int M, int BS>
void gemv_e2m1(const QuantizedX& xq, int64_t m0, const uint8_t* codes, const uint8_t* scales, const float* row_scales,
               ScaleKind kind, const float* table, float* y, int64_t K, int64_t N, const float* bias) {
  const int64_t nb = K / BS;
  auto decode = [&](int64_t c0, int64_t c1, float* dec) {
    decode_scales(scales + c0 * nb, (c1 - c0) * nb, kind, table, dec);
  };
  auto finish = [&](int64_t n, int m, __m256 lanes, const float*) {
    y[m * N + n] = hsum(lanes) * row_scales[n] + (bias ? bias[n] : 0.0f);
  };
  expresslane::w4a8::gemv_i8<E2M1Codes, M, BS>(xq, m0, codes, K, N, 0, decode, finish);
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
      expresslane::with_rows<kI8Rows>(mb, [&](auto rows) {
        gemv_e2m1<decltype(rows)::value, BS>(xq, m0, codes, scales, row_scales, kind, table, y + m0 * N, K, N, bias);
      });
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
