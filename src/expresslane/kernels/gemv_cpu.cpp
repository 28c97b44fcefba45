// Small-batch linear layers for CPUs with AVX2 + FMA, and AVX-512 where built with it:
// y = x W^T (+ b), x float32 [M, K], W bfloat16 or float16 [N, K] (row-major, as stored by
// Hugging Face), y float32 [M, N].
//
// At decode batch sizes a linear layer is a matrix-vector product bound by the bytes of W
// it reads. Keeping W in 16 bits halves those bytes against float32. Each chunk of W is
// widened to float32 in registers (bf16: a 16-bit shift; float16: F16C's conversion, exact)
// and fed to float32 FMAs. CPUs with AVX-512 BF16 run bf16 weights in bf16dot_cpu.cpp
// instead, whose dot product rounds x to bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "common.h"
#include "kernels.h"

namespace {

using expresslane::hsum;
using expresslane::load_bf16x8;

// 8 (16) weights widened to float32
inline __m256 widen8(const at::BFloat16* p) { return load_bf16x8(p); }
inline __m256 widen8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One row of W against M input vectors. The row is read front to back with U independent
// accumulator chains per vector, and the line 1 KB ahead is prefetched: a single sequential
// stream per core, which streams from DRAM ~1.8x faster than interleaving several rows.
template <int M, int U, typename W>
inline void row_kernel(const float* x, const W* row, float* y, int64_t K, int64_t N, int64_t n, const float* bias) {
  __m256 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + 1024, _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      const __m256 wv = widen8(row + k + 8 * u);
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[m][u]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
    float s = hsum(sum);
    for (int64_t j = k; j < K; ++j) s += static_cast<float>(row[j]) * x[m * K + j];
    y[m * N + n] = s + (bias ? bias[n] : 0.0f);
  }
}

#ifdef __AVX512F__
// AVX-512: 16 weights per register, and U = 4 chains per row for every M, added in a fixed
// order: an output row is bit-identical whether it is computed alone or in a batch (a
// speculative verification's rows match plain decoding exactly). Passes of up to 4 input
// rows: at 5-8 the 4M accumulators spill, and two passes of 4 measured as fast as one of 8.
constexpr int kChains512 = 4;

using expresslane::load_bf16x16;

inline __m512 widen16(const at::BFloat16* p) { return load_bf16x16(p); }
inline __m512 widen16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int M, typename W>
inline void row_kernel512(const float* x, const W* row, float* y, int64_t K, int64_t N, int64_t n, const float* bias) {
  constexpr int U = kChains512;
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    for (int u = 0; u < U; u += 2)  // 64 weights = two lines, 1 KB ahead
      _mm_prefetch(reinterpret_cast<const char*>(row + k + 16 * u) + 1024, _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      const __m512 wv = widen16(row + k + 16 * u);
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), acc[m][u]);
    }
  }
  for (int u = 0; k + 16 <= K; k += 16, ++u) {  // at most three whole 16-blocks left
    const __m512 wv = widen16(row + k);
    for (int m = 0; m < M; ++m) acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m][u]);
  }
  for (int m = 0; m < M; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    float s = _mm512_reduce_add_ps(sum);
    for (int64_t j = k; j < K; ++j) s += static_cast<float>(row[j]) * x[m * K + j];
    y[m * N + n] = s + (bias ? bias[n] : 0.0f);
  }
}

template <typename W>
void gemv512(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, const float* bias) {
  // each thread runs every pass over its range of weight rows, which stays in L2 between them
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    expresslane::for_row_blocks<4>(M, [&](int64_t m0, int64_t mb) {
      const float* xp = x + m0 * K;
      float* yp = y + m0 * N;
      expresslane::with_rows<4>(mb, [&](auto rows) {
        for (int64_t n = n0; n < n1; ++n) row_kernel512<decltype(rows)::value>(xp, w + n * K, yp, K, N, n, bias);
      });
    });
  });
}
#endif

template <int M, typename W>
void gemv(const float* x, const W* w, float* y, int64_t K, int64_t N, const float* bias) {
  // U independent FMA chains per row hide the FMA latency. From M = 7 the M * U accumulators
  // outgrow the 16 ymm registers and a few spill, which still measured faster than U = 1
  // (whose M chains stall on latency) at the verification widths 5-8.
  constexpr int U = M <= 2 ? 4 : 2;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) row_kernel<M, U>(x, w + n * K, y, K, N, n, bias);
  });
}

template <typename W>
void half_gemv(const float* x, const W* wp, float* y, int64_t M, int64_t K, int64_t N, const float* b) {
#ifdef __AVX512F__
  gemv512(x, wp, y, M, K, N, b);
  return;
#endif
  // Up to 8 rows per pass over W: a speculative verification (k+1 rows) reads W once.
  expresslane::for_row_blocks<8>(M, [&](int64_t m0, int64_t mb) {
    const float* xp = x + m0 * K;
    float* yp = y + m0 * N;
    expresslane::with_rows<8>(mb, [&](auto rows) { gemv<decltype(rows)::value>(xp, wp, yp, K, N, b); });
  });
}

}  // namespace

torch::Tensor half_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && (w.dtype() == torch::kBFloat16 || w.dtype() == torch::kHalf),
              "x fp32, w bf16 or fp16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes [M,K] x [N,K]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_holder;
  const float* b = expresslane::float_bias(bias, bias_holder);
  if (w.dtype() == torch::kHalf)
    half_gemv(x.data_ptr<float>(), w.data_ptr<at::Half>(), y.data_ptr<float>(), M, K, N, b);
  else
    half_gemv(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N, b);
  return y;
}
