"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) over a paged KV cache.

Weights arrive already fused by the loader: one QKV projection and one gate/up projection per
layer, so a layer is five matmuls. The forward takes a flattened batch of tokens from many
sequences; per-step attention metadata travels in `AttentionMetadata`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.kernels import linear_choice
from expresslane.kernels.constants import ScaleKind
from expresslane.kernels.linear_choice import PromptLinears
from expresslane.kernels.plan import STACK_PATHS, ExecutionPlan, LinearPath
from expresslane.models.attention import AttentionMetadata, PagedAttention
from expresslane.models.config import ModelConfig
from expresslane.models.kv_store import PlainKV
from expresslane.models.layers import RMSNorm, Rotary, apply_rope, make_linear
from expresslane.models.moe import SparseMoE
from expresslane.models.rope import plain_inv_freq, rope_frequencies
from expresslane.models.sink_attention import SinkAttention
from expresslane.quant.linear import Fp4Linear


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], window: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.input_norm = RMSNorm(w["input_norm"], cfg.rms_norm_eps)
        self.qkv = make_linear(w["qkv"], w.get("qkv_bias"))
        self.o = make_linear(w["o"], w.get("o_bias"))
        self.post_norm = RMSNorm(w["post_norm"], cfg.rms_norm_eps)
        # Gemma's sandwich: norms on the attention's and the MLP's outputs too
        self.post_attn_norm = self.post_ffn_norm = None
        if cfg.sandwich_norms:
            self.post_attn_norm = RMSNorm(w["post_attn_norm"], cfg.rms_norm_eps)
            self.post_ffn_norm = RMSNorm(w["post_ffn_norm"], cfg.rms_norm_eps)
        self.act = F.silu if cfg.activation == "silu" else partial(F.gelu, approximate="tanh")
        self.moe = None  # a mixture of experts in place of gate_up/down (models/moe.py)
        if "router" in w:
            self.moe = cfg.moe.make_block(w)
        else:
            self.gate_up = make_linear(w["gate_up"])
            self.down = make_linear(w["down"])
        self.q_norm = RMSNorm(w["q_norm"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(w["k_norm"], cfg.rms_norm_eps) if cfg.qk_norm else None
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window)
        sinks = w.get("sinks")  # gpt-oss's attention sinks
        self.attn = PagedAttention(*heads) if sinks is None else SinkAttention(*heads, sinks)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.ffn = cfg.intermediate_size

    def linears(self) -> list[nn.Module]:
        """qkv, o, gate_up, down: the order the layer stack takes them in (no gate_up and
        down in a layer of experts)."""
        mlp = [] if self.moe is not None else [self.gate_up, self.down]
        return [self.qkv, self.o, *mlp]

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv(self.input_norm(x))
        if self.q_norm is None:
            # RoPE on q and k together: they are adjacent in the fused projection.
            qk = apply_rope(
                qkv[:, : self.q_size + self.kv_size].view(T, H + Hkv, D), cos, sin, D // 2
            )
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = apply_rope(self.q_norm(qkv[:, : self.q_size].view(T, H, D)), cos, sin, D // 2)
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(T, Hkv, D))
            k = apply_rope(k, cos, sin, D // 2)
        v = qkv[:, self.q_size + self.kv_size :].view(T, Hkv, D)
        if cfg.query_scale != 1.0:
            q = q * cfg.query_scale
        h = self.o(self.attn(q, k, v, meta))
        x = x + (h if self.post_attn_norm is None else self.post_attn_norm(h))
        h = self.post_norm(x)
        if self.moe is not None:
            h = self.moe(h)
        else:
            gu = self.gate_up(h)
            h = self.down(self.act(gu[:, : self.ffn]) * gu[:, self.ffn :])
        return x + (h if self.post_ffn_norm is None else self.post_ffn_norm(h))


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int,
    ):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype  # the compute dtype
        self.embed = nn.Parameter(weights["embed"], requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")},
                cfg.layer_windows[i] if cfg.layer_windows else None,
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(weights["norm"], cfg.rms_norm_eps)
        self.lm_head = make_linear(weights["lm_head"])
        inv_freq, attention_factor = rope_frequencies(cfg, max_positions)
        self.rotary = Rotary(inv_freq, max_positions, dtype, attention_factor)
        self.local_rotary = None  # the sliding-window layers' own RoPE (Gemma 3)
        if cfg.local_rope_theta is not None:
            local = plain_inv_freq(cfg.local_rope_theta, cfg.head_dim)
            self.local_rotary = Rotary(local, max_positions, dtype)
        self.layer_stack = None  # the C++ layer stack (kernels/layer_stack_cpu.cpp), once bound
        self.plan: ExecutionPlan | None = None  # which kernels run each step, once bound
        self.batch_invariant = False  # ask the plan for row-invariant kernels in every step
        self.allow_stack = True  # False for a tensor-parallel shard: the stack cannot all-reduce
        self.prompt_linears = linear_choice.ROW_KERNEL  # measured in prepare_cpu

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def prepare_cpu(self, compute_dtype: torch.dtype) -> None:
        """Lay out linear weights for the CPU kernels (see `Linear.prepare_cpu`): the first
        layer's first, with their bf16 matrices, to choose which kernel prompt rows take
        (kernels/linear_choice.py); then the rest, with matrices only if that is oneDNN; then
        the mixtures' experts to their C++ block (models/moe.py)."""
        first = self.layers[0].linears()
        for m in first:
            m.prepare_cpu(compute_dtype, keep_matrix=self.allow_stack)  # for the stack only
        self.prompt_linears = _choose_prompt_linears(first)
        keep = self.prompt_linears.matrix_rows is not None
        for m in first:
            m.matrix = m.matrix if keep else None
        prepared = {id(m) for m in first}
        layer_linears = {id(m) for m in self.layer_linears()}
        for m in self.modules():
            if m is self or id(m) in prepared or not hasattr(m, "prepare_cpu"):
                continue
            if id(m) in layer_linears:
                m.prepare_cpu(compute_dtype, keep_matrix=keep)
            else:
                m.prepare_cpu(compute_dtype)
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.bind_kernels()

    def bind_kv_cache(self, caches: list) -> None:
        """One KV store per layer (models/kv_store.py); plain tensors are wrapped."""
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.attn.kv = PlainKV.wrap(cache) if isinstance(cache, torch.Tensor) else cache
        self.layer_stack = build_layer_stack(self)
        self.plan = ExecutionPlan.of(
            self.dtype,
            type(self.layers[0].attn.kv).__name__,
            self.lm_head.path,
            [m.path for m in self.layer_linears()],
            self.layer_stack is not None,
            self.layers[0].attn.tiled_prompts(self.dtype),
            self.batch_invariant,
            self.prompt_linears,
        )
        for layer in self.layers:
            layer.attn.bf16_prompts = self.plan.bf16_prompts
        if self.layer_stack is not None:
            self.layer_stack.set_prompt_attention(self.plan.tiled_prompts, self.plan.bf16_prompts)
            self._set_matrix_prompts()

    def _set_matrix_prompts(self) -> None:
        """Hand the plain bf16 weights to the stack where the plan sends prompt rows to
        oneDNN; else free them."""
        rows = self.plan.matrix_prompt_rows
        weights = [[m.matrix for m in la.linears()] for la in self.layers]
        if rows and all(w is not None for ws in weights for w in ws):
            self.layer_stack.set_matrix_prompts(rows, weights)
            return
        for m in self.layer_linears():
            m.matrix = None

    def layer_linears(self) -> list[nn.Module]:
        return [m for layer in self.layers for m in layer.linears()]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` (all tokens if None)."""
        x = F.embedding(input_ids, self.embed)
        if self.cfg.embed_scale != 1.0:  # in the weights' dtype, as transformers rounds it
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary.tables(positions)
        local = cos, sin
        if self.local_rotary is not None:
            local = self.local_rotary.tables(positions)
        decode_only = meta.num_decode_tokens == x.shape[0]
        if self.plan.uses_stack(x.shape[0], decode_only):
            q_lens, starts, slots, ctx, ends = meta.sequences()
            x = self.layer_stack.forward(
                x, cos, sin, meta.slot_mapping, slots, ctx, q_lens, starts, ends
            )
            if self.plan.native_head:  # the final norm and the head in the same native module
                return self.layer_stack.logits(x, logits_indices)
        else:
            for layer in self.layers:
                x = layer(x, *(local if layer.attn.window else (cos, sin)), meta)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self.norm(x)).float()

    def set_greedy_vocab(
        self, head_rows: torch.Tensor, ids: torch.Tensor, compute_dtype: torch.dtype
    ) -> None:
        """`greedy` picks among the tokens `ids` only (sorted), scoring them with
        `head_rows`, the output head's weight rows for those tokens. Needs `plan.native_head`.
        The rows are padded to a multiple of 16 (ignored by the argmax) so that they take the
        output head's own kernel: each token's logit is then the one the whole head gives."""
        pad = -head_rows.shape[0] % 16
        head_rows = torch.cat([head_rows, head_rows.new_zeros(pad, head_rows.shape[1])])
        head = make_linear(head_rows)
        head.prepare_cpu(compute_dtype)
        self.layer_stack.set_greedy_vocab(head.kernel_weights(), ids)

    @torch.inference_mode()
    def greedy(
        self,
        unseen: list[list[int]],
        starts: list[int],
        prompt_ends: list[int],
        slots: torch.Tensor,
        steps: int,
    ):
        """`steps` greedy tokens per sequence in one native call (a draft model's proposals).
        unseen[i]: the tokens of sequence i past its starts[i] cached ones; prompt_ends[i]: its
        prompt's length; slots: [B, L] of positions 0..L-1, L >= max(starts + len(unseen)) +
        steps - 1. Needs `plan.native_head`."""
        return self.layer_stack.greedy(
            [torch.tensor(u) for u in unseen],
            torch.tensor(starts),
            torch.tensor(prompt_ends),
            slots.reshape(-1),
            slots.shape[1],
            steps,
            self.rotary.cos,
            self.rotary.sin_signed,
            self.cfg.vocab_size,
        )


def _choose_prompt_linears(first: list[nn.Module]) -> PromptLinears:
    """Where a layer's linears run a row-invariant CPU kernel and kept their bf16 matrices:
    measured (or cached) against oneDNN on those; else the row kernel."""
    paths = {m.path for m in first}
    if any(m.matrix is None for m in first) or len(paths) != 1:
        return linear_choice.ROW_KERNEL
    (path,) = paths
    kind = f"{path} {first[0].fmt.name}" if path is LinearPath.FP4_W4A8 else str(path)
    return linear_choice.choose(kind, [m.matrix for m in first], [m.forward for m in first])


def build_layer_stack(model: LlamaModel):
    """The C++ layer stack (kernels/layer_stack_cpu.cpp) when every layer linear runs a CPU kernel
    (bf16 or FP4); None otherwise (then the Python layers run)."""
    layers = model.layers
    linears = model.layer_linears()
    cfg = model.cfg
    if not model.allow_stack:
        return None
    if cfg.moe is not None or cfg.sandwich_norms or cfg.layer_windows or cfg.query_scale != 1:
        return None  # the stack runs the Llama block only: dense, whole context, silu
    if any(layer.o.bias is not None for layer in layers):
        return None  # nor an output projection's bias (Llama's `attention_bias`)
    if not linears or any(m.path not in STACK_PATHS for m in linears):
        return None
    caches = [layer.attn.kv.native() for layer in layers]
    if any(c is None for c in caches):
        return None  # a KV store the layer stack does not read: the Python layers run
    cfg = model.cfg
    if any(n % 8 for n in (cfg.head_dim, cfg.hidden_size, cfg.intermediate_size)):
        return None  # the layer stack works on rows of multiples of 8
    from expresslane.kernels import cpu_kernels

    fp4 = [m for m in linears if isinstance(m, Fp4Linear)]
    block = fp4[0].fmt.block_size if fp4 else 0  # 0: bf16 linears, no blocks
    kind = fp4[0].fmt.kernel_scale_kind if fp4 else ScaleKind.E8M0  # read only with FP4
    stack = cpu_kernels().LayerStack(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
    )
    for layer, cache in zip(layers, caches, strict=True):
        stack.add_layer(
            layer.input_norm.weight,
            layer.post_norm.weight,
            None if layer.q_norm is None else layer.q_norm.weight,
            None if layer.k_norm is None else layer.k_norm.weight,
            [m.kernel_weights() for m in layer.linears()],
            layer.qkv.bias,
            cache,
            layer.attn.kv.NATIVE_KIND,
            block,
            kind,
        )
    head = model.lm_head.kernel_weights()
    if head is not None:
        fmt = getattr(model.lm_head, "fmt", None)
        stack.set_head(
            model.embed,
            model.norm.weight,
            head,
            fmt.block_size if fmt else 0,
            fmt.kernel_scale_kind if fmt else ScaleKind.E8M0,
        )
    return stack
