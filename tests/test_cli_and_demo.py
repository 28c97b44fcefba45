"""The `expresslane generate` command, the bundled demo models (parity with transformers) and
their random-weight stand-in."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.cli import main
from expresslane.demo import DRAFT_DIR, TARGET_DIR, write_random_checkpoint


def test_generate_command_prints_the_completion(llama_dir, capsys):
    assert main(["generate", "--model", str(llama_dir), "--max-tokens", "5", "-v", "def f("]) == 0
    out = capsys.readouterr()
    assert out.out.strip() != "" and "5 tokens" in out.err


def test_random_demo_checkpoint_loads_with_the_real_tokenizer(tmp_path):
    write_random_checkpoint(TARGET_DIR, tmp_path / "demo")
    llm = LLM(str(tmp_path / "demo"), max_model_len=256)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    out = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


DEMO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
]


@pytest.mark.skipif(
    not (TARGET_DIR / "model.safetensors").is_file(), reason="demo weights not bundled"
)
@pytest.mark.parametrize("model_dir", [TARGET_DIR, DRAFT_DIR], ids=["target", "draft"])
def test_demo_models_match_transformers_greedy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32")
    # min_new_tokens / min_tokens both mask the end tokens for all 48 steps
    params = SamplingParams(max_tokens=48, temperature=0, min_tokens=48)
    for prompt in DEMO_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=48, do_sample=False, min_new_tokens=48)
        got = llm.generate(ids[0].tolist(), params)[0].token_ids
        assert got == want[0, ids.shape[1] :].tolist()
