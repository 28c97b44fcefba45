// Small-batch linear layers with block-scaled 4-bit weights (MXFP4 / NVFP4) for CPUs with
// AVX2 + FMA: y = x W^T (+ b), x float32 [M, K], W as E2M1 codes two per byte [N, K/2] (low
// nibble first), one scale byte per block [N, K/block] (E8M0 exponent or E4M3 bits) and one
// float32 scale per output row (NVFP4's tensor scale). y float32 [M, N].
//
// Codes are expanded in registers: split into nibbles and looked up with one byte shuffle in a
// table of the E2M1 values doubled to integers (0, 1, 2, 3, 4, 6, 8, 12 and negatives; the
// block scale is halved to match). When K is a multiple of 32 they meet int8-quantized
// activations in a byte dot product (`row_kernel_i8`); otherwise they are widened to float32
// and fed to FMAs (`row_kernel`). Partial sums are scaled once per block. The weight is never
// expanded in memory, so a decode step reads 4.25-4.5 bits per weight instead of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common.h"

namespace {

alignas(16) const int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Scale byte -> float, halved to undo the doubled E2M1 table. kind 0: E8M0, 1: E4M3.
const float* scale_table(int64_t kind) {
  static const std::array<std::array<float, 256>, 2> tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int i = 0; i < 256; ++i) {
      t[0][i] = i == 255 ? NAN : std::ldexp(0.5f, i - 127);
      const c10::Float8_e4m3fn e4m3(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits());
      t[1][i] = 0.5f * static_cast<float>(e4m3);
    }
    return t;
  }();
  return tables[kind].data();
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

// The integer path, used when K is a multiple of 32: activations are quantized to int8 per
// 32 values (scale amax/127, round to nearest) once per call, and each 32-weight group is a
// byte-shuffle expansion plus one unsigned x signed byte dot product (vpmaddubsw, with the
// weight's sign moved onto the activation), as llama.cpp does for Q4_0 x Q8_0. Its error
// against the float path is the activation rounding, about 0.2% of a dot product.
template <int M, int BS>
inline void row_kernel_i8(const int8_t* xq, const float* xs, const uint8_t* codes, const uint8_t* scales,
                          const float* table, float row_scale, float* y, int64_t K, int64_t N, int64_t n,
                          const float* bias) {
  const __m128i lut128 = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Doubled));
  const __m256i lut = _mm256_set_m128i(lut128, lut128);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t groups = K / 32;
  for (int64_t j = 0; j < groups; ++j) {
    const uint8_t* p = codes + 16 * j;
    _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(b, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    const __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    const __m256i w = _mm256_shuffle_epi8(lut, idx);  // 32 doubled E2M1 values, in order
    const __m256i w_abs = _mm256_sign_epi8(w, w);
    // int32 lanes 0-3 sum elements 0-15, lanes 4-7 elements 16-31: one NVFP4 block each
    const __m256 ws = BS == 16 ? _mm256_set_m128(_mm_set1_ps(table[scales[2 * j + 1]]), _mm_set1_ps(table[scales[2 * j]]))
                               : _mm256_set1_ps(table[scales[j]]);
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + 32 * j));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, w)), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(xs[m * groups + j])), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) * row_scale + (bias ? bias[n] : 0.0f);
}

void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* q, float* s) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K / 32; ++j) {
      const float* v = x + m * K + 32 * j;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      s[m * (K / 32) + j] = scale;
      for (int i = 0; i < 32; ++i) q[m * K + 32 * j + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    }
}

template <int M, int BS>
void gemv_i8(const int8_t* xq, const float* xs, const uint8_t* codes, const uint8_t* scales, const float* row_scales,
             const float* table, float* y, int64_t K, int64_t N, const float* bias) {
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      row_kernel_i8<M, BS>(xq, xs, codes + n * (K / 2), scales + n * (K / BS), table, row_scales[n], y, K, N, n,
                           bias);
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
void run(const float* x, const uint8_t* codes, const uint8_t* scales, const float* row_scales,
         const float* table, float* y, int64_t M, int64_t K, int64_t N, const float* bias) {
  if (K % 32 == 0) {
    std::vector<int8_t> xq(M * K);
    std::vector<float> xs(M * (K / 32));
    quantize_activations(x, M, K, xq.data(), xs.data());
    expresslane::for_row_blocks(M, [&](int64_t m0, int64_t mb) {
      const int8_t* q = xq.data() + m0 * K;
      const float* s = xs.data() + m0 * (K / 32);
      float* yp = y + m0 * N;
      switch (mb) {
        case 1: gemv_i8<1, BS>(q, s, codes, scales, row_scales, table, yp, K, N, bias); break;
        case 2: gemv_i8<2, BS>(q, s, codes, scales, row_scales, table, yp, K, N, bias); break;
        case 3: gemv_i8<3, BS>(q, s, codes, scales, row_scales, table, yp, K, N, bias); break;
        default: gemv_i8<4, BS>(q, s, codes, scales, row_scales, table, yp, K, N, bias); break;
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
  TORCH_CHECK(scale_kind == 0 || scale_kind == 1, "scale kind 0 (E8M0) or 1 (E4M3)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % block == 0 && codes.size(1) * 2 == K && scales.size(1) * block == K, "shapes");
  TORCH_CHECK(row_scales.dtype() == torch::kFloat32 && row_scales.numel() == N, "row scales");
  x = x.contiguous();
  codes = codes.contiguous();
  scales = scales.contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_holder;
  const float* b = expresslane::float_bias(bias, bias_holder);
  const float* table = scale_table(scale_kind);
  auto* run_fn = block == 16 ? &run<16> : &run<32>;
  run_fn(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), row_scales.data_ptr<float>(),
         table, y.data_ptr<float>(), M, K, N, b);
  return y;
}
