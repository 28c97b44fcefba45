"""A tiny random gpt-oss checkpoint that answers in harmony: the demo tokenizer with harmony's
special tokens added, a harmony chat template written for these tests, and the model overfit
in the session to answer the harmony tests' prompts with fixed replies (as `tool_server`'s
Llama is, tests/server/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from expresslane.server.prompt import render, template_tools
from expresslane.tokenizer import Tokenizer

from ..conftest import GPT_OSS_CONFIGS
from .conftest import DEMO_TOKENIZER, WEATHER

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"]
ENDS = ["<|return|>", "<|call|>"]  # the model's end tokens
# Harmony's layout (system, developer with the tools, messages, channels); the wording is ours.
TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}
Channels: analysis, commentary, final.<|end|>
{%- set system = messages | selectattr('role', 'equalto', 'system') | list %}
{%- if system or tools %}<|start|>developer<|message|>
{%- if system %}{{ system[0].content }}{% endif %}
{%- if tools %}# Tools
{% for t in tools %}functions.{{ t.function.name }}: {{ t.function | tojson }}
{% endfor %}{% endif %}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>
{%- endif %}{% for c in m.tool_calls -%}
<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json
{{- '<|message|>' }}{{ c.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>
{{- m.content }}<|end|>
{%- elif m.role == 'tool' -%}
<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

THINK = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
PARIS_ARGS = '{"city": "Paris"}'
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
FINAL = "<|channel|>final<|message|>"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def called(args) -> list[dict]:
    """The assistant's reasoning and call, and the call's result, as template messages."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    return [
        {"role": "assistant", "content": "", "thinking": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18C"},
    ]


# (messages, with tools, reply with its end token): the prompts the harmony tests send
SCRIPT = [
    ([user("hi")], False, THINK.format("Greet back.") + FINAL + "Hello there!<|return|>"),
    (
        [user("Weather in Paris?")],
        True,
        THINK.format("Look it up.") + CALL + PARIS_ARGS + "<|call|>",
    ),
    (
        [user("Weather in Paris?"), *called(json.loads(PARIS_ARGS))],
        True,
        THINK.format("It is 18C.") + FINAL + "Sunny, 18C.<|return|>",
    ),
]


def make_tokenizer(out: Path) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    shutil.copy(DEMO_TOKENIZER / "tokenizer.json", out / "tokenizer.json")
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL + ENDS])
    hf.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>"}
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    ends = [hf.token_to_id(t) for t in ENDS]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return Tokenizer.from_dir(out)


def _batch(tok: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids, right-padded (causal attention never reads the padding), and their labels:
    the reply tokens, -100 elsewhere."""
    tools = template_tools([WEATHER])
    seqs = []
    for messages, with_tools, reply in SCRIPT:
        prompt = tok.encode(render(tok, messages, tools if with_tools else None), False)
        seqs.append((prompt + tok.encode(reply, False), len(prompt)))
    width = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for i, (s, n) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, n : len(s)] = torch.tensor(s[n:])
    return ids, labels


def train_harmony_model(out: Path) -> None:
    """Overfit until every reply token wins by a margin, then sharpen (the final norm scales
    every logit) so that greedy decoding and sampling both reproduce the replies."""
    import transformers

    tok = make_tokenizer(out)
    ids, labels = _batch(tok)
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=32,
        max_position_embeddings=512,  # 8x the YaRN rope's original 64
        rope_parameters=GPT_OSS_CONFIGS["gpt_oss"][2]["rope_parameters"],
        eos_token_id=tok.token_to_id("<|return|>"),
        bos_token_id=None,
        pad_token_id=0,
    )
    model = transformers.GptOssForCausalLM(cfg)
    margin = _fit(model, ids, labels)
    with torch.no_grad():
        model.model.norm.weight.mul_(40 / margin)
    model.eval().save_pretrained(out)


def _fit(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scored = labels[:, 1:] != -100
    gold = labels[:, 1:][scored][:, None]
    for _ in range(400):
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden[:, :-1][scored])  # only where a reply token is predicted
        with torch.no_grad():
            others = logits.scatter(1, gold, float("-inf")).max(1).values
            margin = (logits.gather(1, gold)[:, 0] - others).min().item()
        if margin > 2:  # measured on the weights being saved
            return margin
        opt.zero_grad()
        torch.nn.functional.cross_entropy(logits, gold[:, 0]).backward()
        opt.step()
    raise RuntimeError(f"the harmony model did not learn its script (margin {margin:.2f})")
