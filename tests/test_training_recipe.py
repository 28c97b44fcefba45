"""Pieces of the demo model's training recipe (scripts/): the Muon optimizer's orthogonalized
update against an SVD reference, the chat template's compact tool list, the edit examples and
the copy heads' attention targets."""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer as HFTokenizer

from expresslane.tokenizer import Tokenizer
from scripts import copy_heads, muon
from scripts import train_demo_model as train


def test_orthogonalize_matches_svd_polar_factor():
    torch.manual_seed(0)
    for shape in [(64, 192), (192, 64), (96, 96)]:
        g = torch.randn(shape, dtype=torch.float64)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        polar = u @ vh
        approx = muon.orthogonalize(g)
        assert approx.shape == g.shape
        s = torch.linalg.svdvals(approx)
        # Newton-Schulz with Muon's coefficients lands singular values near 1, not exactly on
        # it; a square Gaussian matrix has singular values near 0 that five steps lift less
        assert s.max() < 1.25 and s.min() > (0.2 if shape[0] == shape[1] else 0.6)
        cos = (approx * polar).sum() / (approx.norm() * polar.norm())
        assert cos > 0.97


def test_muon_minimizes_a_matrix_least_squares_problem():
    torch.manual_seed(0)
    a, target = torch.randn(32, 48), torch.randn(48, 24)
    b = a @ target
    w = torch.nn.Parameter(torch.zeros(48, 24))
    opt = muon.Muon([w], lr=0.05)
    first = None
    for step in range(200):
        loss = ((a @ w - b) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = 0.05 * (1 - step / 200)
    assert loss.item() < 0.05 * first


def test_chat_template_lists_tools_compactly_in_both_tool_shapes(llama_dir):
    template = train.CHAT_TEMPLATE
    tok = Tokenizer(
        HFTokenizer.from_file(str(llama_dir / "tokenizer.json")),
        {"chat_template": template, "eos_token": "<|im_end|>"},
    )
    nested = {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    }
    flat = {"name": "list_dir", "parameters": {"type": "object", "properties": {}}}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[nested, flat])
    assert "<tools>\nwrite_file(path, content): Write a file.\nlist_dir()\n</tools>" in text
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


def test_edit_examples_repeat_a_freshly_renamed_function():
    """The fine-tuning edits: a function whose own names are replaced by fresh ones (so the
    repeat cannot be recalled from training), then the same source with one rename."""
    import ast
    import random

    assert train.rename("x = xs.x + x_1(x)", {"x": "y"}) == "y = xs.x + x_1(y)"
    source = '''def scale(values, factor=2):
    """Multiply every value."""
    out = [v * factor for v in values]
    return out
'''
    others = "".join(
        f'def {name}():\n    """Doc string here."""\n\n'
        for name in ("read_block", "parse_header", "open_stream_now")
    )
    factory = train.ExampleFactory({"m.py": others + source})
    rng = random.Random(0)
    kinds = set()
    for _ in range(40):
        src, edited, change = factory.edit_pair(rng)
        if "Multiply" not in src:
            continue  # one of the other functions
        ast.parse(src)
        ast.parse(edited)
        assert "values" not in src and "factor" not in src and "def scale(" not in src
        if change is None:
            assert edited == src
            continue
        kinds.add(change["what"])
        assert change["old"] in src and change["new"] in edited
        assert edited == train.rename(src, {change["old"]: change["new"]})
    assert kinds == {"function", "parameter"}


def test_copy_head_targets_point_where_a_copying_circuit_looks():
    #        0  1  2  3  4  5  6  7
    ids = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 8]])
    (l0, h0, prev), (l1, h1, prev2), (l2, h2, induction) = copy_heads.head_targets(ids, 6, 2)
    assert (l0, h0, l1, h1, l2, h2) == (0, 0, 0, 3, 1, 0)
    assert prev[0, 4].nonzero().flatten().tolist() == [3]
    assert prev2[0, 4].nonzero().flatten().tolist() == [2]
    # at 5 (6 after 5) the earlier pair (5, 6) sits at 0..1: look at 2, the token that followed
    assert induction[0, 5].nonzero().flatten().tolist() == [2]
    assert induction[0, 6].nonzero().flatten().tolist() == [3]
    assert not induction[0, :5].any()  # no earlier pair repeats before position 5


def test_attention_loss_is_zero_only_on_the_allowed_keys():
    allowed = torch.zeros(1, 4, 4, dtype=torch.bool)
    allowed[0, 2, 1] = allowed[0, 3, 2] = True
    exact = allowed.float()[:, None]  # [B, heads, T, T], all mass on the allowed key
    spread = torch.full((1, 1, 4, 4), 0.25)
    assert copy_heads.attention_loss([exact], [(0, 0, allowed)]).item() == 0.0
    assert abs(copy_heads.attention_loss([spread], [(0, 0, allowed)]).item() - 1.3863) < 1e-3


def test_copy_rows_score_only_the_predictable_repeat():
    ids, labels = copy_heads.copy_rows(random.Random(0), 4)
    assert ids.shape == (4, copy_heads.COPY_ROW_LEN + 1)
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        scored = [i for i, v in enumerate(lab) if v != -100]
        k = len(scored) + 1  # the repeat's first token is not predictable
        assert row[:k] == row[-k:]
        assert [lab[i] for i in scored] == row[-k + 1 :]


def test_code_and_question_chats_answer_without_tools_or_json():
    """The fine-tuning chats that keep code in chat: a function's first lines (bare, after a
    request or fenced) answered with the whole function in a ```python block, and questions
    answered in one sentence from a docstring."""
    import ast

    source = '''def scale(values, factor=2):
    """Multiply every value by the factor."""
    out = [v * factor for v in values]
    return out
'''
    module = '"""Helpers that scale lists of numbers."""\n\n' + source
    factory = train.ExampleFactory({"pkg/scaling.py": module})
    rng = random.Random(0)
    asks = set()
    for _ in range(60):
        messages, tools = factory.complete_chat(rng)
        user, answer = messages[-2]["content"], messages[-1]["content"]
        assert tools is None or tools[0]["function"]["name"] in {
            "read_file",
            "run_tests",
            "write_file",
            "list_dir",
        }
        assert answer == f"```python\n{source.rstrip(chr(10))}\n```"
        ast.parse(answer[len("```python\n") : -len("\n```")])
        code = user.split("\n\n", 1)[-1].removeprefix("```python\n").removesuffix("\n```")
        if code.startswith("def "):
            assert source.startswith(code)
            asks.add("bare" if user == code else "request")
        else:
            assert "multiplies every value by the factor" in user
            asks.add("plain")
    assert asks == {"bare", "request", "plain"}
    assert "def scale(values, factor=2):" in {
        factory.complete_chat(rng)[0][-2]["content"] for _ in range(60)
    }
    for _ in range(30):
        messages, tools = factory.question(rng)
        answer = messages[-1]["content"]
        assert tools is None and "<tool_call>" not in answer and not answer.startswith("{")
        assert answer in (
            train.ABOUT_ANSWER,
            "`pkg.scaling`: Helpers that scale lists of numbers.",
        ) or answer.endswith("multiplies every value by the factor.")
