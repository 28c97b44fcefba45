// The batch-of-single-tokens decode step of the Llama-family model as one C++ call.
//
// At decode batch sizes a layer is ~45 small tensor operations; issued from Python each one
// pays interpreter and binding overhead that adds up to several milliseconds per step for a
// 30-layer model, as much as streaming the weights. This replays exactly the operations of
// expresslane.models.llama.DecoderLayer + PagedAttention._decode (float32 activations, bf16 or
// FP4 linear weights through the AVX2 kernels of gemv_cpu.cpp / fp4_cpu.cpp) without going
// back to Python.
// The Python code is the reference it is tested against.
#include <torch/extension.h>

#include <vector>

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor fp4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor row_scales,
                         c10::optional<torch::Tensor> bias, int64_t block, int64_t scale_kind);

namespace {

// A bf16 weight [N, K], or FP4 codes + block scales + row scales (see fp4_cpu.cpp).
struct Linear {
  std::vector<torch::Tensor> w;
  c10::optional<torch::Tensor> bias;
  int64_t block = 0, scale_kind = 0;
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (w.size() == 1) return bf16_linear(x, w[0], bias);
    return fp4_linear(x, w[0], w[1], w[2], bias, block, scale_kind);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;  // q/k norms undefined unless Qwen3
  Linear qkv, o, gate_up, down;
  torch::Tensor kv_cache;  // [2, Hkv, slots, D]
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t ffn, double eps)
      : H(num_heads), Hkv(num_kv_heads), D(head_dim), F(ffn), eps(eps) {}

  // linears: qkv, o, gate_up, down, each [bf16 weight] or [codes, scales, row scales];
  // fp4_block / fp4_scale_kind describe the FP4 ones.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, std::vector<std::vector<torch::Tensor>> linears,
                 c10::optional<torch::Tensor> qkv_bias, torch::Tensor kv_cache, int64_t fp4_block,
                 int64_t fp4_scale_kind) {
    TORCH_CHECK(linears.size() == 4, "qkv, o, gate_up, down");
    Layer l;
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    if (q_norm) l.q_norm = *q_norm;
    if (k_norm) l.k_norm = *k_norm;
    Linear* dst[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) *dst[i] = {linears[i], i == 0 ? qkv_bias : c10::nullopt, fp4_block, fp4_scale_kind};
    l.kv_cache = kv_cache;
    layers.push_back(l);
  }

  // x: [B*Q, hidden] float32 (Q tokens per sequence: 1, or a speculative verification);
  // cos/sin_signed: [B*Q, 1, D]; slots: [B*L]; mask: [B, Q, 1, L] additive, or none.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor decode_slots, int64_t L, int64_t Q, c10::optional<torch::Tensor> mask) {
    const int64_t T = x.size(0), B = T / Q, G = H / Hkv, half = D / 2;
    const int64_t q_size = H * D, kv_size = Hkv * D;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    auto rope = [&](const torch::Tensor& t) {
      return at::addcmul(t * cos, at::roll(t, {half}, {-1}), sin);
    };
    for (const Layer& l : layers) {
      auto qkv = l.qkv(at::rms_norm(x, {x.size(1)}, l.input_norm, eps));
      torch::Tensor q, k;
      if (!l.q_norm.defined()) {
        auto qk = rope(qkv.narrow(1, 0, q_size + kv_size).view({T, H + Hkv, D}));
        q = qk.narrow(1, 0, H);
        k = qk.narrow(1, H, Hkv);
      } else {
        q = rope(at::rms_norm(qkv.narrow(1, 0, q_size).view({T, H, D}), {D}, l.q_norm, eps));
        k = rope(at::rms_norm(qkv.narrow(1, q_size, kv_size).view({T, Hkv, D}), {D}, l.k_norm, eps));
      }
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
      l.kv_cache.select(0, 0).index_copy_(1, slot_mapping, k.transpose(0, 1));
      l.kv_cache.select(0, 1).index_copy_(1, slot_mapping, v.transpose(0, 1));
      auto kv = l.kv_cache.index_select(2, decode_slots).view({2, Hkv, B, L, D});
      // one matmul batch entry per (kv head, sequence): [Hkv, B, Q*G, D]
      auto qg = q.reshape({B, Q, Hkv, G, D}).permute({2, 0, 1, 3, 4}).reshape({Hkv, B, Q * G, D});
      auto scores = at::matmul(qg, kv.select(0, 0).transpose(-1, -2));  // [Hkv, B, Q*G, L]
      if (mask) scores = scores.view({Hkv, B, Q, G, L}).add_(mask->view({1, B, Q, 1, L})).view({Hkv, B, Q * G, L});
      auto probs = at::softmax(scores * scale, -1);
      auto attn = at::matmul(probs, kv.select(0, 1)).view({Hkv, B, Q, G, D}).permute({1, 2, 0, 3, 4}).reshape({T, H * D});
      x = x + l.o(attn);
      auto gu = l.gate_up(at::rms_norm(x, {x.size(1)}, l.post_norm, eps));
      x = x + l.down(at::silu(gu.narrow(1, 0, F)) * gu.narrow(1, F, F));
    }
    return x;
  }

 private:
  int64_t H, Hkv, D, F;
  double eps;
  std::vector<Layer> layers;
};

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}
