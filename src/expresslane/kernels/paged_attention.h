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

#include "attention_rows.h"
#include "common.h"
#include "constants.h"
#include "decode_ops.h"
#include "paged_kv.h"

namespace expresslane {

// Whether rows of this cache are read where they lie: float32 rows, and bf16 and FP8 rows of
// the head sizes the kernels widen in registers. Other caches are expanded into a buffer first.
inline bool rows_direct(const PagedKV& c) {
  if (c.kind == KVKind::kPlain) return true;
  if (c.kind != KVKind::kBf16 && c.kind != KVKind::kFp8) return false;
#ifdef __AVX512F__
  if (c.D == 128) return true;
#endif
  return c.D == 32 || c.D == 64;
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

// Rows that see more than segment_length(c) positions attend in segments of that many positions
// at fixed absolute boundaries, each segment a work unit of its own (one long sequence's decode
// spreads over the threads: a 4k-context decode of SmolLM2-135M's 3 KV heads on 2 threads took
// 1.2x less), then merge them in segment order (attention_rows.h). Whether and where a row is
// split depends only on how many keys it sees and the cache's kind. FP4 rows are widened into
// a buffer a segment at a time: shorter segments keep it near the core (and balance the
// threads from shorter contexts on).
inline int64_t segment_length(const PagedKV& c) { return c.kind == KVKind::kFp4 ? 256 : 1024; }

inline int64_t segments_of(int64_t seen, int64_t seg) { return seen > seg ? (seen + seg - 1) / seg : 1; }

// Up to kBlock consecutive query positions of one sequence, attended by one thread per KV head
// (and key segment).
struct AttentionItem {
  int64_t b, row, j0, j1;   // sequence, its first row in q, positions j0..j1-1 of its step
  int64_t segments, parts;  // key segments of its last row; its first part in the parts buffer
};

// Each split row's segments (attend_segment's parts, [Hkv][segments][rows][D + 2] per item
// from item.parts on) merged into its output row, an (item, KV head) at a time.
inline void merge_split_rows(const std::vector<AttentionItem>& items, const float* partial, int64_t Hkv, int64_t G,
                             int64_t D, int64_t L, const int64_t* starts, int64_t seg, float* out) {
  const int64_t H = Hkv * G;
  at::parallel_for(0, static_cast<int64_t>(items.size()) * Hkv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<const float*> segments;
    for (int64_t p = p0; p < p1; ++p) {
      const AttentionItem& it = items[p / Hkv];
      if (it.segments == 1) continue;
      const int64_t h = p % Hkv, rows = (it.j1 - it.j0) * G, seen = std::min(L, starts[it.b] + it.j1);
      for (int64_t j = it.j0; j < it.j1; ++j) {
        const int64_t seen_by = std::min(seen, starts[it.b] + j + 1);
        if (seen_by <= seg) continue;  // whole
        segments.resize(segments_of(seen_by, seg));
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (j - it.j0) * G + g, t = it.row + j;
          for (size_t s = 0; s < segments.size(); ++s)
            segments[s] = partial + it.parts + ((h * it.segments + s) * rows + r) * (D + 2);
          merge_segments(segments.data(), static_cast<int64_t>(segments.size()), D, out + t * H * D + (h * G + g) * D);
        }
      }
    }
  });
}

// Attention over the paged cache, read in place, for B sequences with q_lens[b] new tokens
// each (1 for a decode, k+1 for a speculative verification, a prompt chunk's length), their
// rows consecutive from rows[b] on in q ([T, H, D], rows `q_stride` floats apart) and out
// ([T, H*D]); slots: [B*L] the slots of positions 0..L-1 of each sequence (padded); query j of
// sequence b sees positions 0..starts[b]+j. The work is split into (sequence, kv head, up to
// kBlock query positions, key segment) units, each run by one thread over the G query heads of
// those positions (attend_rows, attend_segment). Float32, bf16 and FP8 rows are read in place
// (half and a quarter of the bytes; an FP8 row's scale multiplies its key's scores and its
// value's weights), FP4 ones expanded once per unit. A row's result depends only on
// its query and the keys and values it sees, never on the rows it shares a unit with: a
// prompt's last token attends bit-identically whether it comes in a chunk, a verification or
// a decode step.
inline void paged_attention(const PagedKV& c, int64_t H, const float* q, int64_t q_stride, float* out, int64_t B,
                            const int64_t* rows, const int64_t* q_lens, int64_t L, const int64_t* slots,
                            const int64_t* starts) {
  constexpr int64_t kBlock = 16;  // query positions per item (a verification's k+1 fit in one)
  const int64_t Hkv = c.Hkv, D = c.D, G = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  using Item = AttentionItem;
  struct Unit {
    int64_t item, h, segment;
  };
  const bool direct = rows_direct(c), bf16 = c.kind == KVKind::kBf16, fp8 = c.kind == KVKind::kFp8;
  const int64_t seg = segment_length(c);
  std::vector<Item> items;
  std::vector<Unit> units;
  int64_t work = 1, part_floats = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j0 = 0; j0 < q_lens[b]; j0 += kBlock) {
      const int64_t j1 = std::min(q_lens[b], j0 + kBlock);
      const int64_t segments = segments_of(std::min(L, starts[b] + j1), seg);
      items.push_back({b, rows[b], j0, j1, segments, part_floats});
      if (segments > 1) part_floats += Hkv * segments * (j1 - j0) * G * (D + 2);
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t s = 0; s < segments; ++s) units.push_back({static_cast<int64_t>(items.size()) - 1, h, s});
      work += (starts[b] + j0 + kBlock) * kBlock * G * D;
    }
  std::vector<float> partial(part_floats);
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t grain = std::max<int64_t>(1, 65536 * n / work);
  at::parallel_for(0, n, grain, [&](int64_t p0, int64_t p1) {
    const int64_t max_rows = kBlock * G, span = std::min(L, seg);
    // Uninitialized: every score and expanded row is written before it is read, and zeroing
    // them cost a memset of ~1-3 MB per layer per thread at a 4k context.
    const std::unique_ptr<float[]> scores(new float[max_rows * span]);
    const std::unique_ptr<float[]> expanded(direct ? nullptr : new float[2 * span * D]);
    std::vector<const float*> keys(span), values(span), queries(max_rows);
    std::vector<const uint16_t*> keys16(bf16 ? span : 0), values16(bf16 ? span : 0);
    std::vector<const uint8_t*> keys8(fp8 ? span : 0), values8(fp8 ? span : 0);
    std::vector<float> key_scales(fp8 ? span : 0), value_scales(fp8 ? span : 0);
    std::vector<float*> weights(max_rows), outs(max_rows), parts(max_rows);
    std::vector<int64_t> seen_by(max_rows), counts(max_rows);
    for (int64_t p = p0; p < p1; ++p) {
      const Unit& u = units[p];
      const Item& it = items[u.item];
      const int64_t b = it.b, h = u.h, rows = (it.j1 - it.j0) * G;
      const int64_t* seq = slots + b * L;
      const int64_t seen = std::min(L, starts[b] + it.j1);  // positions any query here sees
      for (int64_t j = it.j0; j < it.j1; ++j) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (j - it.j0) * G + g, t = it.row + j;
          queries[r] = q + t * q_stride + (h * G + g) * D;
          weights[r] = scores.get() + r * span;
          seen_by[r] = std::min(seen, starts[b] + j + 1);
          outs[r] = out + t * H * D + (h * G + g) * D;
          if (it.segments > 1)
            parts[r] = partial.data() + it.parts + ((h * it.segments + u.segment) * rows + r) * (D + 2);
        }
      }
      // this unit's keys: positions k0..k1 (all of them unless split)
      const int64_t k0 = u.segment * seg, k1 = it.segments > 1 ? std::min(seen, k0 + seg) : seen;
      // rows seeing at most seg keys are whole (in segment 0); the rest from `first` on
      int64_t whole = 0, first = 0;
      if (it.segments > 1) {
        while (whole < rows && seen_by[whole] <= seg) ++whole;
        first = whole;
        while (first < rows && seen_by[first] <= k0) ++first;
        for (int64_t r = first; r < rows; ++r) counts[r] = std::min(seen_by[r], k1) - k0;
      } else {
        whole = first = rows;
      }
      const bool whole_here = u.segment == 0 && whole > 0;
      auto attend = [&](const auto* ks, const auto* vs, RowScales factors) {
        if (whole_here)
          attend_rows(queries.data(), ks, vs, seen_by.data(), weights.data(), outs.data(), whole, D, scale, factors);
        if (first < rows)
          attend_segment(queries.data() + first, ks, vs, counts.data() + first, weights.data() + first,
                         parts.data() + first, rows - first, D, scale, factors);
      };
      if (direct && bf16) {
        for (int64_t pos = k0; pos < k1; ++pos) {
          keys16[pos - k0] = c.bf16_row(0, h, seq[pos]);
          values16[pos - k0] = c.bf16_row(1, h, seq[pos]);
        }
        attend(keys16.data(), values16.data(), {});
        continue;
      }
      if (direct && fp8) {
        for (int64_t pos = k0; pos < k1; ++pos) {
          keys8[pos - k0] = c.fp8_row(0, h, seq[pos], &key_scales[pos - k0]);
          values8[pos - k0] = c.fp8_row(1, h, seq[pos], &value_scales[pos - k0]);
        }
        attend(keys8.data(), values8.data(), {key_scales.data(), value_scales.data()});
        continue;
      }
      float_rows(c, h, seq + k0, k1 - k0, expanded.get(), expanded.get() + span * D, keys.data(), values.data());
      attend(keys.data(), values.data(), {});
    }
  });
  if (part_floats > 0) merge_split_rows(items, partial.data(), Hkv, G, D, L, starts, seg, out);
}

}  // namespace expresslane
