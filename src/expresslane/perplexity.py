"""Perplexity of a model on the demo model's held-out corpus, through expresslane's own forward
pass (so quantized weights and KV formats are measured as they are served).

The corpus is the held-out split of the Python standard library that the demo model never saw
(listed in assets/demo/training.json): those files of the running interpreter, sorted, each
followed by the end-of-text token. The first `max_tokens` are scored in windows of `window`
tokens, each window predicting its own next tokens from its start (as in training). A window
is fed in chunks that read their context back from the KV cache, as serving does, so a
compressed `kv_cache_dtype` is measured too.
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import torch

from expresslane.demo import ASSETS
from expresslane.engine.request import Request
from expresslane.errors import InvalidRequestError
from expresslane.llm import LLM
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.sampling_params import SamplingParams


def heldout_text(eot: str = "<|endoftext|>") -> str:
    meta = json.loads((ASSETS / "training.json").read_text())["corpus"]
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(meta["heldout_files"])
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise InvalidRequestError(
            f"{len(missing)} held-out files are not in this Python's standard library "
            f"({root}); the corpus needs Python {meta['python']}"
        )
    return "".join((root / f).read_text(encoding="utf-8") + eot for f in files)


@torch.inference_mode()
def perplexity(
    llm: LLM, text: str, max_tokens: int = 100_000, window: int = 1024, chunk: int = 128
) -> dict:
    engine = llm.engine
    if engine.tokenizer is None:
        raise InvalidRequestError("perplexity needs a model with a tokenizer")
    room = engine.kv.num_blocks_at_once * engine.kv.block_size
    window = min(window, engine.max_model_len, room)
    ids = engine.tokenizer.encode(text, False)[: max_tokens + 1]
    # KV blocks for one window, taken from (and given back to) the engine's pool.
    holder = Request("perplexity", [0], SamplingParams(), max_tokens=1)
    if not engine.kv.allocate(holder, window):
        raise InvalidRequestError("the KV cache has no room for a scoring window")
    engine.runner.sync_window_map()
    slots = torch.from_numpy(engine.runner.slots(holder, 0, window)).to(engine.device)
    pos = torch.arange(window)
    nll, count = 0.0, 0
    try:
        for start in range(0, len(ids) - 1, window):
            tokens = torch.tensor(ids[start : start + window + 1], device=engine.device)
            for c0 in range(0, len(tokens) - 1, chunk):
                c1 = min(len(tokens) - 1, c0 + chunk)
                meta = AttentionMetadata(
                    slot_mapping=slots[c0:c1],
                    prefills=[PrefillChunk(0, c1 - c0, c1, slots[:c1])],
                )
                logits = engine.model(tokens[c0:c1], pos[c0:c1].to(engine.device), meta)
                target = tokens[c0 + 1 : c1 + 1]
                nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
                count += c1 - c0
    finally:
        engine.kv.release(holder)
    loss = nll / max(count, 1)
    return {"tokens": count, "loss": round(loss, 4), "perplexity": round(math.exp(loss), 3)}
