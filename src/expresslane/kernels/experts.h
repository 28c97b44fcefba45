// One layer's experts of a mixture (models/moe.py) as C++ calls (experts_cpu.cpp): an expert's
// gate_up linear, its activation and its down linear in one call, and a decode token's routed
// experts summed in one. Bound to Python as ExpertBlock (bindings.cpp).
#pragma once
#include <torch/extension.h>

#include <vector>

#include "linear.h"

class ExpertBlock {
 public:
  // activation: an ExpertActivation (constants.h); ffn: each expert's intermediate size (a
  // multiple of 8); alpha, limit: gpt-oss's clamped SwiGLU's.
  ExpertBlock(int64_t activation, int64_t ffn, double alpha, double limit);

  // The next expert's linears, each its weight as the kernels take it (linear.h); fp4_block /
  // fp4_scale_kind describe FP4 weights.
  void add_expert(std::vector<torch::Tensor> gate_up, c10::optional<torch::Tensor> gate_up_bias,
                  std::vector<torch::Tensor> down, c10::optional<torch::Tensor> down_bias, int64_t fp4_block,
                  int64_t fp4_scale_kind);

  // Expert e on rows x (float32 [M, hidden]): down(activation(gate_up(x))).
  torch::Tensor expert(int64_t e, torch::Tensor x) const;

  // One token (x float32 [1, hidden]): its routed experts' outputs times their weights
  // (float32 [k]), summed in the order of the experts' ids, as SparseMoE._one_token sums them.
  torch::Tensor token(torch::Tensor x, torch::Tensor experts, torch::Tensor weights) const;

 private:
  int64_t activation, F;
  float alpha, limit;
  std::vector<expresslane::Linear> gate_up, down;
};
