// The functions each kernel file offers the others and the Python module (bindings.cpp).
#pragma once
#include <torch/extension.h>

#include <vector>

// gemv_cpu.cpp: x (fp32) @ W^T (bf16 or fp16 [N, K]) + b, for small batches (AVX2+FMA or AVX-512).
torch::Tensor half_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

// bf16dot_cpu.cpp: bf16 W [N, K] -> the bf16_dot_linear layout [N/16, K/2, 32].
torch::Tensor pack_bf16_dot(torch::Tensor w);

// bf16dot_cpu.cpp: bf16(x) @ W^T (pack_bf16_dot's layout) + b, float32 sums (AVX-512 BF16).
torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);

// bf16dot_cpu.cpp: whether this build has bf16_dot_linear (else it and pack_bf16_dot throw).
bool bf16_dot_available();

// f16dot_cpu.cpp: float16 W [N, K] -> the f16_dot_linear layout [N/16, K, 16].
torch::Tensor pack_f16_dot(torch::Tensor w);

// f16dot_cpu.cpp: x (fp32) @ W^T (pack_f16_dot's layout, widened exactly) + b (AVX-512).
torch::Tensor f16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);

// f16dot_cpu.cpp: whether this build has f16_dot_linear (else it and pack_f16_dot throw).
bool f16_dot_available();

// fp4_cpu.cpp: x (fp32) @ W^T (E2M1 codes + block scales read as ScaleKind scale_kind,
// times per-row scales) + b.
torch::Tensor fp4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor row_scales,
                         c10::optional<torch::Tensor> bias, int64_t block, int64_t scale_kind);

// int4_cpu.cpp: x (fp32) @ W^T (4-bit integer codes, a float16 or float32 scale per 32 and a min
// per 32, or none: Q4_0's -8 x the scale) + b.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                          c10::optional<torch::Tensor> bias);

// mask_cpu.cpp: grammar masks, the logits of tokens a row's bitmask disallows set to -inf.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask, torch::Tensor mask_rows);

// sample_cpu.cpp: one token per row of logits drawn at its temperature (float64 [B]) after
// min_p, top_k (int64, <= 0: off) and top_p, with its uniform draw u (float64 [B]).
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u);

// sample_cpu.cpp: the distribution sample_rows draws from, float32 [B, V], each row summing to 1.
torch::Tensor filter_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p);

// sample_cpu.cpp: one token per row of weights (float32 [B, V], >= 0) by inverse transform at u.
torch::Tensor draw_rows(torch::Tensor weights, torch::Tensor u);

// layer_stack_cpu.cpp: each row's index of its first maximum, as torch.argmax.
torch::Tensor argmax_rows(torch::Tensor x);

// layer_stack_cpu.cpp: attention of decode tokens over a store's native() tensors (paged_kv.h).
torch::Tensor decode_attention(torch::Tensor q, std::vector<torch::Tensor> kv, int64_t kind, torch::Tensor decode_slots,
                               int64_t L, int64_t Q, torch::Tensor starts);

// layer_stack_cpu.cpp: tiled attention of prompt chunks over a store's native() tensors
// (prompt_attention.h), with bf16 products where bf16 and the build has them
// (bf16_dot_available).
torch::Tensor prompt_attention(torch::Tensor q, std::vector<torch::Tensor> kv, int64_t kind, torch::Tensor slots,
                               int64_t L, torch::Tensor q_lens, torch::Tensor starts, bool bf16);


// layer_stack_cpu.cpp: K/V [T, Hkv, D] into a store's native() tensors at `slots`, as the native
// step writes them (tested against the store's own write).
void write_kv(std::vector<torch::Tensor> kv, int64_t kind, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
