"""SmolLM2-135M-Instruct, the real model (tests/real_model.py): its GGUF file as it ships and
the directory transformers 5 saves from it load unchanged and decode as transformers does.
Token parity is checked with the file's 4-bit blocks widened to bf16 (the weights transformers
computes with); the 4-bit path is checked against transformers in tests/test_gguf_int4.py."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.checkpoint import read_checkpoint
from expresslane.gguf_file import KEEP_4BIT_ENV, GgufFile
from expresslane.model_source import resolve_model
from expresslane.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "List three colors.",
    "What is 12 + 30?",
]
TEXTS = [
    "What is the capital of France? It's 12,345 km away.",
    "def add(a, b):\n    return a + b\n\n\tx = [1, 2]  # done",
    "<|im_start|>user\nhéllo wörld 😀 naïve café<|im_end|>\n",
    "  leading spaces, trailing   \n\n\nnew lines",
]
N = 24


@pytest.fixture(scope="module")
def chat_prompts(smollm2_gguf) -> list[list[int]]:
    tok = Tokenizer.from_dir(resolve_model(str(smollm2_gguf)))
    texts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def gguf_llm(smollm2_gguf):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEEP_4BIT_ENV, "0")
        return LLM(str(smollm2_gguf), seed=0)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_hf, chat_prompts) -> list[list[int]]:
    """transformers' greedy tokens, in float32 over the checkpoint's bf16 weights (the engine
    computes in float32 too)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    outs = []
    for p in chat_prompts:
        ids = torch.tensor([p])  # the mask is explicit: pad (2) is also <|im_end|>, in prompts
        out = model.eval().generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **params)
    return [o.token_ids for o in llm.generate(prompts, sp)]


def test_gguf_tensors_are_what_transformers_reads(smollm2_gguf, smollm2_hf):
    ours = GgufFile(smollm2_gguf).tensors()
    theirs = read_checkpoint(smollm2_hf)
    assert set(ours) == set(theirs)  # tied: neither has lm_head.weight
    for name, t in theirs.items():
        assert torch.equal(ours[name].to(t.dtype), t), name


def test_gguf_tokenizer_encodes_as_transformers(smollm2_gguf):
    ours = Tokenizer.from_dir(resolve_model(str(smollm2_gguf)))
    theirs = transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_gguf_greedy_matches_transformers(gguf_llm, chat_prompts, hf_greedy):
    assert greedy(gguf_llm, chat_prompts) == hf_greedy


def test_transformers_directory_loads_unchanged(smollm2_hf, chat_prompts, hf_greedy):
    """config.json with a `gguf` quantization_config over plain bf16 tensors, the template in
    chat_template.jinja: served as it is."""
    llm = LLM(str(smollm2_hf), seed=0)
    assert greedy(llm, chat_prompts) == hf_greedy
    tok = Tokenizer.from_dir(smollm2_hf)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    assert text.endswith("<|im_start|>assistant\n") and QUESTIONS[0] in text


def test_answers_the_capital_of_france(gguf_llm, chat_prompts):
    out = gguf_llm.generate([chat_prompts[0]], SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out[0].text
    assert out[0].finish_reason == "stop"  # <|im_end|>, the file's eos


@pytest.mark.parametrize(
    "speculative",
    [{"method": "ngram", "num_tokens": 4, "max_batch": None}],
    ids=["ngram"],
)
def test_speculation_and_prefix_cache_keep_greedy_tokens(smollm2_gguf, chat_prompts, speculative):
    plain = LLM(str(smollm2_gguf), seed=0, enable_prefix_caching=False)
    expected = greedy(plain, chat_prompts)
    llm = LLM(str(smollm2_gguf), seed=0, speculative=speculative)
    assert greedy(llm, chat_prompts) == expected
    again = llm.generate(chat_prompts[:1], SamplingParams(max_tokens=N, temperature=0))
    assert again[0].num_cached_tokens > 0  # the system prompt and question, cached
    assert again[0].token_ids == expected[0][: len(again[0].token_ids)]
