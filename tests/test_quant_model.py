"""FP4 checkpoints end to end: `expresslane quantize`, loading, and the quantized forward
pass against transformers running the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from expresslane import LLM, SamplingParams
from expresslane.cli import main
from expresslane.errors import InvalidRequestError
from expresslane.models import load_model
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.quant.formats import FORMATS, Fp4Tensor

from .conftest import random_prompts

transformers = pytest.importorskip("transformers")


def dequantized_copy(qdir, out):
    """The FP4 checkpoint's weights expanded back to float32, as a plain HF checkpoint."""
    config = json.loads((qdir / "config.json").read_text())
    fmt = FORMATS[config.pop("quantization_config")["format"]]
    raw = load_file(qdir / "model.safetensors")
    plain = {}
    for name in list(raw):
        if name.endswith(".weight_packed"):
            stem = name.removesuffix(".weight_packed")
            scale = raw.get(stem + ".weight_tensor_scale")
            t = Fp4Tensor(
                fmt, raw[name], raw[stem + ".weight_scale"], 1.0 if scale is None else float(scale)
            )
            plain[stem + ".weight"] = t.dequantize()
        elif not name.endswith((".weight_scale", ".weight_tensor_scale")):
            plain[name] = raw[name].float()
    out.mkdir()
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantized_forward_matches_dequantized_reference(
    checkpoints, tmp_path, monkeypatch, arch, fmt, capsys
):
    """The FP4 checkpoint through the Python layers' reference path (weights expanded,
    float activations) equals transformers on the dequantized weights; through the CPU
    kernels (int8 activations) it stays within 1% of it."""
    from expresslane import kernels

    qdir = tmp_path / "q"
    assert main(["quantize", "--format", fmt, str(checkpoints[arch]), str(qdir)]) == 0
    assert "of bf16" in capsys.readouterr().out
    config = json.loads((qdir / "config.json").read_text())
    assert config["quantization_config"]["format"] == fmt
    assert not config["tie_word_embeddings"]  # the output projection is quantized on its own
    T = 60
    ids = torch.tensor(random_prompts(1, T, T + 1, seed=3)[0])
    ref_dir = dequantized_copy(qdir, tmp_path / "ref")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]

    def prompt_logits():
        model, cfg = load_model(qdir, torch.float32, torch.device("cpu"), 512)
        model.bind_kv_cache(
            [torch.zeros(2, cfg.num_kv_heads, 512, cfg.head_dim) for _ in range(cfg.num_layers)]
        )
        meta = AttentionMetadata(
            slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)]
        )
        return model(ids, torch.arange(T), meta)

    with_kernels = prompt_logits()
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    torch.testing.assert_close(prompt_logits(), ref, atol=5e-5, rtol=1e-4)
    assert (with_kernels - ref).norm() / ref.norm() < 0.01


def test_quantize_at_load_equals_the_quantized_checkpoint(llama_dir, tmp_path):
    qdir = tmp_path / "q"
    main(["quantize", "--format", "nvfp4", str(llama_dir), str(qdir)])
    prompts = random_prompts(4, 5, 30, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    from_dir = LLM(str(qdir), dtype="float32").generate(prompts, params)
    at_load = LLM(str(llama_dir), dtype="float32", quantization="nvfp4").generate(prompts, params)
    assert [o.token_ids for o in from_dir] == [o.token_ids for o in at_load]
    with pytest.raises(InvalidRequestError, match="unknown quantization"):
        LLM(str(llama_dir), quantization="int3")
    with pytest.raises(SystemExit, match="already quantized"):
        main(["quantize", "--format", "mxfp4", str(qdir), str(tmp_path / "again")])
    with pytest.raises(SystemExit, match="not a Hugging Face model directory"):
        main(["quantize", "--format", "mxfp4", str(tmp_path), str(tmp_path / "x")])


def test_fp4_greedy_tokens_do_not_depend_on_the_batch(llama_dir, tmp_path):
    """FP4 linears run the row-invariant CPU kernel at every batch size, so every step runs
    the native kernels: a prompt's greedy tokens are the same decoded alone as among 20 others
    with prompts cut into chunks beside decodes (the C++ step against the Python layers, at
    the tensor level: tests/test_kernels.py)."""
    qdir = tmp_path / "q"
    main(["quantize", "--format", "nvfp4", str(llama_dir), str(qdir)])
    prompts = random_prompts(20, 5, 40, seed=6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = LLM(str(qdir), dtype="float32", max_batch=1, enable_prefix_caching=False)
    if not alone.engine.model.plan.every_step:
        pytest.skip("no AVX2 CPU kernels here")
    batched = LLM(str(qdir), dtype="float32", max_batch=20, max_num_batched_tokens=24)
    expected = [alone.generate(p, params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in batched.generate(prompts, params)] == expected
