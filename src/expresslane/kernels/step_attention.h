// Which attention kernel takes which rows of a step. A sequence's rows at positions before its
// prompt end are prompt rows, attended by the tiled kernel (prompt_attention.h); the rest (decodes, verifications, generated tokens recomputed after a preemption) by
// paged_attention.h. The split goes by position, not by how the scheduler batched the step:
// every row takes the same kernel whatever else runs beside it, and both kernels' rows are
// computed alone, so greedy tokens do not depend on the batch or on how a prompt was chunked.
#pragma once
#include <algorithm>
#include <vector>

#include "paged_attention.h"
#include "prompt_attention.h"

namespace expresslane {

// paged_attention's arguments (sequence b's q_lens[b] rows consecutive, the first sequence's
// first) plus prompt_ends [B]: positions before prompt_ends[b] are sequence b's prompt, and
// bf16_prompts: their attention takes bf16 products (prompt_attention).
inline void attend_step(const PagedKV& c, int64_t H, const float* q, int64_t q_stride, float* out, int64_t B,
                        const int64_t* q_lens, int64_t L, const int64_t* slots, const int64_t* starts,
                        const int64_t* prompt_ends, bool bf16_prompts) {
  std::vector<int64_t> rows(B), lens(B), from(B), prompt_rows(B), prompt_lens(B);
  bool prompts = false;
  for (int64_t b = 0, row = 0; b < B; row += q_lens[b++]) {
    const int64_t n = std::clamp<int64_t>(prompt_ends[b] - starts[b], 0, q_lens[b]);
    prompt_rows[b] = row;
    prompt_lens[b] = n;
    rows[b] = row + n;
    lens[b] = q_lens[b] - n;
    from[b] = starts[b] + n;
    prompts = prompts || n > 0;
  }
  paged_attention(c, H, q, q_stride, out, B, rows.data(), lens.data(), L, slots, from.data());
  if (prompts)
    prompt_attention(c, H, q, q_stride, out, B, prompt_rows.data(), prompt_lens.data(), L, slots, starts,
                     bf16_prompts);
}

}  // namespace expresslane
