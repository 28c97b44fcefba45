// The row kernels of the decode attention (paged_attention.h): query rows scored against key
// rows and value rows weighed, each row's result the same whatever rows share its work item,
// and a long row's keys in segments whose partial results merge in a fixed order.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"
#include "decode_ops.h"
#include "widen.h"

namespace expresslane {

// A key or value row's next 8 (16) values as float32: in place from a float32 cache, widened
// from a bf16 one (the same floats the bf16 store's reads give), and from an FP8 one the E4M3
// values / 2^8 (e4m3x8; the 2^8 goes into the row's scale, RowScales).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load_bf16x8(p); }
inline __m256 load8(const uint8_t* p) { return e4m3x8(p); }
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
inline __m512 load16(const uint8_t* p) { return e4m3x16(p); }
#endif

// The factors of a scaled cache's rows (FP8: each row's scale times 2^8), by key position;
// none for the others. A key's factor multiplies its scores, a value's its weights.
struct RowScales {
  const float* keys = nullptr;
  const float* values = nullptr;
};

// weights[r][p] *= f[p] for p < n[r]; nothing without f.
inline void scale_weights(float* const* weights, const int64_t* n, int64_t rows, const float* f) {
  if (f == nullptr) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < n[r]; ++p) weights[r][p] *= f[p];
}

// q . k for every key row in `keys` (n of them), times `scale`, into s[0..n) (AVX2). Each
// score is bit-identical to ops::dot(q, k, D) * scale; the query rows stay in registers across
// the keys (D = 32 / 64: the demo pair's head sizes, and common ones), which halves the loads.
template <int D, typename T>
inline void score_rows(const float* q, const T* const* keys, int64_t n, float scale, float* s) {
  __m256 qv[D / 8];
  for (int i = 0; i < D / 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  for (int64_t p = 0; p < n; ++p) {
    const T* k = keys[p];
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int i = 0; i + 16 <= D; i += 16) {  // ops::dot's two chains, in its order
      s0 = _mm256_fmadd_ps(qv[i / 8], load8(k + i), s0);
      s1 = _mm256_fmadd_ps(qv[i / 8 + 1], load8(k + i + 8), s1);
    }
    s[p] = hsum(_mm256_add_ps(s0, s1)) * scale;
  }
}

// out[0..D) = sum over p < n of w[p] * values[p], accumulated in p order (bit-identical to
// repeated ops::axpy), the accumulator in registers.
template <int D, typename T>
inline void weigh_rows(const float* w, const T* const* values, int64_t n, float* out) {
  __m256 acc[D / 8];
  for (int i = 0; i < D / 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    const __m256 wv = _mm256_set1_ps(w[p]);
    for (int i = 0; i < D / 8; ++i) acc[i] = _mm256_fmadd_ps(wv, load8(values[p] + 8 * i), acc[i]);
  }
  for (int i = 0; i < D / 8; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

#ifdef __AVX512F__
// AVX-512 (D a multiple of 16, at most 128). Scores 16 keys at a time: each key's D/16
// products are summed in one chain, then the 16 partial vectors are reduced together by a
// tree of lane shuffles (15 adds of pairs, not 16 horizontal sums). Every score goes through
// the same chain and the same tree, wherever its key falls (a short last group is padded
// with zeros), so a score does not depend on n or on which keys share its group.
inline __m512 sum16(__m512 v[16]) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: t[i] = (v[i] | v[i+8]) with 8 lanes each
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit chunks: u[i] = (v[i] | v[i+8] | v[i+4] | v[i+12])
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[i], t[i + 4], 0x88), _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs of lanes within each chunk
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[i], u[i + 2], 0x44), _mm512_shuffle_ps(u[i], u[i + 2], 0xEE));
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  // lane 4c + l now holds the sum of v[{0, 2, 1, 3}[l] + {0, 8, 4, 12}[c]]
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, x);
}

// Rows of queries scored 16 / R keys at a time for R rows (R <= 4): one load of each key feeds
// every row (a row's loop alone is bound by the loads, and an FP8 key's widening is paid once);
// row r sees the first n[r] keys (non-decreasing: a verification's next query sees one key
// more). The R * (16 / R) partial vectors go through sum16 together, so every score takes the
// same chain and reduction tree whatever R, n, or the keys that share its group.
template <int D, int R, typename T>
inline void score_rows512(const float* const* q, const T* const* keys, const int64_t* n, float scale,
                          float* const* s) {
  constexpr int K = 16 / R;  // keys per group
  __m512 qv[R][D / 16];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D / 16; ++i) qv[r][i] = _mm512_loadu_ps(q[r] + 16 * i);
  const __m512 sc = _mm512_set1_ps(scale);
  alignas(64) float out[16];
  for (int64_t p0 = 0; p0 < n[R - 1]; p0 += K) {
    const int m = static_cast<int>(std::min<int64_t>(K, n[R - 1] - p0));
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int j = 0; j < K; ++j) {  // a whole K: the accumulators stay in registers
      if (j >= m) continue;
      const T* k = keys[p0 + j];
      for (int i = 0; i < D / 16; ++i) {
        const __m512 kv = load16(k + 16 * i);
        for (int r = 0; r < R; ++r) acc[r * K + j] = _mm512_fmadd_ps(qv[r][i], kv, acc[r * K + j]);
      }
    }
    _mm512_store_ps(out, _mm512_mul_ps(sum16(acc), sc));
    for (int r = 0; r < R; ++r) {
      const int64_t count = std::clamp<int64_t>(n[r] - p0, 0, K);
      std::copy(out + r * K, out + r * K + count, s[r] + p0);
    }
  }
}

// How many rows score_rows512 scores together at head size D: their queries and the 16
// accumulators within the 32 registers.
template <int D>
constexpr int score_group_rows() {
  return D <= 32 ? 4 : D <= 64 ? 3 : 1;
}

// out[r][0..D) += sum over p0 <= p < p1 of w[r][p] * values[p] for R rows at once (one load
// of each value row), accumulated in p order; `resume`: out holds the sums over p < p0, else
// they start at zero. Each output is the same chain of operations as if computed alone.
template <int D, int R, typename T>
inline void weigh_rows512(const float* const* w, const T* const* values, int64_t p0, int64_t p1,
                          float* const* out, bool resume) {
  __m512 acc[R][D / 16];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D / 16; ++i) acc[r][i] = resume ? _mm512_loadu_ps(out[r] + 16 * i) : _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512 v[D / 16];
    for (int i = 0; i < D / 16; ++i) v[i] = load16(values[p] + 16 * i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r][p]);
      for (int i = 0; i < D / 16; ++i) acc[r][i] = _mm512_fmadd_ps(wv, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(out[r] + 16 * i, acc[r][i]);
}

// Rows in groups of up to R (R * D / 16 accumulators: 24 registers at most), 4 rows giving 16
// independent chains (one row's 4 were bound by the FMA latency); 6 at head size 64, so more
// rows share each value row's load and widening (SmolLM2-135M's verifications of 5-13
// positions: 3% less attention time than in groups of 4, Zen 4). n[r]: the keys row r sees,
// non-decreasing (a verification's later queries see more): a group weighs the keys its first
// row sees together, then each row its own remaining ones.
template <int D, typename T>
inline void weigh_group512(const float* const* w, const T* const* values, const int64_t* n, float* const* out,
                           int rows) {
  constexpr int R = D <= 32 ? 4 : D <= 64 ? 6 : 2;
  for (int r0 = 0; r0 < rows; r0 += R) {
    const int m = std::min(R, rows - r0);
    const int64_t shared = n[r0];
    with_rows<R>(m, [&](auto g) {
      weigh_rows512<D, decltype(g)::value>(w + r0, values, 0, shared, out + r0, false);
    });
    for (int r = r0; r < r0 + m; ++r)
      if (n[r] > shared) weigh_rows512<D, 1>(w + r, values, shared, n[r], out + r, true);
  }
}

template <int D, typename T>
inline int64_t score_some512(const float* const* q, const T* const* keys, const int64_t* n, int64_t rows, float scale,
                             float* const* s) {
  const int64_t take = std::min<int64_t>(rows, score_group_rows<D>());
  with_rows<score_group_rows<D>()>(take, [&](auto r) {
    score_rows512<D, decltype(r)::value>(q, keys, n, scale, s);
  });
  return take;
}
#endif

// Scores of the rows from q[0] on that one kernel call takes together (up to score_group_rows
// with AVX-512, one with AVX2); how many, or 0 where no kernel has head size D.
template <typename T>
inline int64_t score_some(const float* const* q, const T* const* keys, const int64_t* n, int64_t rows, int64_t D,
                          float scale, float* const* s) {
#ifdef __AVX512F__
  if (D == 64) return score_some512<64>(q, keys, n, rows, scale, s);
  if (D == 128) return score_some512<128>(q, keys, n, rows, scale, s);
  if (D == 32) return score_some512<32>(q, keys, n, rows, scale, s);
#endif
  if (D == 64) return score_rows<64>(q[0], keys, n[0], scale, s[0]), 1;
  if (D == 32) return score_rows<32>(q[0], keys, n[0], scale, s[0]), 1;
  return 0;
}

template <typename T>
inline void weigh_rows_any(const float* w, const T* const* values, int64_t n, int64_t D, float* out) {
  if (D == 64) return weigh_rows<64>(w, values, n, out);
  if (D == 32) return weigh_rows<32>(w, values, n, out);
  if constexpr (std::is_same_v<T, float>) {
    std::fill(out, out + D, 0.0f);
    for (int64_t p = 0; p < n; ++p) ops::axpy(w[p], values[p], out, D);
  }
}

// weigh_rows for `rows` outputs over the same value rows, row r over the first n[r] of them
// (n non-decreasing).
template <typename T>
inline void weigh_group_any(const float* const* w, const T* const* values, const int64_t* n, int64_t D,
                            float* const* out, int rows) {
#ifdef __AVX512F__
  if (D == 64) return weigh_group512<64>(w, values, n, out, rows);
  if (D == 128) return weigh_group512<128>(w, values, n, out, rows);
  if (D == 32) return weigh_group512<32>(w, values, n, out, rows);
#endif
  for (int r = 0; r < rows; ++r) weigh_rows_any(w[r], values, n[r], D, out[r]);
}

// weights[r][0..n[r]) = queries[r]'s scores against the first n[r] key rows (n
// non-decreasing), several rows at a time sharing each key load (score_some).
template <typename T>
inline void score_group(const float* const* queries, const T* const* keys, const int64_t* n, int64_t rows, int64_t D,
                        float scale, float* const* weights) {
  for (int64_t r = 0; r < rows;) {
    const int64_t done = score_some(queries + r, keys, n + r, rows - r, D, scale, weights + r);
    if (done > 0) {
      r += done;
      continue;
    }
    if constexpr (std::is_same_v<T, float>)  // rows_direct() sends other rows of these sizes only
      for (int64_t p = 0; p < n[r]; ++p) weights[r][p] = ops::dot(queries[r], keys[p], D) * scale;
    ++r;
  }
}

// The rows of one work item: queries[r] scored against the first seen_by[r] key rows, several
// rows at a time sharing each key load (score_group), softmax, then weighing the value rows in
// groups that share each value load (weigh_group_any), into outs[r]. `weights`: each row's
// scratch for its scores; `factors`: the rows' scales of a scaled cache.
template <typename T>
inline void attend_rows(const float* const* queries, const T* const* keys, const T* const* values,
                        const int64_t* seen_by, float* const* weights, float* const* outs, int64_t rows, int64_t D,
                        float scale, RowScales factors) {
  score_group(queries, keys, seen_by, rows, D, scale, weights);
  scale_weights(weights, seen_by, rows, factors.keys);
  for (int64_t r = 0; r < rows; ++r) ops::softmax(weights[r], seen_by[r]);
  scale_weights(weights, seen_by, rows, factors.values);
  weigh_group_any(weights, values, seen_by, D, outs, static_cast<int>(rows));
}

// attend_rows for the keys of one segment of long rows: queries[r] against keys[0..counts[r])
// (counts non-decreasing, >= 1), leaving in parts[r] the scores' max, the sum of exp(score -
// max) and, from parts[r] + 2, the unnormalized sum of exp(score - max) * value (D floats).
template <typename T>
inline void attend_segment(const float* const* queries, const T* const* keys, const T* const* values,
                           const int64_t* counts, float* const* weights, float* const* parts, int64_t rows,
                           int64_t D, float scale, RowScales factors) {
  score_group(queries, keys, counts, rows, D, scale, weights);
  scale_weights(weights, counts, rows, factors.keys);
  std::vector<float*> sums(rows);
  for (int64_t r = 0; r < rows; ++r) {
    parts[r][1] = ops::exp_shifted(weights[r], counts[r], parts[r]);
    sums[r] = parts[r] + 2;
  }
  scale_weights(weights, counts, rows, factors.values);
  weigh_group_any(weights, values, counts, D, sums.data(), static_cast<int>(rows));
}

// out[0..D) = a row's attention from its n segments' parts (attend_segment's layout), merged
// in segment order.
inline void merge_segments(const float* const* parts, int64_t n, int64_t D, float* out) {
  float m = parts[0][0];
  for (int64_t c = 1; c < n; ++c) m = std::max(m, parts[c][0]);
  float total = 0.0f;
  std::fill(out, out + D, 0.0f);
  for (int64_t c = 0; c < n; ++c) {
    const float a = std::exp(parts[c][0] - m);
    total += a * parts[c][1];
    for (int64_t d = 0; d < D; ++d) out[d] += a * parts[c][2 + d];
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

}  // namespace expresslane
