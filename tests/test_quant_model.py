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
def test_quantized_forward_matches_dequantized_reference(checkpoints, tmp_path, arch, fmt, capsys):
    qdir = tmp_path / "q"
    assert main(["quantize", "--format", fmt, str(checkpoints[arch]), str(qdir)]) == 0
    assert "of bf16" in capsys.readouterr().out
    config = json.loads((qdir / "config.json").read_text())
    assert config["quantization_config"]["format"] == fmt
    assert not config["tie_word_embeddings"]  # the output projection is quantized on its own
    model, cfg = load_model(qdir, torch.float32, torch.device("cpu"), 512)
    model.bind_kv_cache(
        [torch.zeros(2, cfg.num_kv_heads, 512, cfg.head_dim) for _ in range(cfg.num_layers)]
    )
    T = 60
    ids = torch.tensor(random_prompts(1, T, T + 1, seed=3)[0])
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)])
    ours = model(ids, torch.arange(T), meta)
    ref_dir = dequantized_copy(qdir, tmp_path / "ref")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=5e-5, rtol=1e-4)


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


@pytest.mark.parametrize("batch", [6, 20])  # 20: past the bf16 limit, within DECODE_ROWS
def test_fp4_decode_step_in_cpp_matches_the_python_layers(llama_dir, tmp_path, monkeypatch, batch):
    """The C++ decode step runs FP4 linears too; it must produce the Python layers' tokens
    (both call the same kernel; the kernel against the reference is in test_kernels.py)."""
    from expresslane.quant.linear import Fp4Linear

    # the Python layers call the kernel for as many rows as the native step does
    monkeypatch.setattr(Fp4Linear, "SMALL_BATCH", Fp4Linear.DECODE_ROWS)
    qdir = tmp_path / "q"
    main(["quantize", "--format", "nvfp4", str(llama_dir), str(qdir)])
    prompts = random_prompts(batch, 5, 40, seed=6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fast = LLM(str(qdir), dtype="float32")
    if fast.engine.model.decode_stack is None:
        pytest.skip("no AVX2 CPU kernels here")
    slow = LLM(str(qdir), dtype="float32")
    slow.engine.model.decode_stack = None
    assert fast.engine.model.native_rows >= batch
    a, b = fast.generate(prompts, params), slow.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
