// Grammar masks (engine/grammar.py): the logits of tokens a row's bitmask does not allow become -inf.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels.h"

// logits: float32 [B, V], changed in place; rows: int64 [R], the logits rows to mask; bitmask: int32 [M, W];
// mask_rows: int64 [R], each row's bitmask row. Bit t % 32 of word t / 32 set: token t is allowed.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask, torch::Tensor mask_rows) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2 && logits.stride(1) == 1,
              "logits: float32 [B, V], rows contiguous");
  TORCH_CHECK(bitmask.dtype() == torch::kInt32 && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask: contiguous int32 [M, W]");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && mask_rows.dtype() == torch::kInt64 &&
                  rows.numel() == mask_rows.numel(), "rows, mask_rows: int64 [R]");
  const int64_t B = logits.size(0), V = logits.size(1), M = bitmask.size(0), W = bitmask.size(1);
  TORCH_CHECK(W * 32 >= V, "a bitmask row covers the vocabulary");
  rows = rows.contiguous();
  mask_rows = mask_rows.contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* mr = mask_rows.data_ptr<int64_t>();
  const auto* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < B && mr[i] >= 0 && mr[i] < M, "row index out of range");
    float* row = logits.data_ptr<float>() + r[i] * logits.stride(0);
    const uint32_t* mask = words + mr[i] * W;
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xFFFFFFFFu) continue;  // all 32 allowed: the common case in free text
      const int64_t end = std::min<int64_t>(32, V - w * 32);
      for (int64_t b = 0; b < end; ++b)
        if (!((bits >> b) & 1u)) row[w * 32 + b] = ninf;
    }
  }
}
