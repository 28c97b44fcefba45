// Linear layers over 4-bit integer blocks (GGUF's Q4_0, Q4_1 and Q4_K as quant/int4.py holds
// them) for CPUs with AVX2 + FMA: y = x W^T (+ b), x float32 [M, K], W [N, K] in blocks of 32:
// codes 0..15 two per byte [N, K/2] (element 2i in the low nibble), a scale per block [N, K/32]
// (float16 or float32) and a min per block of the same dtype, or none (then the min is
// -8 x the scale: Q4_0's code - 8). A weight is scale x code + min. y float32 [M, N].
//
// The codes are already the unsigned bytes the byte dot products take, so they meet the int8
// activations with no table (w4a8_rows.h); the mins add min x (the block's activation sum),
// with the sum of the quantized activations, as llama.cpp's Q4_1 x Q8_1 does: a row is then
// exactly W times the rounded activations, whatever the split into scale x code + min.
#include <torch/extension.h>
#include <immintrin.h>

#include "common.h"
#include "kernels.h"
#include "w4a8_rows.h"

namespace {

using namespace expresslane::w4a8;
using expresslane::hsum;

constexpr int64_t kBlock = 32;

// A weight's per-block values (scales or mins): float16 or float32, [N, K/32].
struct BlockValues {
  const void* data;
  bool half;

  __m256 load8(int64_t i) const {
    if (!half) return _mm256_loadu_ps(static_cast<const float*>(data) + i);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i)));
  }
  float at(int64_t i) const {
    return half ? _cvtsh_ss(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
  }
  void widen(int64_t i, int64_t n, float* out) const {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, load8(i + k));
    for (; k < n; ++k) out[k] = at(i + k);
  }
};

struct Int4Weight {
  const uint8_t* codes;
  BlockValues scales, mins;
  bool has_mins;  // else each min is -8 x the scale
};

template <int M>
void gemv_int4(const QuantizedX& xq, int64_t m0, const Int4Weight& w, float* y, int64_t K, int64_t N,
               const float* bias) {
  const int64_t nb = K / kBlock, g8 = (nb + 7) / 8 * 8, mins_at = 64 * nb + 8;
  // the chunk's scales, then its mins (at the same stride)
  auto decode = [&](int64_t c0, int64_t c1, float* dec) {
    const int64_t n = (c1 - c0) * nb;
    w.scales.widen(c0 * nb, n, dec);
    if (w.has_mins) {
      w.mins.widen(c0 * nb, n, dec + mins_at);
    } else {
      for (int64_t i = 0; i < n; ++i) dec[mins_at + i] = -8.0f * dec[i];
    }
  };
  // The activations' sums are zero past the row's nb blocks, so the floats read past its mins
  // (the next row's, or the buffer's padding) add nothing.
  auto finish = [&](int64_t n, int m, __m256 lanes, const float* scales) {
    const float* mins = scales + mins_at;
    const float* sums = xq.sum.data() + (m0 + m) * g8;
    for (int64_t b = 0; b < g8; b += 8)
      lanes = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b), _mm256_loadu_ps(sums + b), lanes);
    y[m * N + n] = hsum(lanes) + (bias ? bias[n] : 0.0f);
  };
  gemv_i8<PlainCodes, M, kBlock>(xq, m0, w.codes, K, N, nb, decode, finish);
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8, "codes: uint8");
  const auto dtype = scales.scalar_type();
  TORCH_CHECK(dtype == torch::kHalf || dtype == torch::kFloat, "scales: float16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % kBlock == 0 && codes.size(1) * 2 == K && scales.size(0) == N && scales.size(1) * kBlock == K,
              "shapes: codes [N, K/2], scales [N, K/32], K a multiple of 32");
  const bool has_mins = mins.numel() > 0;
  TORCH_CHECK(!has_mins || (mins.scalar_type() == dtype && mins.sizes() == scales.sizes()),
              "mins: empty, or as the scales");
  x = x.contiguous();
  codes = codes.contiguous();
  scales = scales.contiguous();
  mins = has_mins ? mins.contiguous() : scales;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_holder;
  const float* b = expresslane::float_bias(bias, bias_holder);
  const bool half = dtype == torch::kHalf;
  const Int4Weight w{codes.data_ptr<uint8_t>(), {scales.data_ptr(), half}, {mins.data_ptr(), half}, has_mins};
  const QuantizedX xq = quantize_activations(x.data_ptr<float>(), M, K, kBlock, /*sums=*/true);
  float* yp = y.data_ptr<float>();
  expresslane::for_row_blocks<kI8Rows>(M, [&](int64_t m0, int64_t mb) {
    expresslane::with_rows<kI8Rows>(mb, [&](auto rows) {
      gemv_int4<decltype(rows)::value>(xq, m0, w, yp + m0 * N, K, N, b);
    });
  });
  return y;
}
