// A step of the Llama-family model (decodes, speculative verifications and, where the linears
// are row-invariant, prompt chunks) as one C++ call.
//
// At decode batch sizes a layer is ~45 small tensor operations; issued from Python, or as ATen
// ops from here, each pays dispatch and allocation overhead that adds up to several
// milliseconds per step for a 30-layer model, as much as streaming the weights. This computes
// what expresslane.models.llama.DecoderLayer + PagedAttention._decode compute (float32
// activations and KV cache) with the linear layers in the kernels of gemv_cpu.cpp,
// bf16dot_cpu.cpp, fp4_cpu.cpp or int4_cpu.cpp and everything else as plain loops (decode_ops.h);
// attention reads the paged cache in place instead of gathering it (paged_attention.h). The
// Python code is the reference it is tested against (tests/test_kernels.py). The class is
// declared in layer_stack.h.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_ops.h"
#include "layer_stack.h"
#include "kernels.h"
#include "step_attention.h"

namespace ops = expresslane::ops;
using expresslane::Layer;
using expresslane::Linear;
using expresslane::PagedKV;
using expresslane::attend_step;
using expresslane::paged_attention;

namespace {

// f(t) for rows 0..T-1: in this thread at decode sizes, across threads for prompt chunks
// (each row's result is the same either way).
template <typename Fn>
void each_row(int64_t T, const Fn& f) {
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t);
  });
}

}  // namespace

torch::Tensor expresslane::Linear::operator()(const torch::Tensor& x) const {
  if (w.size() == 1 && w[0].dim() == 3)
    return w[0].dtype() == torch::kHalf ? f16_dot_linear(x, w[0], bias) : bf16_dot_linear(x, w[0], bias);
  if (w.size() == 1) return half_linear(x, w[0], bias);
  if (w[1].scalar_type() != torch::kByte) return int4_linear(x, w[0], w[1], w[2], bias);  // float block scales
  return fp4_linear(x, w[0], w[1], w[2], bias, block, scale_kind);
}

torch::Tensor expresslane::Linear::operator()(const torch::Tensor& x, const PromptRows& rows) const {
  if (!rows.active || !matrix.defined()) return (*this)(x);
  auto mat = [&](const torch::Tensor& r) {
    auto y = at::linear(r.to(torch::kBFloat16), matrix).to(torch::kFloat32);
    return bias ? y.add_(*bias) : y;
  };
  if (rows.all) return mat(x);
  auto out = torch::empty({x.size(0), matrix.size(0)}, x.options());
  out.index_copy_(0, rows.prompt, mat(x.index_select(0, rows.prompt)));
  if (rows.other.numel() > 0) out.index_copy_(0, rows.other, (*this)(x.index_select(0, rows.other)));
  return out;
}

// x: float32 [M, N] (rows may be strided) -> int64 [M], each row's torch.argmax.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) > 0, "x: float32 [M, N], N >= 1");
  if (x.stride(1) != 1) x = x.contiguous();
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < x.size(0); ++m) out.data_ptr<int64_t>()[m] = ops::argmax(xp + m * x.stride(0), x.size(1));
  return out;
}

LayerStack::LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t ffn, double eps)
    : H(num_heads), Hkv(num_kv_heads), D(head_dim), F(ffn), eps(static_cast<float>(eps)) {
  TORCH_CHECK(D % 8 == 0 && F % 8 == 0 && H % Hkv == 0, "head_dim and ffn multiples of 8, GQA groups");
}

void LayerStack::add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                            c10::optional<torch::Tensor> k_norm, std::vector<std::vector<torch::Tensor>> linears,
                            c10::optional<torch::Tensor> qkv_bias, std::vector<torch::Tensor> kv, int64_t kind,
                            int64_t fp4_block, int64_t fp4_scale_kind) {
  TORCH_CHECK(linears.size() == 4, "qkv, o, gate_up, down");
  TORCH_CHECK(input_norm.numel() % 8 == 0, "hidden size a multiple of 8");
  auto f32 = [](const torch::Tensor& t) { return t.to(torch::kFloat32).contiguous(); };
  Layer l;
  l.input_norm = f32(input_norm);
  l.post_norm = f32(post_norm);
  if (q_norm) l.q_norm = f32(*q_norm);
  if (k_norm) l.k_norm = f32(*k_norm);
  Linear* dst[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
  for (int i = 0; i < 4; ++i) *dst[i] = {linears[i], i == 0 ? qkv_bias : c10::nullopt, fp4_block, fp4_scale_kind};
  l.cache = PagedKV(kv, kind, D);
  TORCH_CHECK(l.cache.Hkv == Hkv, "kv: Hkv heads");
  layers.push_back(l);
}

torch::Tensor LayerStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                                   torch::Tensor decode_slots, int64_t L, torch::Tensor q_lens, torch::Tensor starts,
                                   torch::Tensor prompt_ends) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32, "float32 activations");
  auto lens = q_lens.to(torch::kInt64).contiguous();
  const int64_t T = x.size(0), B = lens.numel(), hidden = x.size(1);
  TORCH_CHECK(lens.sum().item<int64_t>() == T && starts.numel() == B && decode_slots.numel() == B * L &&
                  prompt_ends.numel() == B,
              "batch shapes: q_lens sum to the rows, starts and prompt_ends [B], decode_slots [B*L]");
  x = x.contiguous().clone();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto slots_out = slot_mapping.to(torch::kInt64).contiguous();
  auto slots_in = decode_slots.to(torch::kInt64).contiguous();
  auto seq_starts = starts.to(torch::kInt64).contiguous();
  // positions before these take the tiled prompt kernel (none unless set_prompt_attention)
  auto ends = tiled_prompts_ ? prompt_ends.to(torch::kInt64).contiguous() : torch::zeros({B}, torch::kInt64);
  const auto rows = prompt_rows(lens, seq_starts, prompt_ends);
  auto h = torch::empty({T, hidden}, x.options());
  auto attn = torch::empty({T, H * D}, x.options());
  auto act = torch::empty({T, F}, x.options());
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  for (const Layer& l : layers) {
    each_row(T, [&](int64_t t) {
      ops::rms_norm(xp + t * hidden, l.input_norm.data_ptr<float>(), hp + t * hidden, hidden, eps);
    });
    auto qkv = l.qkv(h, rows);
    prepare_qk(l, qkv.data_ptr<float>(), T, cos.data_ptr<float>(), sin.data_ptr<float>());
    write_kv(l.cache, qkv.data_ptr<float>(), T, slots_out.data_ptr<int64_t>());
    attend_step(l.cache, H, qkv.data_ptr<float>(), qkv_width(), attn.data_ptr<float>(), B, lens.data_ptr<int64_t>(), L,
                slots_in.data_ptr<int64_t>(), seq_starts.data_ptr<int64_t>(), ends.data_ptr<int64_t>(), bf16_prompts_);
    ops::add_inplace(xp, l.o(attn, rows).data_ptr<float>(), T * hidden);
    each_row(T, [&](int64_t t) {
      ops::rms_norm(xp + t * hidden, l.post_norm.data_ptr<float>(), hp + t * hidden, hidden, eps);
    });
    auto gu = l.gate_up(h, rows);
    const float* gup = gu.data_ptr<float>();
    each_row(T, [&](int64_t t) { ops::silu_mul(gup + t * 2 * F, gup + t * 2 * F + F, actp + t * F, F); });
    ops::add_inplace(xp, l.down(act, rows).data_ptr<float>(), T * hidden);
  }
  return x;
}

expresslane::PromptRows LayerStack::prompt_rows(const torch::Tensor& lens, const torch::Tensor& starts,
                                                const torch::Tensor& prompt_ends) const {
  expresslane::PromptRows rows;
  if (matrix_rows_ <= 0) return rows;
  const int64_t B = lens.numel();
  auto ends = prompt_ends.to(torch::kInt64).contiguous();
  const int64_t *len = lens.data_ptr<int64_t>(), *start = starts.data_ptr<int64_t>(), *end = ends.data_ptr<int64_t>();
  std::vector<int64_t> prompt, other;
  for (int64_t b = 0, t = 0; b < B; ++b)
    for (int64_t j = 0; j < len[b]; ++j, ++t) (start[b] + j < end[b] ? prompt : other).push_back(t);
  if (static_cast<int64_t>(prompt.size()) < matrix_rows_) return rows;
  auto index = [](const std::vector<int64_t>& v) {
    return torch::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, torch::kInt64).clone();
  };
  rows.active = true;
  rows.all = other.empty();
  rows.prompt = index(prompt);
  rows.other = index(other);
  return rows;
}

void LayerStack::set_matrix_prompts(int64_t min_rows, std::vector<std::vector<torch::Tensor>> weights) {
  TORCH_CHECK(min_rows <= 0 || weights.size() == layers.size(), "one [qkv, o, gate_up, down] per layer");
  matrix_rows_ = min_rows;
  for (size_t i = 0; i < layers.size(); ++i) {
    Linear* dst[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
    for (int j = 0; j < 4; ++j) {
      dst[j]->matrix = min_rows > 0 ? weights[i].at(j).to(torch::kBFloat16).contiguous() : torch::Tensor();
    }
  }
}

void LayerStack::set_head(torch::Tensor embed, torch::Tensor norm, std::vector<torch::Tensor> lm_head,
                           int64_t fp4_block, int64_t fp4_scale_kind) {
  embed_ = embed.contiguous();
  norm_ = norm.to(torch::kFloat32).contiguous();
  head_ = {lm_head, c10::nullopt, fp4_block, fp4_scale_kind};
}

void LayerStack::set_greedy_vocab(std::vector<torch::Tensor> lm_head_rows, torch::Tensor ids) {
  greedy_ids_ = ids.to(torch::kInt64).contiguous();
  greedy_head_ = {lm_head_rows, c10::nullopt, 0, 0};
}

torch::Tensor LayerStack::logits(torch::Tensor h, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(embed_.defined(), "set_head first");
  return head_(final_norm(rows.has_value() ? h.index_select(0, *rows) : h.contiguous()));
}

torch::Tensor LayerStack::greedy(std::vector<torch::Tensor> unseen, torch::Tensor starts, torch::Tensor prompt_ends,
                                  torch::Tensor decode_slots, int64_t L, int64_t steps, torch::Tensor cos,
                                  torch::Tensor sin, int64_t vocab) {
  TORCH_CHECK(embed_.defined(), "set_head first");
  const int64_t B = static_cast<int64_t>(unseen.size());
  auto slots = decode_slots.to(torch::kInt64).contiguous();
  auto pos = starts.to(torch::kInt64).contiguous().clone();
  auto ends = prompt_ends.to(torch::kInt64).contiguous();
  cos = cos.to(torch::kFloat32).contiguous();
  sin = sin.to(torch::kFloat32).contiguous();
  TORCH_CHECK(slots.numel() == B * L && pos.numel() == B && ends.numel() == B && cos.size(1) == D, "greedy: shapes");
  auto out = torch::empty({B, steps}, pos.options());
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* p = pos.data_ptr<int64_t>();
  std::vector<int64_t> tokens;
  bool uniform = true;
  for (auto& u : unseen) {
    u = u.to(torch::kInt64).contiguous();
    uniform = uniform && u.numel() == unseen[0].numel();
  }
  // catch up on the unseen tokens; the last one's logits give the first guess
  if (uniform) {
    for (const auto& u : unseen) tokens.insert(tokens.end(), u.data_ptr<int64_t>(), u.data_ptr<int64_t>() + u.numel());
    next_tokens(tokens.data(), B, unseen[0].numel(), pos, ends, slots, L, cos, sin, vocab, o, steps);
  } else {
    for (int64_t b = 0; b < B; ++b)
      next_tokens(unseen[b].data_ptr<int64_t>(), 1, unseen[b].numel(), pos.narrow(0, b, 1), ends.narrow(0, b, 1),
                  slots.narrow(0, b * L, L), L, cos, sin, vocab, o + b * steps, steps);
  }
  for (int64_t b = 0; b < B; ++b) p[b] += unseen[b].numel();
  tokens.resize(B);
  for (int64_t i = 1; i < steps; ++i) {
    for (int64_t b = 0; b < B; ++b) tokens[b] = o[b * steps + i - 1];
    next_tokens(tokens.data(), B, 1, pos, ends, slots, L, cos, sin, vocab, o + i, steps);
    for (int64_t b = 0; b < B; ++b) p[b] += 1;
  }
  return out;
}

void LayerStack::next_tokens(const int64_t* tokens, int64_t B, int64_t Q, const torch::Tensor& starts,
                              const torch::Tensor& prompt_ends, const torch::Tensor& slots, int64_t L,
                              const torch::Tensor& cos, const torch::Tensor& sin, int64_t vocab, int64_t* out,
                              int64_t out_stride) {
  const int64_t T = B * Q, hidden = embed_.size(1);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto x = torch::empty({T, hidden}, f32);
  auto c = torch::empty({T, 1, D}, f32), s = torch::empty({T, 1, D}, f32);
  auto slot_out = torch::empty({T}, torch::TensorOptions().dtype(torch::kInt64));
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Q; ++j) {
      const int64_t t = b * Q + j, position = st[b] + j;
      embed_row(tokens[t], x.data_ptr<float>() + t * hidden);
      std::memcpy(c.data_ptr<float>() + t * D, cos.data_ptr<float>() + position * D, D * sizeof(float));
      std::memcpy(s.data_ptr<float>() + t * D, sin.data_ptr<float>() + position * D, D * sizeof(float));
      slot_out.data_ptr<int64_t>()[t] = sl[b * L + position];
    }
  auto h = forward(x, c, s, slot_out, slots, L, torch::full({B}, Q, starts.options()), starts, prompt_ends);
  auto last = Q == 1 ? h : h.view({B, Q, -1}).select(1, Q - 1).contiguous();
  if (greedy_ids_.defined()) {
    auto next = argmax_rows(greedy_head_(final_norm(last.contiguous())).narrow(1, 0, greedy_ids_.numel()));
    const int64_t* ids = greedy_ids_.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) out[b * out_stride] = ids[next.data_ptr<int64_t>()[b]];
    return;
  }
  auto next = argmax_rows(logits(last, c10::nullopt).narrow(1, 0, vocab));
  for (int64_t b = 0; b < B; ++b) out[b * out_stride] = next.data_ptr<int64_t>()[b];
}

torch::Tensor LayerStack::final_norm(torch::Tensor x) const {
  for (int64_t t = 0; t < x.size(0); ++t) {
    float* r = x.data_ptr<float>() + t * x.size(1);
    ops::rms_norm(r, norm_.data_ptr<float>(), r, x.size(1), eps);
  }
  return x;
}

void LayerStack::embed_row(int64_t token, float* dst) const {
  const int64_t hidden = embed_.size(1);
  TORCH_CHECK(token >= 0 && token < embed_.size(0), "token id out of range");
  if (embed_.dtype() == torch::kFloat32) {
    std::memcpy(dst, embed_.data_ptr<float>() + token * hidden, hidden * sizeof(float));
  } else {
    TORCH_CHECK(embed_.dtype() == torch::kBFloat16, "embeddings: float32 or bf16");
    const at::BFloat16* src = embed_.data_ptr<at::BFloat16>() + token * hidden;
    for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

void LayerStack::prepare_qk(const Layer& l, float* qkv, int64_t T, const float* cos, const float* sin) const {
  each_row(T, [&](int64_t t) {
    for (int64_t head = 0; head < H + Hkv; ++head) {
      float* v = qkv + t * qkv_width() + head * D;
      if (l.q_norm.defined())
        ops::rms_norm(v, (head < H ? l.q_norm : l.k_norm).data_ptr<float>(), v, D, eps);
      ops::rope(v, cos + t * D, sin + t * D, D);
    }
  });
}

void LayerStack::write_kv(const PagedKV& c, const float* qkv, int64_t T, const int64_t* slots) const {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t h = 0; h < Hkv; ++h) c.write_row(kv, h, slots[t], qkv + t * qkv_width() + (H + kv * Hkv + h) * D);
}

// The decode attention alone, for batches the Python layers run (models/attention.py):
// q [B*Q, H, D] float32 after RoPE, kv/kind a store's native() tensors. Returns [B*Q, H*D].
torch::Tensor decode_attention(torch::Tensor q, std::vector<torch::Tensor> kv, int64_t kind, torch::Tensor decode_slots,
                               int64_t L, int64_t Q, torch::Tensor starts) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3, "q: float32 [B*Q, H, D]");
  q = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), B = T / Q;
  const PagedKV cache(std::move(kv), kind, D);
  TORCH_CHECK(D % 8 == 0 && H % cache.Hkv == 0 && B * Q == T, "head_dim a multiple of 8, GQA groups, B*Q rows");
  auto slots = decode_slots.to(torch::kInt64).contiguous();
  auto seq_starts = starts.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == B * L && seq_starts.numel() == B, "slots [B*L], starts [B]");
  auto out = torch::empty({T, H * D}, q.options());
  const std::vector<int64_t> q_lens(B, Q);
  std::vector<int64_t> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b * Q;
  paged_attention(cache, H, q.data_ptr<float>(), H * D, out.data_ptr<float>(), B, rows.data(), q_lens.data(), L,
                  slots.data_ptr<int64_t>(), seq_starts.data_ptr<int64_t>());
  return out;
}

// The tiled prompt attention alone (prompt_attention.h), for chunks the Python layers run: q
// [T, H, D] float32 after RoPE, sequence b's q_lens[b] rows consecutive; kv/kind a store's
// native() tensors; slots [B*L]; starts [B]; bf16: bf16 products (AVX-512 BF16 builds;
// float32 ones elsewhere).
// Returns [T, H*D].
torch::Tensor prompt_attention(torch::Tensor q, std::vector<torch::Tensor> kv, int64_t kind, torch::Tensor slots,
                               int64_t L, torch::Tensor q_lens, torch::Tensor starts, bool bf16) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3, "q: float32 [T, H, D]");
  q = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const PagedKV cache(std::move(kv), kind, D);
  auto lens = q_lens.to(torch::kInt64).contiguous();
  auto at = slots.to(torch::kInt64).contiguous();
  auto seq_starts = starts.to(torch::kInt64).contiguous();
  const int64_t B = lens.numel();
  TORCH_CHECK(D % 16 == 0 && H % cache.Hkv == 0, "head_dim a multiple of 16, GQA groups");
  TORCH_CHECK(lens.sum().item<int64_t>() == T && at.numel() == B * L && seq_starts.numel() == B,
              "q_lens sum to the rows, slots [B*L], starts [B]");
  auto out = torch::empty({T, H * D}, q.options());
  std::vector<int64_t> rows(B);
  for (int64_t b = 0, row = 0; b < B; row += lens.data_ptr<int64_t>()[b++]) rows[b] = row;
  expresslane::prompt_attention(cache, H, q.data_ptr<float>(), H * D, out.data_ptr<float>(), B, rows.data(),
                                lens.data_ptr<int64_t>(), L, at.data_ptr<int64_t>(), seq_starts.data_ptr<int64_t>(),
                                bf16);
  return out;
}

// k, v: float32 [T, Hkv, D] -> rows slots[t] of the cache (kv, kind: a store's native()).
void write_kv(std::vector<torch::Tensor> kv, int64_t kind, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k.dtype() == torch::kFloat32 && k.dim() == 3 && v.sizes() == k.sizes() && v.dtype() == k.dtype(),
              "k, v: float32 [T, Hkv, D]");
  const PagedKV cache(std::move(kv), kind, k.size(2));
  const int64_t T = k.size(0), D = k.size(2);
  TORCH_CHECK(cache.Hkv == k.size(1) && slots.numel() == T, "k, v: Hkv heads; slots [T]");
  const auto rows = std::vector<torch::Tensor>{k.contiguous(), v.contiguous()};
  const auto at = slots.to(torch::kInt64).contiguous();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = at.data_ptr<int64_t>()[t];
    TORCH_CHECK(slot >= 0 && slot < cache.slots(), "slot out of range");
    for (int64_t which = 0; which < 2; ++which)
      for (int64_t h = 0; h < cache.Hkv; ++h)
        cache.write_row(which, h, slot, rows[which].data_ptr<float>() + (t * cache.Hkv + h) * D);
  }
}
