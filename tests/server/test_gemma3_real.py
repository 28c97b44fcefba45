"""The real Gemma 3 270M (base model, Q4_K_M GGUF as llama.cpp writes it): its SentencePiece
tokenizer and its tokens against transformers' own GGUF loader, and a question answered
through the server with the openai SDK."""

from __future__ import annotations

import openai
import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

transformers = pytest.importorskip("transformers")
QUESTION = "Question: What is the capital of France?\nAnswer:"
TEXTS = [
    QUESTION,
    "def add(a, b):\n    return a + b\n",
    "  indented   spaces\t\ttabs",
    "naïve café 東京 🤖 <bos> x",
    "über-long-compound_words123456 and 3.14159",
]


def test_tokenizer_and_greedy_tokens_match_transformers(gemma3_gguf, monkeypatch):
    kw = dict(gguf_file=gemma3_gguf.name)
    ref_tok = transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, **kw)
    monkeypatch.setenv("EXPRESSLANE_GGUF_4BIT", "0")  # widened, as transformers reads it
    llm = LLM(str(gemma3_gguf), dtype="float32", max_model_len=512)
    ours = llm.engine.tokenizer
    for text in TEXTS:
        ids = ref_tok(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids[1:], skip_special_tokens=False) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, dtype=torch.float32, **kw
    ).eval()
    ids = ref_tok(QUESTION)["input_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    out = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.token_ids == ref[0, len(ids) :].tolist()


def test_the_server_answers_paris(gemma3_gguf):
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    config = EngineConfig(model=str(gemma3_gguf), calibrate=False, max_model_len=1024)
    engine = AsyncEngine(LLMEngine(config))
    try:
        settings = ServerSettings(store_path=":memory:", served_model_name="gemma3")
        with ServerThread(create_app(engine, settings)) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="test", max_retries=0)
            r = client.completions.create(
                model="gemma3", prompt=QUESTION, max_tokens=8, temperature=0
            )
            assert "Paris" in r.choices[0].text
    finally:
        engine.shutdown()
