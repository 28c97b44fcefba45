"""`expresslane perplexity`: the engine's own forward pass scores text like transformers does."""

from __future__ import annotations

import json

import pytest
import torch

from expresslane import LLM
from expresslane.cli import main
from expresslane.perplexity import perplexity

from .conftest import reference_perplexity

transformers = pytest.importorskip("transformers")


def test_perplexity_matches_transformers(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32")
    text = (llama_dir / "tokenizer.json").read_text()[:6000]
    result = perplexity(llm, text, max_tokens=700, window=256)
    ids = llm.tokenizer.encode(text, False)[:701]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    assert result["tokens"] == 700
    expected = reference_perplexity(model, ids, 700, 256)
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_perplexity_command_on_the_demo_corpus(capsys):
    assert main(["perplexity", "--max-tokens", "600", "--window", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 600 and out["perplexity"] > 1
