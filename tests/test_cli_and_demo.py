"""The `expresslane generate` command and the demo model's random-weight stand-in."""

from __future__ import annotations

from expresslane import LLM, SamplingParams
from expresslane.cli import main
from expresslane.demo import TARGET_DIR, write_random_checkpoint


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
