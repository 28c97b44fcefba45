// The decode step's small operations as plain loops over float32 rows (AVX2 + FMA).
//
// At decode batch sizes each of these touches a few KB; issued as ATen ops they cost 5-15 us
// apiece in dispatch and allocation, more than the arithmetic. Lengths must be multiples of 8.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "common.h"

namespace expresslane::ops {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum(_mm256_add_ps(s0, s1));
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

// y = x * w / sqrt(mean(x^2) + eps); y may be x
inline void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}

// Rotate-half RoPE in place: t = t * cos + roll(t, D/2) * sin, where `sin` already carries the
// sign of the rotation (negative first half), as in models/layers.py.
inline void rope(float* t, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = t[i], b = t[i + half];
    t[i] = a * cos[i] + b * sin[i];
    t[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// y = silu(g) * u
inline void silu_mul(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

inline void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
}

}  // namespace expresslane::ops
