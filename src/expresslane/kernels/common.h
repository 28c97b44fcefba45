// Helpers shared by the small-batch linear kernels.
#pragma once
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <array>

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

}  // namespace expresslane
