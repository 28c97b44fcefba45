// The 4-bit kernels' activations (fp4_cpu.cpp, int4_cpu.cpp): quantized to int8 per 32 values,
// in the order the expanded codes come in, with the sums the unsigned dot product needs.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace expresslane::w4a8 {

inline constexpr int kOffset = 12;  // added to the E2M1 codes to make them unsigned (fp4_cpu.cpp)

// With AVX-512 VNNI four groups (a quad, two pairs) go through one 512-bit dot product: the
// groups of whole quads come first, the remaining pair and group as before. Every M takes the
// same split, so a row's sums do not depend on the batch.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline constexpr int64_t kQuadGroups = 4;
inline constexpr int kI8Rows = 8;  // activation rows per pass over the codes (32 zmm registers)
#else
inline constexpr int64_t kQuadGroups = 1 << 30;  // no quads
inline constexpr int kI8Rows = 4;
#endif

// Quantized activations of one call: per row, values in expansion order, 12 x the sums of the
// values each int32 lane of the dot product covers (8 per group), and the scale of each weight
// block's activations (the per-32 scale, repeated for both 16-blocks of a group under NVFP4);
// with `sums`, each group's sum as the dot product sees it (scale x the sum of its int8 values).
struct QuantizedX {
  std::vector<int8_t> q;      // [M, K]
  std::vector<int32_t> corr;  // [M, K/32, 8]; a pair of groups uses the first group's 8
  std::vector<float> scale;   // [M, K/block rounded up to 8]
  std::vector<float> sum;     // [M, K/32 rounded up to 8] (zeros past K/32), or empty
};

inline QuantizedX quantize_activations(const float* x, int64_t M, int64_t K, int64_t block, bool sums = false) {
  const int64_t groups = K / 32, per_group = 32 / block, n8 = (K / block + 7) / 8 * 8, g8 = (groups + 7) / 8 * 8;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<int32_t>(M * groups * 8), std::vector<float>(M * n8),
                 std::vector<float>(sums ? M * g8 : 0)};
  // rows across threads for prompt chunks (each row's values are the same either way)
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::array<int8_t, 32> v8;
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t j = 0; j < groups; ++j) {
        const float* v = x + m * K + 32 * j;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t b = 0; b < per_group; ++b) out.scale[m * n8 + j * per_group + b] = amax / 127.0f;
        for (int i = 0; i < 32; ++i) v8[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        if (sums) {
          int32_t total = 0;
          for (int i = 0; i < 32; ++i) total += v8[i];
          out.sum[m * g8 + j] = amax / 127.0f * static_cast<float>(total);
        }
        int8_t* q = out.q.data() + m * K;
        int32_t* corr = out.corr.data() + (m * groups + (j & ~int64_t{1})) * 8;
        if ((j & 1) == 0 && j + 1 == groups) {  // unpaired: [even | odd], lanes of 4 values
          for (int i = 0; i < 16; ++i) q[32 * j + i] = v8[2 * i], q[32 * j + 16 + i] = v8[2 * i + 1];
          for (int lane = 0; lane < 8; ++lane) {
            const int8_t* e = q + 32 * j + 4 * lane;
            corr[lane] = kOffset * (e[0] + e[1] + e[2] + e[3]);
          }
          continue;
        }
        if (j < kQuadGroups * (groups / kQuadGroups)) {  // a quad: [even P0 | even P1 | odd P0 | odd P1]
          const int64_t base = 32 * (j & ~int64_t{3}), pair = (j >> 1) & 1, half = 16 * (j & 1);
          for (int i = 0; i < 16; ++i)
            q[base + 32 * pair + half + i] = v8[2 * i], q[base + 64 + 32 * pair + half + i] = v8[2 * i + 1];
          int32_t* quad_corr = out.corr.data() + (m * groups + (j & ~int64_t{3}) + pair) * 8;
          for (int lane = 0; lane < 4; ++lane) {
            int32_t sum = 0;
            for (int i = 0; i < 8; ++i) sum += v8[8 * lane + i];
            quad_corr[4 * (j & 1) + lane] = kOffset * sum;
          }
          continue;
        }
        const int64_t base = 32 * (j & ~int64_t{1}), half = 16 * (j & 1);  // pair start, which group
        for (int i = 0; i < 16; ++i) q[base + half + i] = v8[2 * i], q[base + 32 + half + i] = v8[2 * i + 1];
        for (int lane = 0; lane < 4; ++lane) {  // lane covers elements 8 lane .. 8 lane + 7
          int32_t sum = 0;
          for (int i = 0; i < 8; ++i) sum += v8[8 * lane + i];
          corr[4 * (j & 1) + lane] = kOffset * sum;
        }
      }
  });
  return out;
}

}  // namespace expresslane::w4a8
