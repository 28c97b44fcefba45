// Helpers shared by the small-batch linear kernels.
#pragma once
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <type_traits>

namespace expresslane {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// 8 (16) bf16 values at p as float32: bf16 is float32's top half, widened by a 16-bit shift.
inline __m256 load_bf16x8(const void* p) {
  const __m128i raw = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

#ifdef __AVX512F__
inline __m512 load_bf16x16(const void* p) {
  const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// E4M3 byte -> float, as torch converts float8_e4m3fn.
inline const float* e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return v;
  }();
  return t.data();
}

// The bias as float32 (kept alive in `holder`), or nullptr.
inline const float* float_bias(const c10::optional<torch::Tensor>& bias, torch::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  holder = bias->to(torch::kFloat32).contiguous();
  return holder.data_ptr<float>();
}

// Calls gemv<mb>(x rows m0.., y rows m0..) for row blocks of at most MaxRows (the register
// budget of the kernel: each block reads the whole weight once).
template <int MaxRows = 4, typename Fn>
inline void for_row_blocks(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += MaxRows) fn(m0, std::min<int64_t>(MaxRows, M - m0));
}

// The dot-product kernels' tiling (bf16dot_cpu.cpp, f16dot_cpu.cpp). Accumulators per tile:
// NB blocks of 16 columns for each of MB rows, within 32 zmm registers.
template <int MB>
constexpr int blocks_per_tile() {
  return MB == 1 ? 8 : MB == 2 ? 6 : MB <= 6 ? 4 : MB <= 8 ? 3 : 2;
}

// tile(std::integral_constant<int, nb>{}, b) over column blocks [b, c1): tiles of NB blocks,
// the rest in tiles of NB/2, ...
template <int NB, typename Tile>
inline void run_tiles(int64_t b, int64_t c1, const Tile& tile) {
  for (; b + NB <= c1; b += NB) tile(std::integral_constant<int, NB>{}, b);
  if constexpr (NB > 1) run_tiles<NB / 2>(b, c1, tile);
}

#ifdef __AVX512F__
// Rows 0..MB of y ([*, N]), column blocks b0..b0+NB = acc (+ bias).
template <int MB, int NB>
inline void store_tile(const __m512 (&acc)[MB][NB], float* y, int64_t N, int64_t b0, const float* bias) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = (b0 + j) * 16;
      __m512 v = acc[m][j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
      _mm512_storeu_ps(y + m * N + n, v);
    }
}
#endif

// f(std::integral_constant<int, rows>{}) for 1 <= rows <= Max: one instantiation per row count.
template <int Max, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (Max > 1)
    if (rows < Max) return with_rows<Max - 1>(rows, f);
  f(std::integral_constant<int, Max>{});
}

// pass(m0, rows, c0, c1) over M rows and `blocks` blocks of 16 columns: the blocks split across
// threads, each running every row pass over a chunk of them while that chunk of W is in L2,
// then moving on. Passes of at most 12 rows, balanced (13 rows: 7 + 6, not 12 + 1: a one-row
// pass has too few accumulation chains to keep the units busy); past 12 rows a single pass
// would hold one column block per tile and wait on its broadcasts of x.
template <typename Pass>
inline void for_dot_passes(int64_t M, int64_t blocks, const Pass& pass) {
  constexpr int64_t kChunk = 24;  // a multiple of every blocks_per_tile
  // 12 blocks per thread at least: N = 384 still splits (5-row passes measured faster on two)
  at::parallel_for(0, blocks, 12, [&](int64_t c0, int64_t c1) {
    for (int64_t cc = c0; cc < c1; cc += kChunk) {
      const int64_t ce = std::min(cc + kChunk, c1);
      const int64_t passes = (M + 11) / 12;
      for (int64_t m0 = 0, p = 0; m0 < M; ++p) {
        const int64_t rows = (M - m0 + (passes - p) - 1) / (passes - p);
        pass(m0, rows, cc, ce);
        m0 += rows;
      }
    }
  });
}

}  // namespace expresslane
