// Rows of a compressed KV cache widened to float32 (paged_kv.h): bf16, FP8 E4M3 with a scale per
// row, FP4 E2M1 with an E4M3 scale per 16 values. Each value is bit-identical to the scalar
// reference (bf16's top half; torch's float8_e4m3fn conversion times the scale; the E2M1 value
// times its block's scale), so the vector and scalar reads of a row agree exactly.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common.h"

namespace expresslane {

constexpr float kE2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

// dst[0..n) = the bf16 values at src as float32 (bf16 is float32's top half).
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_bf16x16(src + i));
#endif
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
  for (; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &wide, sizeof(float));
  }
}

constexpr float kE4M3HalfUnit = 256.0f;  // an E4M3 value over its e4m3_half_bits value

// E4M3 bytes, sign-extended to 16-bit lanes (16 of them), as float16 bits of their value / 2^8:
// shifted 7 places, the byte's exponent and mantissa land on float16's (exponent bias 7 against
// 15; E4M3 subnormals land on float16 subnormals, which F16C widens exactly) and the
// extension's copy of the sign on float16's sign, whose own copy is cleared; the NaN codes
// (S.1111.111) become a float16 NaN.
inline __m256i e4m3_half_bits(__m256i x) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x3F80));
  const __m256i nan =
      _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x7E00));
  return _mm256_or_si256(h, nan);
}

// 8 (16) E4M3 bytes at p as float32: their values / 2^8 (kE4M3HalfUnit times each is its
// value, exactly).
inline __m256 e4m3x8(const uint8_t* p) {
  __m128i bytes;
  std::memcpy(&bytes, p, 8);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(e4m3_half_bits(_mm256_castsi128_si256(_mm_cvtepi8_epi16(bytes)))));
}
#ifdef __AVX512F__
inline __m512 e4m3x16(const uint8_t* p) {
  return _mm512_cvtph_ps(e4m3_half_bits(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
#endif

// dst[0..n) = the E4M3 bytes at src times scale. value / 2^8 widened, times 2^8 * scale (exact):
// the same product, rounded once, as e4m3_table()[byte] * scale.
inline void widen_fp8(const uint8_t* src, float scale, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 s16 = _mm512_set1_ps(kE4M3HalfUnit * scale);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(e4m3x16(src + i), s16));
#endif
  const __m256 s = _mm256_set1_ps(kE4M3HalfUnit * scale);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(e4m3x8(src + i), s));
  const float* e4m3 = e4m3_table();
  for (; i < n; ++i) dst[i] = e4m3[src[i]] * scale;
}

// dst[0..n) (n a multiple of 16) = the E2M1 codes at codes (two a byte, the low nibble first)
// times their 16-value block's E4M3 scale.
inline void widen_fp4(const uint8_t* codes, const uint8_t* scales, float* dst, int64_t n) {
  const float* e4m3 = e4m3_table();
#ifdef __AVX512F__
  const __m512 values = _mm512_loadu_ps(kE2M1);
#else
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1);  // kE2M1[8 + i] is -kE2M1[i]
#endif
  for (int64_t b = 0; b < n / 16; ++b) {
    __m128i packed;
    std::memcpy(&packed, codes + 8 * b, 8);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    const __m128i code = _mm_unpacklo_epi8(low, high);  // the block's 16 codes in order
#ifdef __AVX512F__
    const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(code), values);
    _mm512_storeu_ps(dst + 16 * b, _mm512_mul_ps(v, _mm512_set1_ps(e4m3[scales[b]])));
#else
    const __m256 scale = _mm256_set1_ps(e4m3[scales[b]]);
    for (int half = 0; half < 2; ++half) {
      const __m256i c = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(code, 8) : code);
      const __m256 mag = _mm256_permutevar8x32_ps(magnitudes, c);  // uses the low 3 bits
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
      const __m256 v = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
      _mm256_storeu_ps(dst + 16 * b + 8 * half, _mm256_mul_ps(v, scale));
    }
#endif
  }
}

}  // namespace expresslane
