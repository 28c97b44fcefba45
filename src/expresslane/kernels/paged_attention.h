// Attention over the paged KV cache (paged_kv.h), read in place (plain, bf16, FP8 or FP4 blocks):
// used by the native step (layer_stack_cpu.cpp) and, as `decode_attention`, by the Python layers'
// decodes.
// Tested against models/attention.py's gather + matmul path.
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "common.h"
#include "constants.h"
#include "decode_ops.h"
#include "paged_kv.h"

namespace expresslane {

// A key or value row's next 8 (16) values as float32: in place from a float32 cache, widened
// from a bf16 one (the same floats the bf16 store's reads give).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load_bf16x8(p); }
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
#endif

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

template <int D, typename T>
inline void score_rows512(const float* q, const T* const* keys, int64_t n, float scale, float* s) {
  __m512 qv[D / 16];
  for (int i = 0; i < D / 16; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - p0));
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= m) continue;
      const T* k = keys[p0 + j];
      for (int i = 0; i < D / 16; ++i) acc[j] = _mm512_fmadd_ps(qv[i], load16(k + 16 * i), acc[j]);
    }
    _mm512_mask_storeu_ps(s + p0, static_cast<__mmask16>((1u << m) - 1), _mm512_mul_ps(sum16(acc), sc));
  }
}

// score_rows512 for two query rows over the same keys, row a over the first na, row b over the
// first nb >= na (a verification's queries: the next one sees one key more). Each key load
// feeds both rows (one row's loop is bound by the loads), 8 keys per row at a time: the 16
// partial vectors go through sum16 together, so every score takes score_rows512's chain and
// reduction tree and is bit-identical to it.
template <int D, typename T>
inline void score_pair512(const float* qa, const float* qb, const T* const* keys, int64_t na, int64_t nb,
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
      const T* k = keys[p0 + j];
      for (int i = 0; i < D / 16; ++i) {
        const __m512 kv = load16(k + 16 * i);
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

// Rows in groups of up to R (R * D / 16 accumulators: 16 registers at most), 4 rows giving 16
// independent chains (one row's 4 were bound by the FMA latency). n[r]: the keys row r sees,
// non-decreasing (a verification's later queries see more): a group weighs the keys its first
// row sees together, then each row its own remaining ones.
template <int D, typename T>
inline void weigh_group512(const float* const* w, const T* const* values, const int64_t* n, float* const* out,
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

template <typename T>
inline void score_rows_any(const float* q, const T* const* keys, int64_t n, int64_t D, float scale, float* s) {
#ifdef __AVX512F__
  if (D == 64) return score_rows512<64>(q, keys, n, scale, s);
  if (D == 128) return score_rows512<128>(q, keys, n, scale, s);
  if (D == 32) return score_rows512<32>(q, keys, n, scale, s);
#endif
  if (D == 64) return score_rows<64>(q, keys, n, scale, s);
  if (D == 32) return score_rows<32>(q, keys, n, scale, s);
  if constexpr (std::is_same_v<T, float>)  // rows_direct() sends bf16 rows of these sizes only
    for (int64_t p = 0; p < n; ++p) s[p] = ops::dot(q, keys[p], D) * scale;
}

// score_rows_any for rows a and b (nb >= na keys), sharing the key loads where a kernel does.
template <typename T>
inline void score_pair_any(const float* qa, const float* qb, const T* const* keys, int64_t na, int64_t nb,
                           int64_t D, float scale, float* sa, float* sb) {
#ifdef __AVX512F__
  if (D == 64) return score_pair512<64>(qa, qb, keys, na, nb, scale, sa, sb);
  if (D == 32) return score_pair512<32>(qa, qb, keys, na, nb, scale, sa, sb);
#endif
  score_rows_any(qa, keys, na, D, scale, sa);
  score_rows_any(qb, keys, nb, D, scale, sb);
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

// The rows of one work item: queries[r] scored against the first seen_by[r] key rows, two rows
// at a time sharing each key load (score_pair_any), softmax, then weighing the value rows in
// groups that share each value load (weigh_group_any), into outs[r]. `weights`: each row's
// scratch for its scores.
template <typename T>
inline void attend_rows(const float* const* queries, const T* const* keys, const T* const* values,
                        const int64_t* seen_by, float* const* weights, float* const* outs, int64_t rows, int64_t D,
                        float scale) {
  for (int64_t r = 0; r < rows; r += 2) {
    if (r + 1 < rows)
      score_pair_any(queries[r], queries[r + 1], keys, seen_by[r], seen_by[r + 1], D, scale, weights[r],
                     weights[r + 1]);
    else
      score_rows_any(queries[r], keys, seen_by[r], D, scale, weights[r]);
  }
  for (int64_t r = 0; r < rows; ++r) ops::softmax(weights[r], seen_by[r]);
  weigh_group_any(weights, values, seen_by, D, outs, static_cast<int>(rows));
}

// Whether rows of this cache are read where they lie: float32 rows, and bf16 rows of the
// head sizes the kernels widen in registers. Other caches are expanded into a buffer first.
inline bool rows_direct(const PagedKV& c) {
  if (c.kind == KVKind::kPlain) return true;
#ifdef __AVX512F__
  if (c.kind == KVKind::kBf16 && c.D == 128) return true;
#endif
  return c.kind == KVKind::kBf16 && (c.D == 32 || c.D == 64);
}

// keys/values[pos] = the key and value rows of positions 0..seen-1 of kv head h as float32: in
// place for a float32 cache, else expanded into kbuf/vbuf (D floats a row). Kept out of line:
// inlined into paged_attention's loop, an FP8 decode's attention at a 4k context took 770
// against 490 us.
__attribute__((noinline)) inline void float_rows(const PagedKV& c, int64_t h, const int64_t* seq, int64_t seen,
                                                 float* kbuf, float* vbuf, const float** keys, const float** values) {
  const bool plain = c.kind == KVKind::kPlain;
  for (int64_t pos = 0; pos < seen; ++pos) {
    keys[pos] = c.row(0, h, seq[pos], plain ? nullptr : kbuf + pos * c.D);
    values[pos] = c.row(1, h, seq[pos], plain ? nullptr : vbuf + pos * c.D);
  }
}

// Attention over the paged cache, read in place, for B sequences with q_lens[b] new tokens
// each (1 for a decode, k+1 for a speculative verification, a prompt chunk's length), their
// rows consecutive from rows[b] on in q ([T, H, D], rows `q_stride` floats apart) and out
// ([T, H*D]); slots: [B*L] the slots of positions 0..L-1 of each sequence (padded); query j of
// sequence b sees positions 0..starts[b]+j. The work is split into (sequence, kv head, up to
// kBlock query positions) items, each run by one thread over the G query heads of those
// positions (attend_rows). Float32 and bf16 rows are read in place (half the bytes for bf16),
// compressed ones expanded once per item. A row's result depends only on its query and the
// keys and values it sees, never on the rows it shares an item with: a prompt's last token
// attends bit-identically whether it comes in a chunk, a verification or a decode step.
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
  const bool direct = rows_direct(c), bf16 = c.kind == KVKind::kBf16;
  at::parallel_for(0, n, grain, [&](int64_t p0, int64_t p1) {
    const int64_t max_rows = kBlock * G;
    // Uninitialized: every score and expanded row is written before it is read, and zeroing
    // them cost a memset of ~1-3 MB per layer per thread at a 4k context.
    const std::unique_ptr<float[]> scores(new float[max_rows * L]);
    const std::unique_ptr<float[]> expanded(direct ? nullptr : new float[2 * L * D]);
    std::vector<const float*> keys(L), values(L), queries(max_rows);
    std::vector<const uint16_t*> keys16(bf16 ? L : 0), values16(bf16 ? L : 0);
    std::vector<float*> weights(max_rows), outs(max_rows);
    std::vector<int64_t> seen_by(max_rows);
    for (int64_t p = p0; p < p1; ++p) {
      const Item& it = items[p / Hkv];
      const int64_t b = it.b, h = p % Hkv, rows = (it.j1 - it.j0) * G;
      const int64_t* seq = slots + b * L;
      const int64_t seen = std::min(L, starts[b] + it.j1);  // positions any query here sees
      for (int64_t j = it.j0; j < it.j1; ++j) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (j - it.j0) * G + g, t = it.row + j;
          queries[r] = q + t * q_stride + (h * G + g) * D;
          weights[r] = scores.get() + r * L;
          seen_by[r] = std::min(seen, starts[b] + j + 1);
          outs[r] = out + t * H * D + (h * G + g) * D;
        }
      }
      if (direct && bf16) {
        for (int64_t pos = 0; pos < seen; ++pos) {
          keys16[pos] = c.bf16_row(0, h, seq[pos]);
          values16[pos] = c.bf16_row(1, h, seq[pos]);
        }
        attend_rows(queries.data(), keys16.data(), values16.data(), seen_by.data(), weights.data(), outs.data(), rows,
                    D, scale);
        continue;
      }
      float_rows(c, h, seq, seen, expanded.get(), expanded.get() + L * D, keys.data(), values.data());
      attend_rows(queries.data(), keys.data(), values.data(), seen_by.data(), weights.data(), outs.data(), rows, D,
                  scale);
    }
  });
}

}  // namespace expresslane
