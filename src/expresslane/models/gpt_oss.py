"""gpt-oss (`GptOssForCausalLM`): the Llama block with biases on q/k/v/o, attention sinks
(models/sink_attention.py), sliding-window layers alternating with full ones (`layer_types`),
YaRN RoPE (models/rope.py), and a mixture of experts that differs from Mixtral's in three ways:

- the router has a bias, and the softmax is over the top-k logits only;
- each expert's gate and up projections are interleaved (gate in the even rows, up in the
  odd ones) and both projections have biases;
- the activation is a clamped SwiGLU: gate clamped above and up on both sides at `limit`,
  then (up + 1) * gate * sigmoid(alpha * gate).

The checkpoint stacks each layer's experts: `mlp.experts.gate_up_proj` [E, H, 2I] and
`down_proj` [E, I, H] (inputs first), or, as OpenAI publishes it, their MXFP4 blocks and
scales (quant/mxfp4_experts.py), which stay 4-bit in the engine's FP4 linears.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.kernels.constants import ExpertActivation
from expresslane.models.moe import MoEConfig, SparseMoE
from expresslane.quant.mxfp4_experts import GPT_OSS

ARCHITECTURE = GPT_OSS


@dataclass(frozen=True)
class GptOssMoEConfig(MoEConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def make_block(self, w: dict[str, torch.Tensor]) -> nn.Module:
        return GptOssMoE(self, w)


def settings(raw: dict) -> dict:
    """The `ModelConfig` fields a gpt-oss config.json sets beyond the Llama block's."""
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = raw.get("sliding_window")
    return {
        "layer_windows": [window if t == "sliding_attention" else None for t in types],
        "moe": GptOssMoEConfig(
            num_experts=raw["num_local_experts"],
            top_k=raw.get("num_experts_per_tok") or raw["experts_per_token"],
            intermediate_size=raw["intermediate_size"],
            norm_topk_prob=True,
            dense_layers=frozenset(),
            swiglu_alpha=raw.get("swiglu_alpha", 1.702),
            swiglu_limit=raw.get("swiglu_limit", 7.0),
        ),
    }


def layer_weights(take, names, p: str, num_experts: int, linear_dtype: torch.dtype) -> dict:
    """Layer `p`'s router (weight, bias) and experts as the engine's linears take them:
    `experts.{e}.gate_up` ([2I, H], interleaved as stored), `experts.{e}.down` ([H, I]) and
    their biases. `take(name, dtype)` reads a tensor of the checkpoint's `names`; the experts'
    weights come stacked (transposed here) or as one `Fp4Weight` per expert (`{name}.{e}`,
    quant/mxfp4_experts.py)."""
    out = {"router": take(p + "mlp.router.weight"), "router_bias": take(p + "mlp.router.bias")}
    experts = p + "mlp.experts."
    for proj, name in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        weights = _per_expert(take, names, experts + proj, num_experts, linear_dtype)
        biases = take(experts + proj + "_bias")
        for e in range(num_experts):
            out[f"experts.{e}.{name}"] = weights[e]
            out[f"experts.{e}.{name}_bias"] = biases[e]
    return out


def _per_expert(take, names, name: str, n: int, linear_dtype: torch.dtype) -> list:
    if name not in names:
        return [take(f"{name}.{e}") for e in range(n)]  # FP4, stored [out, in]
    stacked = take(name, linear_dtype)  # [E, in, out]
    return [stacked[e].T.contiguous() for e in range(n)]


class GptOssMoE(SparseMoE):
    activation = ExpertActivation.CLAMPED_SWIGLU

    def __init__(self, cfg: GptOssMoEConfig, w: dict[str, torch.Tensor]):
        super().__init__(cfg, w["router"], w)
        self.router_bias = nn.Parameter(w["router_bias"], requires_grad=False)
        self.alpha = cfg.swiglu_alpha
        self.limit = cfg.swiglu_limit

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.router, self.router_bias)
        top, experts = logits.topk(self.top_k, dim=-1)
        return top.softmax(-1, dtype=torch.float32).to(x.dtype), experts

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
