// Small-batch linear layers over float16 weights with AVX-512: y = x W^T (+ b), x float32
// [M, K], W float16 packed by pack_f16_dot, y float32 [M, N].
//
// bf16dot_cpu.cpp's layout and loop, in float32: W is packed so that 32 bytes hold 16 output
// columns at one k, which F16C widens exactly; each step multiplies them by a broadcast
// x[m, k] into 16 outputs' partial sums, with no horizontal reduction, and every weight load
// serves every row of the pass. A tile of 16-column blocks streams that many runs of W at once
// (the row kernel of gemv_cpu.cpp streams one weight row at a time, which read 22-24 GB/s here
// where the bf16 dot-product kernel reads 30-32). Every output (row m, column n) is one
// accumulation chain over k in order, whatever M: a row is bit-identical computed alone or in
// a batch (a speculative verification's rows match plain decoding exactly).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "common.h"
#include "kernels.h"

#ifdef __AVX512F__
namespace {

using expresslane::blocks_per_tile;

// Rows 0..MB of x ([*, K] float32) against column blocks b0..b0+NB of W ([N/16, K, 16]).
template <int MB, int NB>
inline void tile(const float* x, const c10::Half* w, int64_t K, float* y, int64_t N, int64_t b0, const float* bias) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const c10::Half* wb = w + b0 * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(wb + (j * K + k) * 16)));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  expresslane::store_tile(acc, y, N, b0, bias);
}

}  // namespace

// W [N, K] float16 -> [N/16, K, 16]: block b, column k holds W[16b + i, k] at i.
torch::Tensor pack_f16_dot(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kHalf && w.dim() == 2 && w.size(0) % 16 == 0,
              "w: float16 [N, K], N a multiple of 16");
  const int64_t N = w.size(0), K = w.size(1);
  // 32-byte aligned rows (aligned loads); torch's CPU allocator aligns to 64 bytes
  return w.contiguous().view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

torch::Tensor f16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kHalf && packed.dim() == 3 && packed.size(2) == 16,
              "packed: pack_f16_dot's [N/16, K, 16]");
  const int64_t M = x.size(0), K = packed.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.size(1) == K, "x [M, K] against W [N, K]");
  TORCH_CHECK(packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
              "packed: contiguous and 32-byte aligned");
  x = x.contiguous();
  torch::Tensor bias_holder;
  const float* b = expresslane::float_bias(bias, bias_holder);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const c10::Half* w = packed.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  expresslane::for_dot_passes(M, N / 16, [&](int64_t m0, int64_t rows, int64_t c0, int64_t c1) {
    expresslane::with_rows<12>(rows, [&](auto mb) {
      constexpr int MB = decltype(mb)::value;
      expresslane::run_tiles<blocks_per_tile<MB>()>(c0, c1, [&](auto nb, int64_t b0) {
        tile<MB, decltype(nb)::value>(xp + m0 * K, w, K, yp + m0 * N, N, b0, b);
      });
    });
  });
  return y;
}

bool f16_dot_available() { return true; }
#else
torch::Tensor pack_f16_dot(torch::Tensor) { TORCH_CHECK(false, "built without AVX-512"); }
torch::Tensor f16_dot_linear(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX-512");
}
bool f16_dot_available() { return false; }
#endif
