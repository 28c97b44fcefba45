// The Python module: the kernels (kernels.h), the native step's class (layer_stack.h), the
// experts' (experts.h) and the integers shared with Python (constants.h; kernels/constants.py
// holds the same).
#include <torch/extension.h>

#include "constants.h"
#include "experts.h"
#include "layer_stack.h"
#include "kernels.h"

namespace {

using expresslane::ExpertActivation;
using expresslane::KVKind;
using expresslane::ScaleKind;
using expresslane::value;

// Kernels run without the GIL: the server's event loop renders other requests' outputs on
// another core while the engine thread is inside a step.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

void add_constants(pybind11::module& m) {
  m.attr("KV_KIND_PLAIN") = value(KVKind::kPlain);
  m.attr("KV_KIND_FP8") = value(KVKind::kFp8);
  m.attr("KV_KIND_FP4") = value(KVKind::kFp4);
  m.attr("KV_KIND_BF16") = value(KVKind::kBf16);
  m.attr("SCALE_KIND_E8M0") = value(ScaleKind::kE8M0);
  m.attr("SCALE_KIND_E4M3") = value(ScaleKind::kE4M3);
  m.attr("EXPERT_ACTIVATION_SWIGLU") = value(ExpertActivation::kSwiGLU);
  m.attr("EXPERT_ACTIVATION_CLAMPED_SWIGLU") = value(ExpertActivation::kClampedSwiGLU);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "each row's index of its first maximum, as torch.argmax (AVX2)", NoGil());
  m.def("decode_attention", &decode_attention, "attention of decode tokens over the paged KV cache (AVX2)", NoGil());
  m.def("prompt_attention", &prompt_attention, "tiled attention of prompt chunks over the paged KV cache", NoGil());
  pybind11::class_<LayerStack>(m, "LayerStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &LayerStack::add_layer)
      .def("forward", &LayerStack::forward, NoGil())
      .def("set_head", &LayerStack::set_head)
      .def("set_prompt_attention", &LayerStack::set_prompt_attention)
      .def("set_matrix_prompts", &LayerStack::set_matrix_prompts)
      .def("logits", &LayerStack::logits, NoGil())
      .def("set_greedy_vocab", &LayerStack::set_greedy_vocab)
      .def("greedy", &LayerStack::greedy, NoGil());
  pybind11::class_<ExpertBlock>(m, "ExpertBlock")
      .def(pybind11::init<int64_t, int64_t, double, double>())
      .def("add_expert", &ExpertBlock::add_expert)
      .def("expert", &ExpertBlock::expert, NoGil())
      .def("token", &ExpertBlock::token, NoGil());
  m.def("apply_token_bitmask", &apply_token_bitmask, "grammar masks: disallowed tokens' logits to -inf, in place", NoGil());
  m.def("sample_rows", &sample_rows, "one token per row: temperature, min_p, top_k, top_p, inverse transform", NoGil());
  m.def("filter_rows", &filter_rows, "the distribution sample_rows draws from: temperature, min_p, top_k, top_p", NoGil());
  m.def("draw_rows", &draw_rows, "one token per row of weights by inverse transform", NoGil());
  m.def("fp4_linear", &fp4_linear, "x (fp32) @ W^T (MXFP4/NVFP4 codes + block scales) + b (AVX2+FMA)", NoGil());
  m.def("int4_linear", &int4_linear, "x (fp32) @ W^T (4-bit integer blocks of 32: codes, scales, mins) + b (AVX2+FMA)", NoGil());
  m.def("half_linear", &half_linear, "x (fp32) @ W^T (bf16 or fp16) + b, for small batches (AVX2+FMA+F16C or AVX-512)", NoGil());
  m.def("bf16_dot_available", &bf16_dot_available, "whether this build has the AVX-512 BF16 dot-product linear");
  m.def("pack_bf16_dot", &pack_bf16_dot, "bf16 W [N, K] -> the bf16_dot_linear layout [N/16, K/2, 32]", NoGil());
  m.def("bf16_dot_linear", &bf16_dot_linear, "bf16(x) @ W^T (packed bf16) + b, float32 sums (AVX-512 BF16)", NoGil());
  m.def("f16_dot_available", &f16_dot_available, "whether this build has the AVX-512 float16 linear");
  m.def("pack_f16_dot", &pack_f16_dot, "float16 W [N, K] -> the f16_dot_linear layout [N/16, K, 16]", NoGil());
  m.def("f16_dot_linear", &f16_dot_linear, "x (fp32) @ W^T (packed float16) + b, float32 sums (AVX-512)", NoGil());
  m.def("write_kv", &write_kv, "K/V [T, Hkv, D] into a store's native() tensors as the native step writes them", NoGil());
  add_constants(m);
}
