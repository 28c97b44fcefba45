// A linear layer as the C++ modules run it (the layer stack, layer_stack.h; the expert
// blocks, experts.h): its weight in the layout of the kernel that takes it, dispatched by that
// layout. Defined in layer_stack_cpu.cpp.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace expresslane {

// A step's prompt rows (positions before their sequence's prompt end) when the matrix path
// takes them: all of the step's rows, or these (int64 indices) beside the others.
struct PromptRows {
  bool active = false, all = false;
  torch::Tensor prompt, other;
};

// A bf16 weight: [N, K] (gemv_cpu.cpp) or packed for bf16 dot products, [N/16, K/2, 32]
// (bf16dot_cpu.cpp); FP4 codes + block scale bytes + row scales (see fp4_cpu.cpp); or integer
// codes + float16/float32 block scales + block mins (int4_cpu.cpp; mins empty: none). `matrix`:
// the plain bf16 weight [N, K] for prompt rows in oneDNN's bf16 matmul (undefined: none).
struct Linear {
  std::vector<torch::Tensor> w;
  c10::optional<torch::Tensor> bias;
  int64_t block = 0, scale_kind = 0;
  torch::Tensor matrix;
  torch::Tensor operator()(const torch::Tensor& x) const;
  // Prompt rows in the matrix path where `rows` is active, the others in the row kernel.
  torch::Tensor operator()(const torch::Tensor& x, const PromptRows& rows) const;
};

}  // namespace expresslane
