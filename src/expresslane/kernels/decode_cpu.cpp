// The batch-of-single-tokens decode step of the Llama-family model as one C++ call.
//
// At decode batch sizes a layer is ~45 small tensor operations; issued from Python each one
// pays interpreter and binding overhead that adds up to several milliseconds per step for a
// 30-layer model, as much as streaming the weights. This replays exactly the operations of
// expresslane.models.llama.DecoderLayer + PagedAttention._decode (float32 activations, bf16
// linear weights through the AVX2 kernel of gemv_cpu.cpp) without going back to Python.
// The Python code is the reference it is tested against.
#include <torch/extension.h>

#include <vector>

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

namespace {

struct Linear {
  torch::Tensor weight;  // bf16 [N, K]
  c10::optional<torch::Tensor> bias;
  torch::Tensor operator()(const torch::Tensor& x) const { return bf16_linear(x, weight, bias); }
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

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
                 torch::Tensor o, torch::Tensor gate_up, torch::Tensor down, torch::Tensor kv_cache) {
    Layer l;
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    if (q_norm) l.q_norm = *q_norm;
    if (k_norm) l.k_norm = *k_norm;
    l.qkv = {qkv, qkv_bias};
    l.o = {o, c10::nullopt};
    l.gate_up = {gate_up, c10::nullopt};
    l.down = {down, c10::nullopt};
    l.kv_cache = kv_cache;
    layers.push_back(l);
  }

  // x: [B, hidden] float32; cos/sin_signed: [B, 1, D]; slots: [B*L]; mask: [B, 1, 1, L] or none.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor decode_slots, int64_t L, c10::optional<torch::Tensor> mask) {
    const int64_t B = x.size(0), G = H / Hkv, half = D / 2;
    const int64_t q_size = H * D, kv_size = Hkv * D;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    auto rope = [&](const torch::Tensor& t) {
      return at::addcmul(t * cos, at::roll(t, {half}, {-1}), sin);
    };
    for (const Layer& l : layers) {
      auto qkv = l.qkv(at::rms_norm(x, {x.size(1)}, l.input_norm, eps));
      torch::Tensor q, k;
      if (!l.q_norm.defined()) {
        auto qk = rope(qkv.narrow(1, 0, q_size + kv_size).view({B, H + Hkv, D}));
        q = qk.narrow(1, 0, H);
        k = qk.narrow(1, H, Hkv);
      } else {
        q = rope(at::rms_norm(qkv.narrow(1, 0, q_size).view({B, H, D}), {D}, l.q_norm, eps));
        k = rope(at::rms_norm(qkv.narrow(1, q_size, kv_size).view({B, Hkv, D}), {D}, l.k_norm, eps));
      }
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, Hkv, D});
      l.kv_cache.select(0, 0).index_copy_(1, slot_mapping, k.transpose(0, 1));
      l.kv_cache.select(0, 1).index_copy_(1, slot_mapping, v.transpose(0, 1));
      auto kv = l.kv_cache.index_select(2, decode_slots).view({2, Hkv, B, L, D});
      auto qg = q.reshape({B, Hkv, G, D}).transpose(0, 1);  // [Hkv, B, G, D]
      auto scores = at::matmul(qg, kv.select(0, 0).transpose(-1, -2));
      if (mask) scores.add_(mask->view({B, 1, L}));  // broadcasts over [Hkv, B, G, L]
      auto probs = at::softmax(scores * scale, -1);
      auto attn = at::matmul(probs, kv.select(0, 1)).transpose(0, 1).reshape({B, H * D});
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
