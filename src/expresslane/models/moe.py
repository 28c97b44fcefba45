"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral): a router picks `top_k` of
`num_experts` SwiGLU experts per token and sums their outputs weighted by the router's
probabilities (renormalized over the chosen ones where `norm_topk_prob`).

Tokens are grouped by expert: one pair of matrix calls per expert that any token of the step
routed to, none for the others, so a batch-1 decode step reads only its `top_k` experts'
weights. This plain PyTorch path is the reference and the path on every device; on a CPU
whose kernels take every expert's weight (FP4, bf16 dot products, 4-bit integers) an expert
runs as one C++ call, and a batch-1 token's experts and their sum as one
(kernels/experts_cpu.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.kernels.constants import ExpertActivation
from expresslane.kernels.plan import ROW_INVARIANT
from expresslane.models.layers import make_linear

# The published checkpoints' names of one layer's router and experts, per architecture:
# (router, expert prefix, (gate, up, down) under it).
EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": (
        "mlp.gate.weight",
        "mlp.experts",
        ("gate_proj", "up_proj", "down_proj"),
    ),
    "MixtralForCausalLM": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts",
        ("w1", "w3", "w2"),
    ),
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    dense_layers: frozenset[int]  # layers with a plain MLP of the model's intermediate_size

    @classmethod
    def from_dict(cls, raw: dict, arch: str) -> MoEConfig | None:
        if arch not in EXPERT_NAMES:
            return None
        experts = raw.get("num_experts") or raw.get("num_local_experts")
        step = raw.get("decoder_sparse_step") or 1
        layers = range(raw["num_hidden_layers"])
        dense = {i for i in layers if (i + 1) % step} | set(raw.get("mlp_only_layers") or [])
        return cls(
            num_experts=experts,
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
            # Mixtral always renormalizes over the chosen experts
            norm_topk_prob=raw.get("norm_topk_prob", arch == "MixtralForCausalLM"),
            dense_layers=frozenset(dense),
        )

    def make_block(self, w: dict[str, torch.Tensor]) -> nn.Module:
        """One layer's block, from its weights (`router`, `experts.{e}.gate_up`, ...)."""
        return SparseMoE(self, w["router"], w)


def expert_weights(take, prefix: str, names: tuple[str, str, str], n: int) -> dict:
    """One layer's experts, `experts.{e}.gate_up` (gate and up fused) and `experts.{e}.down`.
    `take(name)` reads a checkpoint tensor."""
    gate, up, down = names
    out = {}
    for e in range(n):
        parts = [take(f"{prefix}.{e}.{gate}.weight"), take(f"{prefix}.{e}.{up}.weight")]
        out[f"experts.{e}.gate_up"] = torch.cat(parts)
        out[f"experts.{e}.down"] = take(f"{prefix}.{e}.{down}.weight")
    return out


class SparseMoE(nn.Module):
    """The experts are the engine's linears (models/layers.py), so on a CPU they take its
    prepared kernels (bf16 weights: the dot-product kernel) as a dense MLP's do; `bind_kernels`
    then hands them to the C++ expert block."""

    activation = ExpertActivation.SWIGLU
    alpha = limit = 0.0  # the clamped SwiGLU's (gpt-oss)

    def __init__(self, cfg: MoEConfig, router: torch.Tensor, w: dict[str, torch.Tensor]):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.ffn = cfg.intermediate_size
        self.router = nn.Parameter(router, requires_grad=False)  # [E, H]
        n = cfg.num_experts
        self.gate_up = nn.ModuleList(_linear(w, f"experts.{e}.gate_up") for e in range(n))
        self.down = nn.ModuleList(_linear(w, f"experts.{e}.down") for e in range(n))
        self.native = None  # the C++ expert block (kernels/experts.h), once bound

    def bind_kernels(self) -> None:
        """Run the experts in C++ where every expert linear runs a CPU kernel at every batch;
        call after the linears' `prepare_cpu`."""
        self.native = native_experts(self)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k])."""
        probs = F.linear(x, self.router).softmax(-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.expert(e, x)
        return self.down[e](self.activate(self.gate_up[e](x)))

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if x.shape[0] != 1:
            return self._grouped(x, weights, experts)
        if self.native is not None:
            return self.native.token(x, experts[0], weights[0])
        return self._one_token(x, weights[0], experts[0])

    def _grouped(self, x: torch.Tensor, weights, experts) -> torch.Tensor:
        flat = experts.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.gate_up)).tolist()
        tokens = order // self.top_k  # the token of each (token, choice) pair, by expert
        scale = weights.view(-1)[order, None]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                out.index_add_(0, rows, self.expert(e, x[rows]) * scale[start : start + n])
                start += n
        return out

    def _one_token(self, x: torch.Tensor, weights, experts) -> torch.Tensor:
        """A batch-1 step's token without the sort and the scatter: its experts summed in
        the order `_grouped` sums them (by expert), to the same floats."""
        out = None
        for e, w in sorted(zip(experts.tolist(), weights.tolist(), strict=True)):
            y = self.expert(e, x) * w
            out = y if out is None else out + y
        return out


def native_experts(block: SparseMoE):
    """The block's experts as the C++ `ExpertBlock`, or None where one of its linears runs no
    CPU kernel at every batch (no kernels, float weights, a GPU) or its experts' intermediate
    size is not a multiple of 8."""
    from expresslane.kernels import cpu_kernels

    linears = [*block.gate_up, *block.down]
    if block.ffn % 8 or any(m.path not in ROW_INVARIANT for m in linears):
        return None
    native = cpu_kernels().ExpertBlock(block.activation, block.ffn, block.alpha, block.limit)
    fmt = getattr(block.gate_up[0], "fmt", None)  # FP4's block size and scale kind
    layout = (fmt.block_size, fmt.kernel_scale_kind) if fmt is not None else (0, 0)
    for up, down in zip(block.gate_up, block.down, strict=True):
        native.add_expert(up.kernel_weights(), up.bias, down.kernel_weights(), down.bias, *layout)
    return native


def _linear(w: dict[str, torch.Tensor], name: str) -> nn.Module:
    return make_linear(w[name], w.get(f"{name}_bias"))  # biases: gpt-oss's experts
