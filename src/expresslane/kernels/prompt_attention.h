// Attention of prompt chunks over the paged KV cache (paged_kv.h), tiled (flash-style);
// paged_attention.h serves every decode.
//
// paged_attention scores each query row against each key it sees, one or two rows per key
// load: right for decodes, compute-starved for prompts, whose rows all read the same keys. Here
// a work item is (sequence, kv head, tile of up to kTileRows query rows: positions times the
// G query heads of that kv head) and walks the keys in blocks of kKeyBlock positions: the
// scores of the whole tile by a register-blocked kernel (query rows in vector lanes, each key
// value broadcast), the online softmax (a running max and sum per row), then probabilities
// times values into the tile's accumulator (the micro-kernels: prompt_tiles.h).
//
// Rows in lanes keep each row's arithmetic its own: a score is a sum over d in order, key
// blocks start at multiples of kKeyBlock whatever the chunk, and keys a row does not see add
// exact zeros. A row's result depends on its query and the keys and values it sees, not on
// the rows beside it nor on how the prompt was cut into chunks (tests/test_prompt_attention.py).
// It differs from paged_attention's in the last bits (the order of its sums).
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include <c10/util/BFloat16.h>

#include "paged_kv.h"
#include "prompt_tiles.h"

namespace expresslane {

constexpr int64_t kKeyBlock = 32;  // keys per block, aligned to absolute positions
constexpr int64_t kTileRows = 64;  // query rows per work item (positions x G)

// The keys and values one (sequence, kv head) attends to, as the bf16 products read them:
// keys [n][D] bf16 (a row's values 2i, 2i+1 in one 32-bit pair), values [ceil(n/2)][D]
// pairs of positions 2m, 2m+1 (the second zero past the end).
struct Bf16Rows {
  std::vector<uint16_t> keys;
  std::vector<uint32_t> values;

  void fill(const PagedKV& c, int64_t h, const int64_t* seq, int64_t n) {
#ifdef __AVX512BF16__
    const int64_t D = c.D;
    keys.resize(n * D);
    values.resize((n + 1) / 2 * D);
    std::vector<float> buf(3 * D);
    std::fill(buf.begin() + 2 * D, buf.end(), 0.0f);  // the value row past the end
    for (int64_t pos = 0; pos < n; ++pos) {
      const float* k = c.row(0, h, seq[pos], buf.data());
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys.data() + pos * D + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(k + d)));
    }
    for (int64_t m = 0; m < (n + 1) / 2; ++m) {
      const float* v0 = c.row(1, h, seq[2 * m], buf.data());
      const float* v1 = 2 * m + 1 < n ? c.row(1, h, seq[2 * m + 1], buf.data() + D) : buf.data() + 2 * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_si512(values.data() + m * D + d, bf16_pairs(_mm512_loadu_ps(v0 + d), _mm512_loadu_ps(v1 + d)));
    }
#endif
  }
};

// One tile's state: its queries (scaled) and accumulator transposed, rows in lanes.
struct PromptTile {
  int64_t rows = 0, stride = 0, D = 0;  // real rows, rows padded to 16, head dim
  std::vector<float> qt, ot, s, m, l, alpha;  // [D][stride], [D][stride], [kKeyBlock][stride], 3 x [stride]
  std::vector<uint32_t> qt16, p16;  // bf16 products: [D/2][stride] query pairs, [kKeyBlock/2][stride]
  std::vector<int32_t> pos;  // [stride] each row's position (padding: the last row's)

  void reset(int64_t n, int64_t head_dim, bool bf16) {
    rows = n;
    D = head_dim;
    stride = (n + 15) / 16 * 16;
    qt.assign(bf16 ? 0 : D * stride, 0.0f);
    qt16.assign(bf16 ? D / 2 * stride : 0, 0u);
    p16.resize(bf16 ? kKeyBlock / 2 * stride : 0);
    ot.assign(D * stride, 0.0f);
    s.resize(kKeyBlock * stride);
    m.assign(stride, -INFINITY);
    l.assign(stride, 0.0f);
    alpha.resize(stride);
    pos.resize(stride);
  }

  // Row r's query, times `scale`, into the layout the scores read.
  void set_query(int64_t r, const float* q, float scale) {
    if (qt16.empty()) {
      for (int64_t d = 0; d < D; ++d) qt[d * stride + r] = q[d] * scale;
      return;
    }
    for (int64_t i = 0; i < D / 2; ++i) {
      const uint32_t lo = c10::BFloat16(q[2 * i] * scale).x, hi = c10::BFloat16(q[2 * i + 1] * scale).x;
      qt16[i * stride + r] = lo | (hi << 16);
    }
  }

  // The online softmax over keys kb..kb+nk-1 for the rows of vector v: masks the keys past each
  // row's position, updates its max and sum, leaves probabilities in s and the rescale of
  // the earlier sums in alpha.
  void softmax_block(int64_t v, int64_t kb, int64_t nk) {
    const int64_t o = 16 * v;
    const I16 at = vpositions(pos.data() + o);
    const F16 m_old = vload(m.data() + o);
    F16 m_new = m_old;
    for (int64_t j = 0; j < nk; ++j) {
      const int32_t key = static_cast<int32_t>(kb + j);
      m_new = vmax(m_new, vseen(at, key, vload(s.data() + j * stride + o), vset(-INFINITY)));
    }
    const F16 a = exp16(vsub(m_old, m_new));
    F16 sum = vmul(vload(l.data() + o), a);
    for (int64_t j = 0; j < nk; ++j) {
      float* sj = s.data() + j * stride + o;
      const F16 pj = vseen(at, static_cast<int32_t>(kb + j), exp16(vsub(vload(sj), m_new)), vset(0.0f));
      sum = vadd(sum, pj);
      vstore(sj, pj);
    }
    vstore(m.data() + o, m_new);
    vstore(l.data() + o, sum);
    vstore(alpha.data() + o, a);
  }

  // Scores, softmax and weighing for one block of nk keys starting at position kb.
  // (Two vectors of rows at a time where kPairedVectors, then one.)
  void attend(const float* const* keys, const float* const* values, int64_t kb, int64_t nk) {
    int64_t r0 = 0;
    if constexpr (kPairedVectors)
      for (; r0 + 32 <= stride; r0 += 32) score_block<2>(qt.data() + r0, stride, D, keys, nk, s.data() + r0);
    for (; r0 < stride; r0 += 16) score_block<1>(qt.data() + r0, stride, D, keys, nk, s.data() + r0);
    for (int64_t v = 0; v < stride / 16; ++v) softmax_block(v, kb, nk);
    for (int64_t d0 = 0; d0 < D; d0 += 4) {
      r0 = 0;
      if constexpr (kPairedVectors)
        for (; r0 + 32 <= stride; r0 += 32)
          weigh_block<2>(s.data() + r0, stride, values, nk, d0, alpha.data() + r0, ot.data() + r0);
      for (; r0 < stride; r0 += 16)
        weigh_block<1>(s.data() + r0, stride, values, nk, d0, alpha.data() + r0, ot.data() + r0);
    }
  }

  // attend, with bf16 products: the keys and values of positions kb..kb+nk-1 of `kv`.
  void attend_bf16(const Bf16Rows& kv, int64_t kb, int64_t nk) {
#ifdef __AVX512BF16__
    const uint32_t* keys[kKeyBlock];
    const uint32_t* values[kKeyBlock / 2];
    for (int64_t j = 0; j < nk; ++j) keys[j] = reinterpret_cast<const uint32_t*>(kv.keys.data() + (kb + j) * D);
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t m = 0; m < pairs; ++m) values[m] = kv.values.data() + (kb / 2 + m) * D;
    int64_t r0 = 0;
    for (; r0 + 32 <= stride; r0 += 32) score_block<2>(qt16.data() + r0, stride, D / 2, keys, nk, s.data() + r0);
    if (r0 < stride) score_block<1>(qt16.data() + r0, stride, D / 2, keys, nk, s.data() + r0);
    for (int64_t v = 0; v < stride / 16; ++v) softmax_block(v, kb, nk);
    for (int64_t i = 0; i < pairs; ++i)  // a last odd key pairs with a zero probability
      for (int64_t o = 0; o < stride; o += 16) {
        const __m512 p1 = 2 * i + 1 < nk ? _mm512_loadu_ps(s.data() + (2 * i + 1) * stride + o) : _mm512_setzero_ps();
        const __m512 p0 = _mm512_loadu_ps(s.data() + 2 * i * stride + o);
        _mm512_storeu_si512(p16.data() + i * stride + o, bf16_pairs(p0, p1));
      }
    for (int64_t d0 = 0; d0 < D; d0 += 4) {
      for (r0 = 0; r0 + 32 <= stride; r0 += 32)
        weigh_block<2>(p16.data() + r0, stride, values, pairs, d0, alpha.data() + r0, ot.data() + r0);
      if (r0 < stride) weigh_block<1>(p16.data() + r0, stride, values, pairs, d0, alpha.data() + r0, ot.data() + r0);
    }
#endif
  }
};

struct PromptItem {
  int64_t b, row, j0, j1, h, work;  // sequence, its first row, positions j0..j1-1, kv head
};

// The work items of B sequences, heaviest first: tiles of up to kTileRows rows per kv head.
inline std::vector<PromptItem> prompt_items(int64_t B, int64_t Hkv, int64_t G, const int64_t* rows,
                                            const int64_t* q_lens, const int64_t* starts) {
  const int64_t positions = std::max<int64_t>(1, kTileRows / G);
  std::vector<PromptItem> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j0 = 0; j0 < q_lens[b]; j0 += positions)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t j1 = std::min(q_lens[b], j0 + positions);
        items.push_back({b, rows[b], j0, j1, h, (starts[b] + j1) * (j1 - j0)});
      }
  std::sort(items.begin(), items.end(), [](const PromptItem& a, const PromptItem& b) { return a.work > b.work; });
  return items;
}

// Attention for B prompt chunks (paged_attention's arguments: sequence b's q_lens[b] rows
// from rows[b] on, q rows `q_stride` floats apart, out [T, H*D], slots [B*L], its query j at
// position starts[b]+j); `bf16`: the products of bf16-rounded queries, keys, probabilities
// and values, summed in float32 (where kBf16Products). Work items run heaviest first, each
// thread taking the next one free (the tiles of a causal prompt differ in work up to the
// prompt's length).
inline void prompt_attention(const PagedKV& c, int64_t H, const float* q, int64_t q_stride, float* out, int64_t B,
                             const int64_t* rows, const int64_t* q_lens, int64_t L, const int64_t* slots,
                             const int64_t* starts, bool bf16) {
  const int64_t Hkv = c.Hkv, D = c.D, G = H / Hkv;
  bf16 = bf16 && kBf16Products;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::vector<PromptItem> items = prompt_items(B, Hkv, G, rows, q_lens, starts);
  std::vector<Bf16Rows> prepared(bf16 ? B * Hkv : 0);
  at::parallel_for(0, static_cast<int64_t>(prepared.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hkv;
      if (q_lens[b] > 0) prepared[p].fill(c, p % Hkv, slots + b * L, starts[b] + q_lens[b]);
    }
  });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    PromptTile tile;
    const bool plain = c.kind == KVKind::kPlain;
    std::vector<float> expanded(plain ? 0 : 2 * kKeyBlock * D);
    const float* keys[kKeyBlock];
    const float* values[kKeyBlock];
    for (int64_t i = next++; i < n; i = next++) {
      const PromptItem& it = items[i];
      const int64_t* seq = slots + it.b * L;
      tile.reset((it.j1 - it.j0) * G, D, bf16);
      for (int64_t r = 0; r < tile.stride; ++r) {
        const int64_t real = std::min(r, tile.rows - 1), j = it.j0 + real / G, g = real % G;
        tile.pos[r] = static_cast<int32_t>(starts[it.b] + j);
        if (r == real) tile.set_query(r, q + (it.row + j) * q_stride + (it.h * G + g) * D, scale);
      }
      const int64_t last = starts[it.b] + it.j1 - 1;  // the last position any row sees
      for (int64_t kb = 0; kb <= last; kb += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, last + 1 - kb);
        if (bf16) {
          tile.attend_bf16(prepared[it.b * Hkv + it.h], kb, nk);
          continue;
        }
        for (int64_t j = 0; j < nk; ++j) {
          float* buf = plain ? nullptr : expanded.data() + 2 * j * D;
          keys[j] = c.row(0, it.h, seq[kb + j], buf);
          values[j] = c.row(1, it.h, seq[kb + j], plain ? nullptr : buf + D);
        }
        tile.attend(keys, values, kb, nk);
      }
      for (int64_t r = 0; r < tile.rows; ++r) {
        float* o = out + (it.row + it.j0 + r / G) * H * D + (it.h * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = tile.ot[d * tile.stride + r] / tile.l[r];
      }
    }
  });
}
}  // namespace expresslane
