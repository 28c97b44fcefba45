"""Tensor parallelism's split of a model: which part of each weight a rank holds. Attention
heads and MLP columns are split, KV heads split or, when there are fewer than ranks,
replicated; vocabulary rows split for the embedding and the output head (padded to one size,
so that logits gather in one call). FP4 output projections split by their output rows
(`gathered`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from expresslane.errors import ModelLoadError
from expresslane.models.config import ModelConfig
from expresslane.quant.linear import Fp4Weight

ROW_ALIGN = 16  # vocabulary rows per rank rounded to this: the packed kernels take 16-row blocks
# The architectures whose every weight `Shard` knows how to split (a new one is refused until
# its layers are checked: its weights may hold parts this file does not split)
SPLIT_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
)


def _splittable(w) -> None:
    if not isinstance(w, torch.Tensor | Fp4Weight):
        raise ModelLoadError("tensor parallelism does not split GGUF 4-bit weights yet")


def _rows(w, index: torch.Tensor):
    _splittable(w)
    if isinstance(w, Fp4Weight):
        return Fp4Weight(w.fmt, w.packed[index], w.scales[index], w.row_scales[index])
    return w[index].contiguous()


def _columns(w, start: int, end: int):
    _splittable(w)
    if isinstance(w, Fp4Weight):
        block = w.fmt.block_size
        if start % block or end % block:
            raise ModelLoadError(
                f"tensor parallelism splits an FP4 weight at column {start}, not a multiple of "
                f"its {block}-value blocks: choose a smaller tensor_parallel_size"
            )
        packed = w.packed[:, start // 2 : end // 2].contiguous()
        scales = w.scales[:, start // block : end // block].contiguous()
        return Fp4Weight(w.fmt, packed, scales, w.row_scales)
    return w[:, start:end].contiguous()


def _pad_rows(w, rows: int):
    """`w` with zero rows appended up to `rows`."""
    extra = rows - (w.packed.shape[0] if isinstance(w, Fp4Weight) else w.shape[0])
    if not extra:
        return w
    if isinstance(w, Fp4Weight):
        return Fp4Weight(
            w.fmt,
            torch.cat([w.packed, w.packed.new_zeros(extra, w.packed.shape[1])]),
            torch.cat([w.scales, w.scales.new_zeros(extra, w.scales.shape[1])]),
            torch.cat([w.row_scales, w.row_scales.new_zeros(extra)]),
        )
    return torch.cat([w, w.new_zeros(extra, w.shape[1])])


def gathered(kind: str, w) -> bool:
    """Whether an output projection (attention `o`, MLP `down`) is split by its output rows,
    its input and output gathered, rather than by its input columns with its partial sums
    all-reduced: FP4 ones, whose every output is then computed as one process computes it
    (a sum of partial sums in another order moves the next linear's int8 activation rounding,
    and with it the tokens at near ties)."""
    return kind in ("o", "down") and isinstance(w, Fp4Weight)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`."""

    rank: int
    size: int

    def check(self, cfg: ModelConfig) -> None:
        """Raise ModelLoadError where this model does not split over `size` ranks."""
        n, h, kv = self.size, cfg.num_heads, cfg.num_kv_heads
        if cfg.architecture not in SPLIT_ARCHITECTURES:
            raise ModelLoadError(f"tensor parallelism does not split {cfg.architecture} yet")
        columns = [cfg.intermediate_size, *([cfg.moe.intermediate_size] if cfg.moe else [])]
        if h % n or (kv % n and n % kv) or any(c % n for c in [*columns, cfg.hidden_size]):
            raise ModelLoadError(
                f"tensor_parallel_size {n} does not divide this model: {h} attention heads, "
                f"{kv} KV heads (or a multiple of them), MLP columns {columns}, hidden size "
                f"{cfg.hidden_size}"
            )

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank runs it: its heads, KV heads and MLP columns."""
        moe = cfg.moe
        if moe is not None:  # every expert's columns split as a dense MLP's are
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size)
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // self.size,
            num_kv_heads=max(cfg.num_kv_heads // self.size, 1),
            intermediate_size=cfg.intermediate_size // self.size,
            moe=moe,
        )

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(first token, end, rows per rank padded) of this rank's vocabulary part."""
        per = -(-vocab_size // self.size)
        per = -(-per // ROW_ALIGN) * ROW_ALIGN
        first = min(self.rank * per, vocab_size)
        return first, min(first + per, vocab_size), per

    def weights(self, cfg: ModelConfig, weights: dict) -> dict:
        """This rank's part of the loader's fused weights (models/loader.py)."""
        first, end, per = self.vocab_rows(cfg.vocab_size)
        embed = weights["embed"][first:end]
        out = {
            # one zero row past the part: where the tokens of the other ranks' parts look up
            "embed": torch.cat([embed, embed.new_zeros(1, embed.shape[1])]),
            "lm_head": _pad_rows(_rows(weights["lm_head"], torch.arange(first, end)), per),
            "norm": weights["norm"],
        }
        for name, w in weights.items():
            if name.startswith("layers."):
                ffn = cfg.moe.intermediate_size if ".experts." in name else cfg.intermediate_size
                kind = name.rsplit(".", 1)[1]
                if gathered(kind, w) and ".experts." not in name:
                    out[name] = self._output_rows(w, cfg.hidden_size)
                elif kind == "o_bias":
                    out[name] = self._o_bias(cfg, w, weights[name[: -len("_bias")]])
                else:
                    out[name] = self._layer_weight(cfg, kind, w, ffn)
        return out

    def _o_bias(self, cfg: ModelConfig, bias: torch.Tensor, weight) -> torch.Tensor:
        """The output projection's bias: its rows where the projection is split by rows;
        else rank 0's alone (the ranks' partial sums are all-reduced: added once)."""
        if gathered("o", weight):
            return self._output_rows(bias, cfg.hidden_size)
        return bias if self.rank == 0 else torch.zeros_like(bias)

    def _output_rows(self, w, rows: int):
        """This rank's part of an output projection split by its output rows."""
        per = rows // self.size
        return _rows(w, torch.arange(self.rank * per, (self.rank + 1) * per))

    def _layer_weight(self, cfg: ModelConfig, kind: str, w, ffn: int):
        """Part of a layer's weight of this `kind` (the last part of its name); `ffn`: the
        columns of the MLP (or expert) it belongs to."""
        if kind in ("qkv", "qkv_bias"):
            return _rows(w, self._qkv_rows(cfg))
        if kind == "o":
            per = cfg.num_heads // self.size * cfg.head_dim
            return _columns(w, self.rank * per, (self.rank + 1) * per)
        per = ffn // self.size
        lo, hi = self.rank * per, (self.rank + 1) * per
        if kind == "gate_up":
            return _rows(w, torch.cat([torch.arange(lo, hi), ffn + torch.arange(lo, hi)]))
        if kind == "down":
            return _columns(w, lo, hi)
        return w  # norms, a router: every rank has them whole

    def _qkv_rows(self, cfg: ModelConfig) -> torch.Tensor:
        """Rows of the fused q, k, v projection: this rank's q heads and KV heads."""
        d, n, r = cfg.head_dim, self.size, self.rank
        q_heads = cfg.num_heads // n
        kv_heads = max(cfg.num_kv_heads // n, 1)
        kv_first = r * cfg.num_kv_heads // n  # with fewer KV heads than ranks: shared
        q = torch.arange(r * q_heads * d, (r + 1) * q_heads * d)
        k0 = cfg.num_heads * d + kv_first * d
        k = torch.arange(k0, k0 + kv_heads * d)
        v = k + cfg.num_kv_heads * d
        return torch.cat([q, k, v])
