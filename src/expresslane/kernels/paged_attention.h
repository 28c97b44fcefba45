// Attention over the paged KV cache (paged_kv.h), read in place (plain, FP8 or FP4 blocks):
// used by the native step (layer_stack_cpu.cpp) and, as `decode_attention`, by the Python layers'
// decodes.
// Tested against models/attention.py's gather + matmul path.
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common.h"
#include "constants.h"
#include "decode_ops.h"
#include "paged_kv.h"

namespace expresslane {

// q . k for every key row in `keys` (n of them), times `scale`, into s[0..n) (AVX2). Each
// score is bit-identical to ops::dot(q, k, D) * scale; the query rows stay in registers across
// the keys (D = 32 / 64: the demo pair's head sizes, and common ones), which halves the loads.
template <int D>
inline void score_rows(const float* q, const float* const* keys, int64_t n, float scale, float* s) {
  __m256 qv[D / 8];
  for (int i = 0; i < D / 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  for (int64_t p = 0; p < n; ++p) {
    const float* k = keys[p];
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int i = 0; i + 16 <= D; i += 16) {  // ops::dot's two chains, in its order
      s0 = _mm256_fmadd_ps(qv[i / 8], _mm256_loadu_ps(k + i), s0);
      s1 = _mm256_fmadd_ps(qv[i / 8 + 1], _mm256_loadu_ps(k + i + 8), s1);
    }
    s[p] = hsum(_mm256_add_ps(s0, s1)) * scale;
  }
}

// out[0..D) = sum over p < n of w[p] * values[p], accumulated in p order (bit-identical to
// repeated ops::axpy), the accumulator in registers.
template <int D>
inline void weigh_rows(const float* w, const float* const* values, int64_t n, float* out) {
  __m256 acc[D / 8];
  for (int i = 0; i < D / 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    const __m256 wv = _mm256_set1_ps(w[p]);
    for (int i = 0; i < D / 8; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(values[p] + 8 * i), acc[i]);
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

template <int D>
inline void score_rows512(const float* q, const float* const* keys, int64_t n, float scale, float* s) {
  __m512 qv[D / 16];
  for (int i = 0; i < D / 16; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - p0));
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= m) continue;
      const float* k = keys[p0 + j];
      for (int i = 0; i < D / 16; ++i) acc[j] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), acc[j]);
    }
    _mm512_mask_storeu_ps(s + p0, static_cast<__mmask16>((1u << m) - 1), _mm512_mul_ps(sum16(acc), sc));
  }
}

// score_rows512 for two query rows over the same keys, row a over the first na, row b over the
// first nb >= na (a verification's queries: the next one sees one key more). Each key load
// feeds both rows (one row's loop is bound by the loads), 8 keys per row at a time: the 16
// partial vectors go through sum16 together, so every score takes score_rows512's chain and
// reduction tree and is bit-identical to it.
template <int D>
inline void score_pair512(const float* qa, const float* qb, const float* const* keys, int64_t na, int64_t nb,
                          float scale, float* sa, float* sb) {
  __m512 qva[D / 16], qvb[D / 16];
  for (int i = 0; i < D / 16; ++i) {
    qva[i] = _mm512_loadu_ps(qa + 16 * i);
    qvb[i] = _mm512_loadu_ps(qb + 16 * i);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < nb; p0 += 8) {
    const int m = static_cast<int>(std::min<int64_t>(8, nb - p0));
    __m512 acc[16];
    for (int j = 0; j < 8; ++j) {
      acc[j] = acc[j + 8] = _mm512_setzero_ps();
      if (j >= m) continue;
      const float* k = keys[p0 + j];
      for (int i = 0; i < D / 16; ++i) {
        const __m512 kv = _mm512_loadu_ps(k + 16 * i);
        acc[j] = _mm512_fmadd_ps(qva[i], kv, acc[j]);
        acc[j + 8] = _mm512_fmadd_ps(qvb[i], kv, acc[j + 8]);
      }
    }
    const __m512 s = _mm512_mul_ps(sum16(acc), sc);
    const int ma = static_cast<int>(std::clamp<int64_t>(na - p0, 0, 8));
    _mm256_mask_storeu_ps(sa + p0, static_cast<__mmask8>((1u << ma) - 1), _mm512_castps512_ps256(s));
    _mm256_mask_storeu_ps(sb + p0, static_cast<__mmask8>((1u << m) - 1), _mm512_extractf32x8_ps(s, 1));
  }
}

// out[r][0..D) += sum over p0 <= p < p1 of w[r][p] * values[p] for R rows at once (one load
// of each value row), accumulated in p order; `resume`: out holds the sums over p < p0, else
// they start at zero. Each output is the same chain of operations as if computed alone.
template <int D, int R>
inline void weigh_rows512(const float* const* w, const float* const* values, int64_t p0, int64_t p1,
                          float* const* out, bool resume) {
  __m512 acc[R][D / 16];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D / 16; ++i) acc[r][i] = resume ? _mm512_loadu_ps(out[r] + 16 * i) : _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512 v[D / 16];
    for (int i = 0; i < D / 16; ++i) v[i] = _mm512_loadu_ps(values[p] + 16 * i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r][p]);
      for (int i = 0; i < D / 16; ++i) acc[r][i] = _mm512_fmadd_ps(wv, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(out[r] + 16 * i, acc[r][i]);
}

// Rows in groups of up to R (R * D / 16 accumulators: 16 registers at most), 4 rows giving 16
// independent chains (one row's 4 were bound by the FMA latency). n[r]: the keys row r sees,
// non-decreasing (a verification's later queries see more): a group weighs the keys its first
// row sees together, then each row its own remaining ones.
template <int D>
inline void weigh_group512(const float* const* w, const float* const* values, const int64_t* n, float* const* out,
                           int rows) {
  constexpr int R = D <= 64 ? 4 : 2;
  for (int r0 = 0; r0 < rows; r0 += R) {
    const int m = std::min(R, rows - r0);
    const int64_t shared = n[r0];
    switch (m) {
      case 1: weigh_rows512<D, 1>(w + r0, values, 0, shared, out + r0, false); break;
      case 2: weigh_rows512<D, 2>(w + r0, values, 0, shared, out + r0, false); break;
      case 3: if constexpr (R >= 3) weigh_rows512<D, 3>(w + r0, values, 0, shared, out + r0, false); break;
      default: if constexpr (R >= 4) weigh_rows512<D, 4>(w + r0, values, 0, shared, out + r0, false); break;
    }
    for (int r = r0; r < r0 + m; ++r)
      if (n[r] > shared) weigh_rows512<D, 1>(w + r, values, shared, n[r], out + r, true);
  }
}
#endif

inline void score_rows_any(const float* q, const float* const* keys, int64_t n, int64_t D, float scale, float* s) {
#ifdef __AVX512F__
  if (D == 64) return score_rows512<64>(q, keys, n, scale, s);
  if (D == 128) return score_rows512<128>(q, keys, n, scale, s);
  if (D == 32) return score_rows512<32>(q, keys, n, scale, s);
#endif
  if (D == 64) return score_rows<64>(q, keys, n, scale, s);
  if (D == 32) return score_rows<32>(q, keys, n, scale, s);
  for (int64_t p = 0; p < n; ++p) s[p] = ops::dot(q, keys[p], D) * scale;
}

// score_rows_any for rows a and b (nb >= na keys), sharing the key loads where a kernel does.
inline void score_pair_any(const float* qa, const float* qb, const float* const* keys, int64_t na, int64_t nb,
                           int64_t D, float scale, float* sa, float* sb) {
#ifdef __AVX512F__
  if (D == 64) return score_pair512<64>(qa, qb, keys, na, nb, scale, sa, sb);
  if (D == 32) return score_pair512<32>(qa, qb, keys, na, nb, scale, sa, sb);
#endif
  score_rows_any(qa, keys, na, D, scale, sa);
  score_rows_any(qb, keys, nb, D, scale, sb);
}

inline void weigh_rows_any(const float* w, const float* const* values, int64_t n, int64_t D, float* out) {
  if (D == 64) return weigh_rows<64>(w, values, n, out);
  if (D == 32) return weigh_rows<32>(w, values, n, out);
  std::fill(out, out + D, 0.0f);
  for (int64_t p = 0; p < n; ++p) ops::axpy(w[p], values[p], out, D);
}

// weigh_rows for `rows` outputs over the same value rows, row r over the first n[r] of them
// (n non-decreasing).
inline void weigh_group_any(const float* const* w, const float* const* values, const int64_t* n, int64_t D,
                            float* const* out, int rows) {
#ifdef __AVX512F__
  if (D == 64) return weigh_group512<64>(w, values, n, out, rows);
  if (D == 128) return weigh_group512<128>(w, values, n, out, rows);
  if (D == 32) return weigh_group512<32>(w, values, n, out, rows);
#endif
  for (int r = 0; r < rows; ++r) weigh_rows_any(w[r], values, n[r], D, out[r]);
}

// Attention over the paged cache, read in place, for B sequences with q_lens[b] new tokens
// each (1 for a decode, k+1 for a speculative verification, a prompt chunk's length), their
// rows consecutive from rows[b] on in q ([T, H, D], rows `q_stride` floats apart) and out
// ([T, H*D]); slots:
// [B*L] the slots of positions 0..L-1 of each sequence (padded); query j of sequence b sees
// positions 0..starts[b]+j. The work is split into (sequence, kv head, up to kBlock query
// positions) items, each run by one thread: the G query heads of those positions are scored
// two rows at a time against the key rows they see, the queries in registers and each key
// load shared (score_pair_any), then softmax, then the rows weigh the value rows in groups
// that share each value load (weigh_group_any). Compressed caches are expanded once per item.
// A row's result depends only on its query and the keys and values it sees, never on the
// rows it shares an item with: a prompt's last token attends bit-identically whether it
// comes in a chunk, a verification or a decode step.
inline void paged_attention(const PagedKV& c, int64_t H, const float* q, int64_t q_stride, float* out, int64_t B,
                            const int64_t* rows, const int64_t* q_lens, int64_t L, const int64_t* slots,
                            const int64_t* starts) {
  constexpr int64_t kBlock = 16;  // query positions per item (a verification's k+1 fit in one)
  const int64_t Hkv = c.Hkv, D = c.D, G = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  struct Item {
    int64_t b, row, j0, j1;  // sequence, its first row in q, positions j0..j1-1 of its step
  };
  std::vector<Item> items;
  int64_t work = 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j0 = 0; j0 < q_lens[b]; j0 += kBlock) {
      items.push_back({b, rows[b], j0, std::min(q_lens[b], j0 + kBlock)});
      work += (starts[b] + j0 + kBlock) * kBlock * G * D;
    }
  const int64_t n = static_cast<int64_t>(items.size()) * Hkv;
  const int64_t grain = std::max<int64_t>(1, 65536 * n / work);
  at::parallel_for(0, n, grain, [&](int64_t p0, int64_t p1) {
    const int64_t max_rows = kBlock * G;
    // Uninitialized: every score and expanded row is written before it is read, and zeroing
    // them cost a memset of ~1-3 MB per layer per thread at a 4k context.
    const std::unique_ptr<float[]> scores(new float[max_rows * L]);
    const std::unique_ptr<float[]> expanded(c.kind == KVKind::kPlain ? nullptr : new float[2 * L * D]);
    std::vector<const float*> keys(L), values(L), queries(max_rows);
    std::vector<float*> weights(max_rows), outs(max_rows);
    std::vector<int64_t> seen_by(max_rows);
    for (int64_t p = p0; p < p1; ++p) {
      const Item& it = items[p / Hkv];
      const int64_t b = it.b, h = p % Hkv, rows = (it.j1 - it.j0) * G;
      const int64_t* seq = slots + b * L;
      const int64_t seen = std::min(L, starts[b] + it.j1);  // positions any query here sees
      for (int64_t pos = 0; pos < seen; ++pos) {
        float* kbuf = c.kind == KVKind::kPlain ? nullptr : expanded.get() + pos * D;
        float* vbuf = c.kind == KVKind::kPlain ? nullptr : expanded.get() + (L + pos) * D;
        keys[pos] = c.row(0, h, seq[pos], kbuf);
        values[pos] = c.row(1, h, seq[pos], vbuf);
      }
      for (int64_t j = it.j0; j < it.j1; ++j) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (j - it.j0) * G + g, t = it.row + j;
          queries[r] = q + t * q_stride + (h * G + g) * D;
          weights[r] = scores.get() + r * L;
          seen_by[r] = std::min(seen, starts[b] + j + 1);
          outs[r] = out + t * H * D + (h * G + g) * D;
        }
      }
      for (int64_t r = 0; r < rows; r += 2) {
        if (r + 1 < rows)
          score_pair_any(queries[r], queries[r + 1], keys.data(), seen_by[r], seen_by[r + 1], D, scale, weights[r],
                         weights[r + 1]);
        else
          score_rows_any(queries[r], keys.data(), seen_by[r], D, scale, weights[r]);
      }
      for (int64_t r = 0; r < rows; ++r) ops::softmax(weights[r], seen_by[r]);
      weigh_group_any(weights.data(), values.data(), seen_by.data(), D, outs.data(), static_cast<int>(rows));
    }
  });
}

}  // namespace expresslane
