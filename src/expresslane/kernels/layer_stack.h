// The layer stack (layer_stack_cpu.cpp): the layers' weights and paged caches, run a step
// at a time as one C++ call. Bound to Python as LayerStack (bindings.cpp).
#pragma once
#include <torch/extension.h>

#include <vector>

#include "linear.h"
#include "paged_kv.h"

namespace expresslane {

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;  // q/k norms undefined unless Qwen3
  Linear qkv, o, gate_up, down;
  PagedKV cache;
};

}  // namespace expresslane

class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t ffn, double eps);

  // linears: qkv, o, gate_up, down, each [bf16 weight], [codes, scales, row scales] (FP4) or
  // [codes, scales, mins] (4-bit integers); fp4_block / fp4_scale_kind describe the FP4 ones. kv, kind: the layer's cache (PagedKV).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, std::vector<std::vector<torch::Tensor>> linears,
                 c10::optional<torch::Tensor> qkv_bias, std::vector<torch::Tensor> kv, int64_t kind,
                 int64_t fp4_block, int64_t fp4_scale_kind);

  // One step of B sequences: x: [T, hidden] float32, sequence b's q_lens[b] tokens in
  // consecutive rows (1 for a decode, k+1 for a speculative verification, a prompt chunk);
  // cos/sin_signed: [T, 1, D]; slot_mapping: [T] where each token's K/V goes; decode_slots:
  // [B*L] the slots of positions 0..L-1 of each sequence (padded); starts: [B] tokens already
  // cached per sequence: token j of sequence b sits at position starts[b]+j and sees
  // positions 0..starts[b]+j. Every row goes through the same operations whatever else is in
  // the step (the dot-product linears and the attention are row-invariant), so a sequence's
  // tokens do not depend on the batch it ran in. prompt_ends: [B] positions before
  // prompt_ends[b] are sequence b's prompt, attended by the tiled kernel where
  // set_prompt_attention asks for it (step_attention.h).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor decode_slots, int64_t L, torch::Tensor q_lens, torch::Tensor starts,
                        torch::Tensor prompt_ends);

  // A step with at least `min_rows` prompt rows computes their linears in oneDNN's bf16
  // matmul (AMX where the CPU has it; bf16 outputs) instead of the row kernel: weights[l] is
  // layer l's [qkv, o, gate_up, down] plain bf16 weights. min_rows 0: never (the default).
  // Decode and verification rows always take the row kernel.
  void set_matrix_prompts(int64_t min_rows, std::vector<std::vector<torch::Tensor>> weights);

  // Whether prompt rows attend in the tiled kernel (prompt_attention.h; else row by row, the
  // default), and with bf16 products or float32 ones.
  void set_prompt_attention(bool tiled, bool bf16) {
    tiled_prompts_ = tiled;
    bf16_prompts_ = bf16;
  }

  // The output head for `greedy`: token embeddings [V, hidden], final norm, lm_head linear.
  void set_head(torch::Tensor embed, torch::Tensor norm, std::vector<torch::Tensor> lm_head, int64_t fp4_block,
                int64_t fp4_scale_kind);

  // Restrict `greedy`'s guesses to the tokens `ids` (int64 [V']): lm_head_rows is the
  // output head's weight for those rows only (any rows past V' are ignored), as set_head's
  // lm_head. A draft's head reads V' rows instead of the whole vocabulary's; the guesses are
  // the argmax over `ids`.
  void set_greedy_vocab(std::vector<torch::Tensor> lm_head_rows, torch::Tensor ids);

  // Logits of rows `rows` of the last layer's output h (all rows if none): final norm and
  // output head, as LlamaModel.forward's norm + lm_head. Normalizes h's rows in place.
  torch::Tensor logits(torch::Tensor h, c10::optional<torch::Tensor> rows);

  // `steps` greedy tokens for each of B sequences without returning to Python (a draft
  // model's proposals). unseen[b]: sequence b's tokens not yet in the cache (at least one; a
  // few); starts: [B] tokens in the cache; prompt_ends: [B] as forward's; decode_slots: [B*L]
  // slots of positions 0..L-1 (L >= starts + unseen + steps - 1); cos/sin_signed: [positions,
  // D] RoPE tables; vocab: logits past it are ignored. Returns [B, steps].
  torch::Tensor greedy(std::vector<torch::Tensor> unseen, torch::Tensor starts, torch::Tensor prompt_ends,
                       torch::Tensor decode_slots, int64_t L, int64_t steps, torch::Tensor cos, torch::Tensor sin,
                       int64_t vocab);

 private:
  // tokens [B*Q] (Q per sequence) at positions starts[b].. of each sequence -> the greedy
  // token after each sequence's last, written to out[b * out_stride]. Inputs are gathered
  // with plain loops: as ATen ops (index_select, advanced indexing) they cost more than a
  // draft model's layers.
  void next_tokens(const int64_t* tokens, int64_t B, int64_t Q, const torch::Tensor& starts,
                   const torch::Tensor& prompt_ends, const torch::Tensor& slots, int64_t L, const torch::Tensor& cos,
                   const torch::Tensor& sin, int64_t vocab, int64_t* out, int64_t out_stride);

  // The final norm, in place on x's rows (contiguous float32 [T, hidden]).
  torch::Tensor final_norm(torch::Tensor x) const;

  void embed_row(int64_t token, float* dst) const;

  int64_t qkv_width() const { return (H + 2 * Hkv) * D; }

  // The step's prompt rows, active when there are at least matrix_rows_ of them.
  expresslane::PromptRows prompt_rows(const torch::Tensor& lens, const torch::Tensor& starts,
                                      const torch::Tensor& prompt_ends) const;

  // q/k norms (Qwen3) and RoPE, in place on the fused projection's q and k heads.
  void prepare_qk(const expresslane::Layer& l, float* qkv, int64_t T, const float* cos, const float* sin) const;

  // The new tokens' K and V heads of the fused projection into the layer's cache.
  void write_kv(const expresslane::PagedKV& c, const float* qkv, int64_t T, const int64_t* slots) const;

  int64_t H, Hkv, D, F;
  float eps;
  std::vector<expresslane::Layer> layers;
  torch::Tensor embed_, norm_;
  expresslane::Linear head_;
  expresslane::Linear greedy_head_;  // set_greedy_vocab's rows of head_, and their token ids
  torch::Tensor greedy_ids_;
  bool tiled_prompts_ = false, bf16_prompts_ = false;
  int64_t matrix_rows_ = 0;
};
