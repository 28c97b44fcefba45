// Small-batch linear layers with AVX-512 BF16 dot products: y = x W^T (+ b), x float32
// [M, K] rounded to bf16, W bf16 packed by pack_bf16_dot, y float32 [M, N].
//
// The demo-sized models this serves sit in cache, so a decode step is bound by arithmetic,
// not by the bytes of W. `vdpbf16ps` does 32 bf16 multiply-adds per instruction (float32
// accumulation), twice the float32 FMA's 16, and needs no widening of W. The weight is
// packed so that one 64-byte line holds 16 output columns x 2 consecutive k: each
// instruction takes a broadcast pair of x and produces 16 outputs' partial sums, with no
// horizontal reduction. Every output (row m, column n) is one accumulation chain over k in
// order, whatever M and whatever tile it falls in: a row is bit-identical computed alone or
// in a batch (a speculative verification's rows match plain decoding exactly).
//
// x is rounded to bf16 (round to nearest even), as oneDNN's bf16 matmul does for the larger
// batches; products are exact in float32 and summed in float32.
//
// Weights that come from memory (SmolLM2-135M's 270 MB) are prefetched a tile ahead: a tile
// reads NB streams 18 KB apart, each crossing a 4 KB page (where the hardware prefetchers
// stop) every 64 pairs, so a compute-bound tile (5+ rows) stalled on each. Linears and head of
// a 5-row verification took 12.3 against 14.8 ms on a Zen 4 core, 9 rows 16.2 against 20.4.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <memory>

#include "common.h"
#include "kernels.h"

#ifdef __AVX512BF16__
namespace {

using expresslane::blocks_per_tile;

// Rows m0..m0+MB of x (bf16 pairs as uint32, [M, K2]) against column blocks b0..b0+NB.
template <int MB, int NB>
inline void tile(const uint32_t* xp, const __m512i* w, int64_t K2, float* y, int64_t N, int64_t b0,
                 const float* bias) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const __m512i* wb = w + b0 * K2;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_load_si512(wb + j * K2 + kp);
      // the next tile's line into L2 (past W's end too: a prefetch does not fault)
      _mm_prefetch(reinterpret_cast<const char*>(wb + (NB + j) * K2 + kp), _MM_HINT_T1);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * K2 + kp]));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, (__m512bh)wv[j]);
    }
  }
  expresslane::store_tile(acc, y, N, b0, bias);
}

// x [M, 2 K2] float32 to bf16 pairs (round to nearest even), [M, K2] as uint32; rows split
// across threads for prompt-sized M (serial, a 2k-row chunk's conversions held the other
// thread idle; decode batches stay in this thread: a parallel region costs more than their
// conversion), left uninitialized before they are written.
std::unique_ptr<uint32_t[]> bf16_pairs(const float* xf, int64_t M, int64_t K2) {
  std::unique_ptr<uint32_t[]> xb(new uint32_t[M * K2]);
  at::parallel_for(0, M, std::max<int64_t>(1, 131072 / K2), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int64_t k = 0;
      for (; k + 32 <= 2 * K2; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + m * 2 * K2 + k + 16),
                                               _mm512_loadu_ps(xf + m * 2 * K2 + k));
        _mm512_storeu_si512(xb.get() + m * K2 + k / 2, (__m512i)v);
      }
      auto* dst = reinterpret_cast<at::BFloat16*>(xb.get() + m * K2);
      for (; k < 2 * K2; ++k) dst[k] = at::BFloat16(xf[m * 2 * K2 + k]);  // rounds to nearest even
    }
  });
  return xb;
}

}  // namespace

// W [N, K] bf16 -> [N/16, K/2, 32]: block b, pair p holds W[16b + i, 2p + t] at 2i + t.
torch::Tensor pack_bf16_dot(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 2, "w: bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "N a multiple of 16, K even");
  // 64-byte aligned (aligned loads); torch's CPU allocator aligns to 64 bytes
  return w.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / 16, K / 2, 32});
}

torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kBFloat16 && packed.dim() == 3 && packed.size(2) == 32,
              "packed: pack_bf16_dot's [N/16, K/2, 32]");
  const int64_t M = x.size(0), K2 = packed.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.size(1) == 2 * K2, "x [M, K] against W [N, K]");
  TORCH_CHECK(packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed: contiguous and 64-byte aligned");
  x = x.contiguous();
  torch::Tensor bias_holder;
  const float* b = expresslane::float_bias(bias, bias_holder);
  const auto xb = bf16_pairs(x.data_ptr<float>(), M, K2);
  auto y = torch::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const __m512i*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  expresslane::for_dot_passes(M, N / 16, [&](int64_t m0, int64_t rows, int64_t c0, int64_t c1) {
    expresslane::with_rows<12>(rows, [&](auto mb) {
      constexpr int MB = decltype(mb)::value;
      expresslane::run_tiles<blocks_per_tile<MB>()>(c0, c1, [&](auto nb, int64_t b0) {
        tile<MB, decltype(nb)::value>(xb.get() + m0 * K2, w, K2, yp + m0 * N, N, b0, b);
      });
    });
  });
  return y;
}

bool bf16_dot_available() { return true; }
#else
torch::Tensor pack_bf16_dot(torch::Tensor) { TORCH_CHECK(false, "built without AVX-512 BF16"); }
torch::Tensor bf16_dot_linear(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX-512 BF16");
}
bool bf16_dot_available() { return false; }
#endif
