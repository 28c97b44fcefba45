// A mixture's experts as C++ calls (experts.h). At batch 1 an expert's gate_up and down
// linears read ~1M weights each; from Python every expert also paid for its activation as
// six ATen ops and its weighting and sum as two more, each a dispatch and an allocation. Here
// the linears take the layer stack's kernels (linear.h) and the rest are loops over the rows
// (decode_ops.h), so the Python path (models/moe.py) is the reference this is tested against.
#include <torch/extension.h>

#include <algorithm>
#include <utility>

#include "constants.h"
#include "decode_ops.h"
#include "experts.h"

using expresslane::ExpertActivation;
using expresslane::Linear;

ExpertBlock::ExpertBlock(int64_t activation, int64_t ffn, double alpha, double limit)
    : activation(activation), F(ffn), alpha(static_cast<float>(alpha)), limit(static_cast<float>(limit)) {
  TORCH_CHECK(activation == expresslane::value(ExpertActivation::kSwiGLU) ||
                  activation == expresslane::value(ExpertActivation::kClampedSwiGLU),
              "activation: an ExpertActivation");
  TORCH_CHECK(F % 8 == 0, "ffn a multiple of 8");
}

void ExpertBlock::add_expert(std::vector<torch::Tensor> gate_up_w, c10::optional<torch::Tensor> gate_up_bias,
                             std::vector<torch::Tensor> down_w, c10::optional<torch::Tensor> down_bias,
                             int64_t fp4_block, int64_t fp4_scale_kind) {
  gate_up.push_back(Linear{gate_up_w, gate_up_bias, fp4_block, fp4_scale_kind, {}});
  down.push_back(Linear{down_w, down_bias, fp4_block, fp4_scale_kind, {}});
}

torch::Tensor ExpertBlock::expert(int64_t e, torch::Tensor x) const {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: float32 [M, hidden]");
  TORCH_CHECK(e >= 0 && e < static_cast<int64_t>(gate_up.size()), "expert id");
  const auto gu = gate_up[e](x);
  const int64_t M = x.size(0);
  auto h = torch::empty({M, F}, x.options());
  const float* g = gu.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    if (activation == expresslane::value(ExpertActivation::kSwiGLU))
      expresslane::ops::silu_mul(g + m * 2 * F, g + m * 2 * F + F, hp + m * F, F);
    else
      expresslane::ops::clamped_swiglu(g + m * 2 * F, hp + m * F, F, alpha, limit);
  }
  return down[e](h);
}

torch::Tensor ExpertBlock::token(torch::Tensor x, torch::Tensor experts, torch::Tensor weights) const {
  TORCH_CHECK(x.size(0) == 1, "one token");
  const auto ids = experts.to(torch::kInt64).contiguous();
  const auto w = weights.to(torch::kFloat32).contiguous();
  TORCH_CHECK(ids.numel() == w.numel() && ids.numel() > 0, "experts and weights: [k]");
  std::vector<std::pair<int64_t, float>> chosen;
  for (int64_t i = 0; i < ids.numel(); ++i) chosen.emplace_back(ids.data_ptr<int64_t>()[i], w.data_ptr<float>()[i]);
  std::sort(chosen.begin(), chosen.end());
  torch::Tensor out;
  for (const auto& [e, weight] : chosen) {
    auto y = expert(e, x);
    float* yp = y.data_ptr<float>();
    const int64_t n = y.numel();
    if (!out.defined()) {
      for (int64_t i = 0; i < n; ++i) yp[i] *= weight;
      out = y;
      continue;
    }
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) op[i] += yp[i] * weight;  // two roundings, as out + y * w
  }
  return out;
}
