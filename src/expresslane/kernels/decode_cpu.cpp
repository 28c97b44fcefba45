// A step of the Llama-family model (decodes, speculative verifications and, where the linears
// are row-invariant, prompt chunks) as one C++ call.
//
// At decode batch sizes a layer is ~45 small tensor operations; issued from Python, or as ATen
// ops from here, each pays dispatch and allocation overhead that adds up to several
// milliseconds per step for a 30-layer model, as much as streaming the weights. This computes
// what expresslane.models.llama.DecoderLayer + PagedAttention._decode compute (float32
// activations and KV cache) with the linear layers in the kernels of gemv_cpu.cpp,
// bf16dot_cpu.cpp or fp4_cpu.cpp and everything else as plain loops (decode_ops.h);
// attention reads the paged cache in place instead of gathering it (paged_attention.h). The
// Python code is the reference it is tested against (tests/test_kernels.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_ops.h"
#include "paged_attention.h"

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
torch::Tensor fp4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor row_scales,
                         c10::optional<torch::Tensor> bias, int64_t block, int64_t scale_kind);

namespace {

// A bf16 weight: [N, K] (gemv_cpu.cpp) or packed for bf16 dot products, [N/16, K/2, 32]
// (bf16dot_cpu.cpp); or FP4 codes + block scales + row scales (see fp4_cpu.cpp).
struct Linear {
  std::vector<torch::Tensor> w;
  c10::optional<torch::Tensor> bias;
  int64_t block = 0, scale_kind = 0;
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (w.size() == 1) return w[0].dim() == 3 ? bf16_dot_linear(x, w[0], bias) : bf16_linear(x, w[0], bias);
    return fp4_linear(x, w[0], w[1], w[2], bias, block, scale_kind);
  }
};

namespace ops = expresslane::ops;
using expresslane::PagedKV;
using expresslane::paged_attention;

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;  // q/k norms undefined unless Qwen3
  Linear qkv, o, gate_up, down;
  PagedKV cache;
};

// The E2M1 code of v as quant/formats.py e2m1_encode: nearest value, ties to the even code.
inline uint8_t e2m1_code(float v) {
  static constexpr float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float mag = std::fabs(v);
  uint8_t index = 0;
  for (int k = 0; k < 7; ++k) index += (k % 2) ? (mag >= mid[k]) : (mag > mid[k]);
  return index | (std::signbit(v) ? 8 : 0);
}

}  // namespace

// x: float32 [M, N] (rows may be strided) -> int64 [M], each row's torch.argmax.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) > 0, "x: float32 [M, N], N >= 1");
  if (x.stride(1) != 1) x = x.contiguous();
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < x.size(0); ++m) out.data_ptr<int64_t>()[m] = ops::argmax(xp + m * x.stride(0), x.size(1));
  return out;
}

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t ffn, double eps)
      : H(num_heads), Hkv(num_kv_heads), D(head_dim), F(ffn), eps(static_cast<float>(eps)) {
    TORCH_CHECK(D % 8 == 0 && F % 8 == 0 && H % Hkv == 0, "head_dim and ffn multiples of 8, GQA groups");
  }

  // linears: qkv, o, gate_up, down, each [bf16 weight] or [codes, scales, row scales];
  // fp4_block / fp4_scale_kind describe the FP4 ones. kv, kind: the layer's cache (PagedKV).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
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

  // One step of B sequences: x: [T, hidden] float32, sequence b's q_lens[b] tokens in
  // consecutive rows (1 for a decode, k+1 for a speculative verification, a prompt chunk);
  // cos/sin_signed: [T, 1, D]; slot_mapping: [T] where each token's K/V goes; decode_slots:
  // [B*L] the slots of positions 0..L-1 of each sequence (padded); starts: [B] tokens already
  // cached per sequence: token j of sequence b sits at position starts[b]+j and sees
  // positions 0..starts[b]+j. Every row goes through the same operations whatever else is in
  // the step (the dot-product linears and the attention are row-invariant), so a sequence's
  // tokens do not depend on the batch it ran in.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor decode_slots, int64_t L, torch::Tensor q_lens, torch::Tensor starts) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32, "float32 activations");
    auto lens = q_lens.to(torch::kInt64).contiguous();
    const int64_t T = x.size(0), B = lens.numel(), hidden = x.size(1);
    TORCH_CHECK(lens.sum().item<int64_t>() == T && starts.numel() == B && decode_slots.numel() == B * L,
                "batch shapes: q_lens sum to the rows, starts [B], decode_slots [B*L]");
    x = x.contiguous().clone();
    cos = cos.contiguous();
    sin = sin.contiguous();
    auto slots_out = slot_mapping.to(torch::kInt64).contiguous();
    auto slots_in = decode_slots.to(torch::kInt64).contiguous();
    auto seq_starts = starts.to(torch::kInt64).contiguous();
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
      auto qkv = l.qkv(h);
      prepare_qk(l, qkv.data_ptr<float>(), T, cos.data_ptr<float>(), sin.data_ptr<float>());
      write_kv(l.cache, qkv.data_ptr<float>(), T, slots_out.data_ptr<int64_t>());
      paged_attention(l.cache, H, qkv.data_ptr<float>(), qkv_width(), attn.data_ptr<float>(), B,
                      lens.data_ptr<int64_t>(), L, slots_in.data_ptr<int64_t>(), seq_starts.data_ptr<int64_t>());
      ops::add_inplace(xp, l.o(attn).data_ptr<float>(), T * hidden);
      each_row(T, [&](int64_t t) {
        ops::rms_norm(xp + t * hidden, l.post_norm.data_ptr<float>(), hp + t * hidden, hidden, eps);
      });
      auto gu = l.gate_up(h);
      const float* gup = gu.data_ptr<float>();
      each_row(T, [&](int64_t t) { ops::silu_mul(gup + t * 2 * F, gup + t * 2 * F + F, actp + t * F, F); });
      ops::add_inplace(xp, l.down(act).data_ptr<float>(), T * hidden);
    }
    return x;
  }

  // The output head for `greedy`: token embeddings [V, hidden], final norm, lm_head linear.
  void set_head(torch::Tensor embed, torch::Tensor norm, std::vector<torch::Tensor> lm_head, int64_t fp4_block,
                int64_t fp4_scale_kind) {
    embed_ = embed.contiguous();
    norm_ = norm.to(torch::kFloat32).contiguous();
    head_ = {lm_head, c10::nullopt, fp4_block, fp4_scale_kind};
  }

  // Restrict `greedy`'s guesses to the tokens `ids` (int64 [V']): lm_head_rows is the
  // output head's weight for those rows only, as set_head's lm_head. A draft's head reads
  // V' rows instead of the whole vocabulary's; the guesses are the argmax over `ids`.
  void set_greedy_vocab(std::vector<torch::Tensor> lm_head_rows, torch::Tensor ids) {
    greedy_ids_ = ids.to(torch::kInt64).contiguous();
    greedy_head_ = {lm_head_rows, c10::nullopt, 0, 0};
  }

  // Logits of rows `rows` of the last layer's output h (all rows if none): final norm and
  // output head, as LlamaModel.forward's norm + lm_head. Normalizes h's rows in place.
  torch::Tensor logits(torch::Tensor h, c10::optional<torch::Tensor> rows) {
    TORCH_CHECK(embed_.defined(), "set_head first");
    return head_(final_norm(rows.has_value() ? h.index_select(0, *rows) : h.contiguous()));
  }

  // `steps` greedy tokens for each of B sequences without returning to Python (a draft
  // model's proposals). unseen[b]: sequence b's tokens not yet in the cache (at least one; a
  // few); starts: [B] tokens in the cache; decode_slots: [B*L] slots of positions 0..L-1
  // (L >= starts + unseen + steps - 1); cos/sin_signed: [positions, D] RoPE tables; vocab:
  // logits past it are ignored. Returns [B, steps].
  torch::Tensor greedy(std::vector<torch::Tensor> unseen, torch::Tensor starts, torch::Tensor decode_slots, int64_t L,
                       int64_t steps, torch::Tensor cos, torch::Tensor sin, int64_t vocab) {
    TORCH_CHECK(embed_.defined(), "set_head first");
    const int64_t B = static_cast<int64_t>(unseen.size());
    auto slots = decode_slots.to(torch::kInt64).contiguous();
    auto pos = starts.to(torch::kInt64).contiguous().clone();
    cos = cos.to(torch::kFloat32).contiguous();
    sin = sin.to(torch::kFloat32).contiguous();
    TORCH_CHECK(slots.numel() == B * L && pos.numel() == B && cos.size(1) == D, "greedy: shapes");
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
      next_tokens(tokens.data(), B, unseen[0].numel(), pos, slots, L, cos, sin, vocab, o, steps);
    } else {
      for (int64_t b = 0; b < B; ++b)
        next_tokens(unseen[b].data_ptr<int64_t>(), 1, unseen[b].numel(), pos.narrow(0, b, 1), slots.narrow(0, b * L, L), L,
                    cos, sin, vocab, o + b * steps, steps);
    }
    for (int64_t b = 0; b < B; ++b) p[b] += unseen[b].numel();
    tokens.resize(B);
    for (int64_t i = 1; i < steps; ++i) {
      for (int64_t b = 0; b < B; ++b) tokens[b] = o[b * steps + i - 1];
      next_tokens(tokens.data(), B, 1, pos, slots, L, cos, sin, vocab, o + i, steps);
      for (int64_t b = 0; b < B; ++b) p[b] += 1;
    }
    return out;
  }

 private:
  // tokens [B*Q] (Q per sequence) at positions starts[b].. of each sequence -> the greedy
  // token after each sequence's last, written to out[b * out_stride]. Inputs are gathered
  // with plain loops: as ATen ops (index_select, advanced indexing) they cost more than a
  // draft model's layers.
  void next_tokens(const int64_t* tokens, int64_t B, int64_t Q, const torch::Tensor& starts, const torch::Tensor& slots,
                   int64_t L, const torch::Tensor& cos, const torch::Tensor& sin, int64_t vocab, int64_t* out,
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
    auto h = forward(x, c, s, slot_out, slots, L, torch::full({B}, Q, starts.options()), starts);
    auto last = Q == 1 ? h : h.view({B, Q, -1}).select(1, Q - 1).contiguous();
    if (greedy_ids_.defined()) {
      auto next = argmax_rows(greedy_head_(final_norm(last.contiguous())));
      const int64_t* ids = greedy_ids_.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) out[b * out_stride] = ids[next.data_ptr<int64_t>()[b]];
      return;
    }
    auto next = argmax_rows(logits(last, c10::nullopt).narrow(1, 0, vocab));
    for (int64_t b = 0; b < B; ++b) out[b * out_stride] = next.data_ptr<int64_t>()[b];
  }

  // The final norm, in place on x's rows (contiguous float32 [T, hidden]).
  torch::Tensor final_norm(torch::Tensor x) const {
    for (int64_t t = 0; t < x.size(0); ++t) {
      float* r = x.data_ptr<float>() + t * x.size(1);
      ops::rms_norm(r, norm_.data_ptr<float>(), r, x.size(1), eps);
    }
    return x;
  }

  void embed_row(int64_t token, float* dst) const {
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

  int64_t qkv_width() const { return (H + 2 * Hkv) * D; }

  // f(t) for rows 0..T-1: in this thread at decode sizes, across threads for prompt chunks
  // (each row's result is the same either way).
  template <typename Fn>
  static void each_row(int64_t T, const Fn& f) {
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) f(t);
    });
  }

  // q/k norms (Qwen3) and RoPE, in place on the fused projection's q and k heads.
  void prepare_qk(const Layer& l, float* qkv, int64_t T, const float* cos, const float* sin) const {
    each_row(T, [&](int64_t t) {
      for (int64_t head = 0; head < H + Hkv; ++head) {
        float* v = qkv + t * qkv_width() + head * D;
        if (l.q_norm.defined())
          ops::rms_norm(v, (head < H ? l.q_norm : l.k_norm).data_ptr<float>(), v, D, eps);
        ops::rope(v, cos + t * D, sin + t * D, D);
      }
    });
  }

  void write_kv(const PagedKV& c, const float* qkv, int64_t T, const int64_t* slots) const {
    const int64_t S = c.slots();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < Hkv; ++h) {
          const float* src = qkv + t * qkv_width() + (H + kv * Hkv + h) * D;
          const int64_t row = (kv * Hkv + h) * S + slots[t];
          if (c.kind == 0) {
            std::memcpy(c.kv[0].data_ptr<float>() + row * D, src, D * sizeof(float));
          } else if (c.kind == 1) {  // as Fp8KV.write: scale = half(max(amax / 448, 1e-8))
            float amax = 0.0f;
            for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(src[i]));
            const c10::Half scale(std::max(amax / 448.0f, 1e-8f));
            c.kv[1].data_ptr<c10::Half>()[row] = scale;
            uint8_t* dst = c.kv[0].data_ptr<uint8_t>() + row * D;
            for (int64_t i = 0; i < D; ++i) dst[i] = c10::Float8_e4m3fn(src[i] / static_cast<float>(scale)).x;
          } else {  // as Fp4KV.write: per 16 values, scale = e4m3(min(amax / 6, 448))
            uint8_t* codes = c.kv[0].data_ptr<uint8_t>() + row * (D / 2);
            uint8_t* scales = c.kv[1].data_ptr<uint8_t>() + row * (D / 16);
            for (int64_t blk = 0; blk < D / 16; ++blk) {
              const float* x = src + 16 * blk;
              float amax = 0.0f;
              for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[i]));
              const c10::Float8_e4m3fn scale(std::min(amax / 6.0f, 448.0f));
              scales[blk] = scale.x;
              const float s = static_cast<float>(scale);
              for (int i = 0; i < 16; i += 2)
                codes[8 * blk + i / 2] = e2m1_code(s > 0 ? x[i] / s : 0.0f) |
                                         (e2m1_code(s > 0 ? x[i + 1] / s : 0.0f) << 4);
            }
          }
        }
  }

  int64_t H, Hkv, D, F;
  float eps;
  std::vector<Layer> layers;
  torch::Tensor embed_, norm_;
  Linear head_;
  Linear greedy_head_;  // set_greedy_vocab's rows of head_, and their token ids
  torch::Tensor greedy_ids_;
};

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
  paged_attention(cache, H, q.data_ptr<float>(), H * D, out.data_ptr<float>(), B, q_lens.data(), L,
                  slots.data_ptr<int64_t>(), seq_starts.data_ptr<int64_t>());
  return out;
}

void register_decode_stack(pybind11::module& m) {
  m.def("argmax_rows", &argmax_rows, "each row's index of its first maximum, as torch.argmax (AVX2)");
  m.def("decode_attention", &decode_attention, "attention of decode tokens over the paged KV cache (AVX2)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward)
      .def("set_head", &DecodeStack::set_head)
      .def("logits", &DecodeStack::logits)
      .def("set_greedy_vocab", &DecodeStack::set_greedy_vocab)
      .def("greedy", &DecodeStack::greedy);
}
