"""Train expresslane's bundled demo model: a small Python-code model and its draft model.

Both models are trained from scratch on the Python standard library of the running interpreter,
on a 2-core CPU, in about an hour. They are demo models: big enough to produce recognizable
Python, follow a chat template and emit Hermes/Qwen2.5-style tool calls, small enough to ship in
the wheel and to serve fast on a laptop CPU. They are not general assistants.

Recipe
------
1. Corpus. Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, skipping any folder
   named ``test``, ``tests`` or ``idle_test`` and ``site-packages``, in sorted order. The split is
   by file: a file is held out when ``int(sha256(relpath)[:8], 16) % 100 < 7`` (the threshold is
   raised by one until at least 6% of the files are held out). Held-out files are never seen in
   training, not even by the tokenizer; their list is written to ``training.json``.
2. Tokenizer. Byte-level BPE (``tokenizers``), vocabulary 8192, trained on the train files only.
   Special tokens ``<|endoftext|>`` (document separator, also BOS and pad), ``<|im_start|>``,
   ``<|im_end|>`` (end of a chat turn, the chat EOS); added non-special tokens ``<tool_call>``,
   ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` (kept by
   ``decode(skip_special_tokens=True)``, as in Qwen2.5). The chat template is ChatML with
   Hermes/Qwen2.5 tool calls (see ``CHAT_TEMPLATE``); offered tools are listed one per line as
   ``name(params): description`` (about 100 tokens for the four agent tools, against about 470
   for one JSON schema per tool, which would be a fifth of all training tokens).
3. Training mix, rebuilt for every epoch with a seed derived from ``--seed`` and the epoch:
   (a) plain code (25% of tokens): the train files, shuffled, each followed by
   ``<|endoftext|>``; (b) whole short functions (30%): functions and methods with docstrings
   and at most 15 lines after the docstring, dedented, each its own document ending in
   ``<|endoftext|>`` (teaches where a function ends); (c) instructions (12%): the user asks for
   ``name(args)`` described by the docstring's first paragraph (varied phrasings), the assistant
   answers with the function source in a single ```python block; (d) agent tool use (33%):
   conversations of 1-3 requests; the tools ``read_file``, ``run_tests``, ``write_file`` and
   ``list_dir`` are offered; the user asks to read / explain / test / fix a real train file or
   to list a folder; the assistant calls the right tool, a ``tool`` message returns a realistic
   result (a 3-8 line excerpt of the real file, a real folder listing, a pytest-like summary)
   and the assistant gives a short grounded answer. All documents are shuffled together,
   concatenated and cut into windows of 1024 tokens (+1 for the shifted labels). Loss on every
   token. Annealing: the last 25% of each model's steps (the tail of the learning-rate decay)
   read a second stream built the same way but weighted toward the tasks (10% code files drawn
   at random, 40% short functions, 12% instructions, 38% tool use); the step where it starts
   follows from the schedule, so a replay anneals at the same step.
4. Models. ``transformers.LlamaForCausalLM``, tied embeddings, RoPE theta 1e4, RMSNorm eps 1e-5,
   2048 positions, trained at sequence length 1024 (precision: see 5.). Optimizer: Muon (see
   ``muon.py``; lr 0.02, Nesterov momentum 0.95) for the attention and MLP matrices, AdamW
   (0.9, 0.95, wd 0.1) for the tied embedding and the norm gains (``--optimizer adamw``: AdamW
   for all). On the target, 120 steps reach a training loss of 3.8 with Muon against 4.8 with
   AdamW, though a Muon step costs ~35% more on this CPU (Newton-Schulz matmuls). Linear warmup
   then cosine decay to 10% of the peak, gradient clipping at 1.0, 2 threads.
   target: d=384, 4 layers, 6 heads (2 KV heads), MLP 1152 (10.0M parameters).
   draft:   d=128, 4 layers, 4 heads (2 KV heads), MLP 384 (1.8M parameters).
   The draft trains after the target and distills from it: its loss adds the KL divergence
   from the target's next-token distribution (``DISTILL_WEIGHT``), so that it learns to guess
   what the target will say, which is what speculative decoding accepts.
5. Budget. Unless ``--target-steps`` / ``--draft-steps`` (or a recorded ``--*-plan``) are given,
   the step count is planned from a wall-time budget: the warmup steps (whose learning rates do
   not depend on the total) are timed and the schedule's end is set to fill the budget; every
   ``--replan-minutes`` the end is re-estimated from the measured speed (the machine is shared),
   each change being recorded as ``from_step:total``. ``training.json`` records the steps, the plan
   and the exact replay command; it reproduces the same weights from the same seed (same data,
   same order, same initialization, same learning rates).
   Precision: bf16 autocast where the CPU has native bf16 (AVX512-BF16 / AMX); elsewhere (e.g. an
   AVX2-only EPYC, where bf16 matmuls are ~30x slower than fp32) training runs in fp32.
6. Resume. Tokenized data, the tokenizer and a checkpoint (model, optimizer, step, planned steps)
   every ``--ckpt-minutes`` live in ``--work-dir`` (default ``.cache/demo_train``, outside git). A
   rerun with the same flags resumes from the latest checkpoint.
7. Fine-tuning (``--init-from DIR``): start from the ``target/`` and ``draft/`` weights in DIR
   (and its tokenizer) instead of a random initialization; every step reads the ``finetune``
   stream (``FINETUNE_MIX``: the kinds above plus edits, code to complete sent as a chat,
   one-sentence answers to questions and JSON answers, see ``json_answers.py``; ``--mix``
   changes the shares) at ``--lr-scale`` (default half) the learning rates, with 20 warmup
   steps and no annealing switch. Code to complete and questions are chats without tools:
   without them the model answered every such chat with a tool call, or with JSON once JSON
   answers were added. An edit is a train function whose own names
   (function, parameters, locals) are first replaced by fresh identifiers made of corpus words,
   followed by the same source again, verbatim or with the function or one parameter renamed;
   half of them as a plain document, half as a chat ("Rename `a` to `b` in this function:"
   and the code, answered with the edited code). The fresh names make the source new to the
   model, so the repeat can only be predicted by copying from the context, the skill that
   prompt-lookup speculation (and copying a requested path into a tool call) rides on.
   ``training.json`` keeps the base model's record under ``base``. Edits alone did not teach
   copying (185-400 steps left the loss on a held-out function's repeat at ~4.2 nats per
   token). ``--copy-heads`` does (``copy_heads.py``): it names the attention patterns of a
   previous-token head and an induction head as training targets and adds random-token copy
   rows; 1,000 steps of it from run 6 took that loss to 1.65. See MODEL_CARD.md, "Copying".
8. Output (``--out-dir``, default ``src/expresslane/assets/demo``): ``target/`` and ``draft/`` in
   Hugging Face format (config.json, generation_config.json, bf16 model.safetensors, tokenizer
   files) and ``training.json``.

Usage::

    python -m scripts.train_demo_model                      # full run, about 62 min on 2 cores
    python -m scripts.train_demo_model --smoke --out-dir /tmp/demo_smoke   # 1-2 min pipeline test
    python -m scripts.train_demo_model --target-steps N --draft-steps M    # fixed step counts
    python -m scripts.train_demo_model --device cuda --target-steps N --draft-steps M  # on a GPU
      (on a GPU pass step counts or --max-steps: a time budget there buys far too many epochs)
    python -m scripts.train_demo_model --init-from DIR --target-steps N --draft-steps M  # fine-tune
    python -m scripts.eval_demo_model                        # held-out evaluation -> eval.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "src" / "expresslane" / "assets" / "demo"
DEFAULT_WORK = REPO / ".cache" / "demo_train"

VOCAB_SIZE = 8192
SEQ_LEN = 1024
MAX_POSITIONS = 2048
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEFAULT_SYSTEM = "You are a helpful coding assistant."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
MIX = {"code": 0.25, "function": 0.30, "instruct": 0.12, "tool": 0.33}  # share of training tokens
# The last ANNEAL_FRACTION of each model's steps (while the learning rate decays) draw from a
# stream weighted toward the tasks the model is for: writing short functions, answering chats,
# calling tools. Code files are sampled into it until they make their share.
ANNEAL_MIX = {"code": 0.10, "function": 0.40, "instruct": 0.12, "tool": 0.38}
ANNEAL_FRACTION = 0.25
ANNEAL_EPOCH_TOKENS = 2_000_000
# Fine-tuning (--init-from): every step reads this stream, which adds edits (the output repeats
# code from the context with a rename, or verbatim) to the usual kinds, to teach copying from
# the context, chats that answer without tools (code to complete, questions) and JSON answers
# (only where the user asks for JSON); the learning rates are scaled down and warm up briefly.
FINETUNE_MIX = {
    "code": 0.12,
    "function": 0.20,
    "instruct": 0.12,
    "complete": 0.10,
    "question": 0.06,
    "tool": 0.24,
    "edit": 0.11,
    "json": 0.05,
}
FINETUNE_EPOCH_TOKENS = 2_000_000
FINETUNE_LR_SCALE = 0.5  # default of --lr-scale
FINETUNE_WARMUP = 20
STREAM_MIX = {"main": MIX, "anneal": ANNEAL_MIX, "finetune": FINETUNE_MIX}
# The draft learns from the trained target too: its loss adds DISTILL_WEIGHT times the KL
# divergence from the target's next-token distribution, so that it guesses what the target
# would say (what speculative decoding accepts), not only what the data says.
DISTILL_WEIGHT = 1.0
SHORT_FUNCTION_LINES = 15  # whole-function documents have at most this many lines after the doc

MODEL_SHAPES = {
    "target": dict(
        hidden_size=384,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1152,
    ),
    "draft": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
    ),
}
MUON_LR = 0.02  # peak learning rate of the hidden matrices under --optimizer muon
TRAIN_DEFAULTS = {  # peak lr, warmup steps, batch (sequences of SEQ_LEN tokens)
    "target": dict(lr=2e-3, warmup=60, batch=2),
    "draft": dict(lr=3e-3, warmup=30, batch=4),
}

# ChatML + Hermes / Qwen2.5 tool calls. The server's tool-call parser relies on this exact format.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- text(messages[0].content) -}}"
    "{%- else -%}{{- '" + DEFAULT_SYSTEM + "' -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{- '\\n' + fn.name + '(' -}}"
    "{%- if fn.parameters is defined and fn.parameters.properties is defined -%}"
    "{{- fn.parameters.properties | list | join(', ') -}}{%- endif -%}"
    "{{- ')' -}}{%- if fn.description -%}{{- ': ' + fn.description -}}{%- endif -%}"
    "{%- endfor -%}"
    '{{- \'\\n</tools>\\nTo call a tool, write <tool_call>\\n{"name": <tool-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first and tools -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- text(message.content) -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.content -%}{{- text(message.content) + '\\n' -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}{{- text(message.content) -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _tool(name: str, description: str, params: dict[str, str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool(
        "read_file",
        "Read a text file and return its contents.",
        {"path": "Path of the file to read."},
    ),
    _tool(
        "run_tests",
        "Run the tests for a file or folder and return a pytest summary.",
        {"path": "Path of the file or folder to test."},
    ),
    _tool(
        "write_file",
        "Write content to a file, replacing it if it exists.",
        {"path": "Path of the file to write.", "content": "The full new content of the file."},
    ),
    _tool("list_dir", "List the entries of a folder.", {"path": "Path of the folder."}),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel = Path(dirpath).relative_to(root)
        out += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(out)


def split_files(files: list[str]) -> tuple[list[str], list[str], int]:
    """Deterministic by-file split: returns (train, heldout, threshold percent)."""

    def bucket(f: str) -> int:
        return int(hashlib.sha256(f.encode()).hexdigest()[:8], 16) % 100

    threshold = 7
    while sum(bucket(f) < threshold for f in files) < 0.06 * len(files):
        threshold += 1
    held = [f for f in files if bucket(f) < threshold]
    train = [f for f in files if bucket(f) >= threshold]
    return train, held, threshold


def read_sources(root: Path, files: list[str]) -> dict[str, str]:
    out = {}
    for f in files:
        try:
            out[f] = (root / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # skipped deterministically; none in CPython 3.11
    return out


# --------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + TOOL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    smap = {
        "bos_token": EOT,
        "eos_token": IM_END,
        "pad_token": EOT,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Training examples (chat format), built from the train files only


_NOT_VERBS = {
    "a",
    "an",
    "the",
    "this",
    "if",
    "for",
    "in",
    "helper",
    "internal",
    "private",
    "used",
    "called",
    "deprecated",
    "same",
    "like",
    "see",
    "note",
    "when",
    "it",
}


def docstring_summary(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split()).rstrip(".")


def third_person(desc: str) -> str | None:
    """'Return the x' -> 'returns the x'; None when the text does not start with a verb."""
    word, _, rest = desc.partition(" ")
    if not word.isalpha() or not word[0].isupper() or word.lower() in _NOT_VERBS:
        return None
    w = word.lower()
    if w.endswith("ss") or w.endswith(("sh", "ch", "x", "z", "o")):
        w += "es"
    elif w.endswith("s"):
        pass  # already third person ("Returns ...")
    elif w.endswith("y") and w[-2:-1] not in "aeiou":
        w = w[:-1] + "ies"
    else:
        w += "s"
    return (w + " " + rest).strip()


def extract_functions(source: str) -> list[dict]:
    """Functions and methods with docstrings: name, signature, class, header, source, line."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    found = []

    def visit(node, cls):
        for child in node.body:
            if isinstance(child, ast.ClassDef) and cls is None:
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child)
                if not doc or not isinstance(child.body[0], ast.Expr):
                    continue
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                src = textwrap.dedent("\n".join(lines[start - 1 : child.end_lineno]))
                header = textwrap.dedent("\n".join(lines[start - 1 : child.body[0].end_lineno]))
                body_lines = child.end_lineno - child.body[0].end_lineno
                found.append(
                    dict(
                        name=child.name,
                        cls=cls,
                        lineno=child.lineno,
                        source=src,
                        header=header,
                        sig=f"{child.name}({ast.unparse(child.args)})",
                        doc=docstring_summary(doc),
                        body_lines=body_lines,
                        is_async=isinstance(child, ast.AsyncFunctionDef),
                    )
                )

    visit(tree, None)
    return found


def top_level_defs(source: str) -> list[tuple[str, str, int]]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [
        ("class" if isinstance(n, ast.ClassDef) else "function", n.name, n.lineno)
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]


def module_summary(source: str) -> str | None:
    try:
        doc = ast.get_docstring(ast.parse(source))
    except SyntaxError:
        return None
    if not doc:
        return None
    first = docstring_summary(doc).split(". ")[0].rstrip(".")
    return first if 8 <= len(first) <= 200 else None


def names_phrase(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    if len(quoted) <= 2:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + " and " + quoted[-1]


INSTRUCT_WITH_VERB = [
    "Write a Python function `{sig}` that {desc}.",
    "Write a function `{sig}` that {desc}.",
    "I need a Python function called `{name}` with the signature `{sig}`. It {desc}.",
    "Can you write `{sig}`? It {desc}.",
    "Implement `{sig}` in Python so that it {desc}.",
    "Please write a function named `{name}` that {desc}.",
]
INSTRUCT_ANY = [
    "Write a Python function `{sig}`. Docstring: {doc}.",
    "Implement `{sig}`: {doc}.",
    "Write `{sig}` in Python. Description: {doc}.",
]
INSTRUCT_METHOD = [
    "Write the method `{cls}.{sig}` that {desc}.",
    "Implement the `{name}` method of the `{cls}` class. It {desc}.",
    "In class `{cls}`, write `{sig}`: {doc}.",
]
READ_ASKS = [
    "Read {p}.",
    "Show me {p}.",
    "Can you open {p}?",
    "What's in {p}?",
    "Please read the file {p}.",
    "Open {p} for me.",
    "Look at {p} and tell me what it defines.",
    "Let me see the contents of {p}.",
    "Can you read {p} and summarize it?",
    "Display {p}.",
    "Dump {p} here.",
    "I want to look at {p}.",
    "What does {p} contain?",
]
EXPLAIN_ASKS = [
    "Explain what {p} does.",
    "Can you explain {p}?",
    "What is {p} for?",
    "Give me an overview of {p}.",
    "Help me understand {p}.",
]
TEST_ASKS = [
    "Run the tests for {p}.",
    "Can you run the tests for {p}?",
    "Test {p} please.",
    "Do the tests for {p} pass?",
    "Check that {p} still passes its tests.",
    "Please run the test suite for {p}.",
    "Run tests on {p} and tell me the result.",
    "Kick off the tests for {p}.",
    "Are {p}'s tests passing?",
    "Run pytest on {p}.",
    "Does {p} pass its test suite?",
    "Check whether the tests of {p} fail.",
]
FIX_ASKS = [
    "There's a bug in `{f}` in {p}. Can you fix it?",
    "Fix the `{f}` function in {p}.",
    "`{f}` in {p} is broken; please fix it.",
    "Something is wrong with `{f}` in {p}, fix it.",
]
LIST_ASKS = [
    "List the files in {p}.",
    "What's in the {p} folder?",
    "Show me the contents of {p}.",
    "Which files are in {p}?",
    "List {p}.",
]
RENAME_ASKS = [
    "Rename `{old}` to `{new}` in this function:",
    "Please rename {old} to {new}:",
    "Change the name `{old}` to `{new}` everywhere in this code:",
    "Rename the {what} `{old}` to `{new}`.",
    "Can you rename `{old}` as `{new}` here?",
]
# (f) code to complete: the user message is a function's first lines, bare or with a request
COMPLETE_ASKS = [
    "Complete this function:",
    "Finish this Python function:",
    "Write the rest of this function:",
    "Complete the code:",
    "Fill in the body of this function:",
    "Can you finish this?",
]
INSTRUCT_PLAIN = [  # (f) instructions without a signature: the model picks the names
    "Write a function that {desc}.",
    "Write a Python function that {desc}.",
    "Can you write a function that {desc}?",
    "I need a Python function that {desc}.",
    "Write code that {desc}.",
]
# (g) questions, answered in one short sentence from a docstring
WHAT_ASKS = [
    "What does `{qual}` do?",
    "What does the function `{qual}` do?",
    "What is `{qual}` for?",
    "Explain `{qual}` in one sentence.",
    "What does {qual} do?",
]
THIS_ASKS = ["What does this function do?", "Explain this code.", "What is this function for?"]
MODULE_ASKS = [
    "What is the `{mod}` module for?",
    "What does the {mod} module do?",
    "What is {mod}?",
]
ABOUT_ASKS = [
    "Hello!",
    "Hi",
    "Hello, who are you?",
    "Who are you?",
    "What can you do?",
    "What are you?",
    "Introduce yourself.",
]
ABOUT_ANSWER = (
    "I am expresslane's demo model, a 10M-parameter model trained on the Python standard "
    "library. I can write short Python functions, call tools and answer in JSON."
)
READ2_ASKS = ["Read {p} and {q}.", "Show me {p} and {q}.", "Can you open {p} and {q}?"]
SYSTEMS = [
    "You are an agent working in a checkout of the CPython repository.",
    "You are a coding agent. Use the tools to inspect files and run tests.",
    "You are a helpful assistant with access to a workspace.",
]


def rename(source: str, names: dict[str, str]) -> str:
    """Every whole-word occurrence of each key (not an attribute: no dot before it) replaced by
    its value, in one pass."""
    pattern = r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")\b"
    return re.sub(pattern, lambda m: names[m.group(1)], source)


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class ExampleFactory:
    """Generates chat examples (messages, tools) from the train files."""

    def __init__(self, sources: dict[str, str]):
        self.sources = sources
        self.files = sorted(sources)
        self.functions = []
        self.defs = {}
        for f in self.files:
            for fn in extract_functions(sources[f]):
                fn["file"] = f
                if (
                    len(fn["source"]) <= 2500
                    and fn["source"].count("\n") < 60
                    and 10 <= len(fn["doc"]) <= 300
                ):
                    self.functions.append(fn)
            self.defs[f] = top_level_defs(sources[f])
        words = {w for fn in self.functions for w in fn["name"].lower().split("_")}
        self.name_words = sorted(w for w in words if w.isidentifier() and len(w) > 1)
        self.short_functions = [
            fn for fn in self.functions if fn["body_lines"] <= SHORT_FUNCTION_LINES
        ]
        self.func_files = [
            f for f in self.files if any(k == "function" for k, _, _ in self.defs[f])
        ]
        folders: dict[str, set[str]] = {}
        for f in self.files:  # folder listings show train files and sub-folders only
            parts = f.split("/")
            for i in range(len(parts)):
                parent = "/".join(parts[:i])
                folders.setdefault(parent, set()).add(
                    parts[i] + ("/" if i < len(parts) - 1 else "")
                )
        self.folders = {k: sorted(v) for k, v in folders.items()}

    @staticmethod
    def show_path(rng: random.Random, rel: str) -> str:
        return ("Lib/" + rel) if rng.random() < 0.7 else rel

    @staticmethod
    def quote(rng: random.Random, text: str) -> str:
        return f"`{text}`" if rng.random() < 0.5 else text

    def tools_for(self, rng: random.Random) -> list[dict]:
        if rng.random() < 0.7:
            return TOOLS
        tools = TOOLS[:]
        rng.shuffle(tools)
        return tools

    def system(self, rng: random.Random) -> list[dict]:
        return [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []

    # (b) instructions -----------------------------------------------------------------------
    def instruct(self, rng: random.Random) -> tuple[list[dict], list[dict] | None]:
        fn = rng.choice(self.functions)
        desc = third_person(fn["doc"])
        fields = dict(sig=fn["sig"], name=fn["name"], cls=fn["cls"], doc=fn["doc"], desc=desc)
        if fn["cls"] and desc:
            ask = rng.choice(INSTRUCT_METHOD)
        elif fn["cls"]:
            ask = INSTRUCT_METHOD[2]
        elif desc and rng.random() < 0.75:
            ask = rng.choice(INSTRUCT_WITH_VERB)
        else:
            ask = rng.choice(INSTRUCT_ANY)
        messages = [
            {"role": "user", "content": ask.format(**fields)},
            {"role": "assistant", "content": f"```python\n{fn['source']}\n```"},
        ]
        r = rng.random()
        if r < 0.2:  # tools offered but not needed: answer directly
            return self.system(rng) + messages, self.tools_for(rng)
        if r < 0.5:
            return [{"role": "system", "content": DEFAULT_SYSTEM}] + messages, None
        return messages, None

    # (b') whole functions as their own documents --------------------------------------------
    def function(self, rng: random.Random) -> str:
        return rng.choice(self.short_functions)["source"] + "\n"

    # (e) edits: the output repeats code from the context with a small change ------------------
    def edit_pair(self, rng: random.Random) -> tuple[str, str, dict | None]:
        """(source, edited source, rename) for a random function: the function or one of its
        parameters renamed everywhere (not attributes), or None and the source unchanged.

        The function's own names (its name, parameters and locals) are first replaced by
        fresh ones, so the source is new to the model and the repeat can only come from
        copying it, not from recalling a training function."""
        fn = rng.choice(self.functions)
        try:
            node = ast.parse(fn["source"]).body[0]
        except SyntaxError:  # a method whose dedented source does not parse on its own
            node = None
        args = [] if node is None else node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        params = [a.arg for a in args if a.arg not in ("self", "cls")]
        names = [fn["name"], *params]
        if node is not None:
            names += [
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            ]
        taken = set(re.findall(r"\w+", fn["source"]))
        fresh = {}
        for old in dict.fromkeys(names):
            fresh[old] = self.fresh_name(rng)
            while fresh[old] in taken:  # new, and distinct from every other name
                fresh[old] = self.fresh_name(rng)
            taken.add(fresh[old])
        src = rename(fn["source"], fresh)
        params = [fresh[p] for p in params]
        r = rng.random()
        if r < 0.2:
            return src, src, None
        if r < 0.6 or not params:
            what, old = "function", fresh[fn["name"]]
            new = rng.choice(["{}_v2", "{}_new", "new_{}", "{}2", "_{}", "{}_impl", "fast_{}"])
        else:
            what, old = "parameter", rng.choice(params)
            new = rng.choice(["{}_", "new_{}", "{}2", "the_{}", "{}_value"])
        new = new.format(old.lstrip("_") if new.startswith("_") else old)
        return src, rename(src, {old: new}), dict(what=what, old=old, new=new)

    def fresh_name(self, rng: random.Random) -> str:
        """An identifier made of one to three words from the corpus's function names."""
        return "_".join(rng.sample(self.name_words, rng.choice([1, 2, 2, 3])))

    def edit_text(self, rng: random.Random) -> str:
        """A function and then its edited version, as one document."""
        src, edited, _ = self.edit_pair(rng)
        return f"{src}\n\n\n{edited}\n"

    def edit_chat(self, rng: random.Random) -> tuple[list[dict], list[dict] | None]:
        src, edited, rename = self.edit_pair(rng)
        while rename is None:
            src, edited, rename = self.edit_pair(rng)
        ask = rng.choice(RENAME_ASKS).format(**rename)
        messages = [
            {"role": "user", "content": f"{ask}\n\n```python\n{src}\n```"},
            {"role": "assistant", "content": f"```python\n{edited}\n```"},
        ]
        return self.system(rng) + messages, self.tools_for(rng) if rng.random() < 0.2 else None

    # (f) code in chat, no tools needed ------------------------------------------------------
    def complete_chat(self, rng: random.Random) -> tuple[list[dict], list[dict] | None]:
        """The user sends a function's first lines (its signature, its header with the
        docstring, or a few body lines more), bare, after a request or fenced; the assistant
        answers with the whole function in a ```python block. A fifth of them instead ask for
        a function by its docstring alone (INSTRUCT_PLAIN), with no signature."""
        fn = rng.choice(self.short_functions)
        desc = third_person(fn["doc"])
        if desc and rng.random() < 0.2:
            ask = rng.choice(INSTRUCT_PLAIN).format(desc=desc)
        else:
            lines = fn["source"].split("\n")
            try:
                sig_end = ast.parse(fn["source"]).body[0].body[0].lineno - 1
            except SyntaxError:
                sig_end = 0
            header_end = fn["header"].count("\n") + 1
            r = rng.random()
            if r < 0.4 and sig_end:
                code = "\n".join(lines[:sig_end])
            elif r < 0.75 or header_end >= len(lines) - 1:
                code = fn["header"]
            else:
                code = "\n".join(lines[: rng.randint(header_end + 1, len(lines) - 1)])
            r = rng.random()
            if r < 0.5:
                ask = code
            elif r < 0.75:
                ask = f"{rng.choice(COMPLETE_ASKS)}\n\n{code}"
            else:
                ask = f"{rng.choice(COMPLETE_ASKS)}\n\n```python\n{code}\n```"
        messages = [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": f"```python\n{fn['source']}\n```"},
        ]
        if rng.random() < 0.15:  # tools offered but not needed: answer directly
            return self.system(rng) + messages, self.tools_for(rng)
        return self.system(rng) + messages, None

    # (g) questions with short answers ---------------------------------------------------------
    @staticmethod
    def module_name(rel: str) -> str:
        mod = rel[:-3].replace("/", ".")
        return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod

    def question(self, rng: random.Random) -> tuple[list[dict], None]:
        """A question answered in one sentence: what a function does (named, or pasted), what a
        module is for (from the docstrings), or who the model is."""
        r = rng.random()
        if r < 0.08:
            ask, answer = rng.choice(ABOUT_ASKS), ABOUT_ANSWER
        elif r < 0.25:
            rel = rng.choice(self.files)
            summary = module_summary(self.sources[rel])
            while summary is None or " " not in summary:  # not a bare file name
                rel = rng.choice(self.files)
                summary = module_summary(self.sources[rel])
            mod = self.module_name(rel)
            ask = rng.choice(MODULE_ASKS).format(mod=mod)
            answer = f"`{mod}`: {summary}."
        else:
            fn = rng.choice(self.functions)
            while not third_person(fn["doc"]):
                fn = rng.choice(self.functions)
            desc = third_person(fn["doc"])
            if r < 0.45:
                ask = f"{rng.choice(THIS_ASKS)}\n\n```python\n{fn['source']}\n```"
                answer = f"`{fn['name']}` {desc}."
            else:
                qual = ".".join(
                    x for x in (self.module_name(fn["file"]), fn["cls"], fn["name"]) if x
                )
                if rng.random() < 0.4:
                    qual = ".".join(x for x in (fn["cls"], fn["name"]) if x)
                ask = rng.choice(WHAT_ASKS).format(qual=qual)
                answer = f"`{qual}` {desc}."
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        return self.system(rng) + messages, None

    # (c) tool use ---------------------------------------------------------------------------
    def excerpt(self, rng: random.Random, rel: str, start: int = 0) -> tuple[str, int, int]:
        lines = self.sources[rel].splitlines()
        n = rng.randint(3, 8)
        text = "\n".join(lines[start : start + n])
        while len(text) > 600 and n > 3:
            n -= 3
            text = "\n".join(lines[start : start + n])
        end = start + n
        if end < len(lines):
            text += f"\n... ({len(lines) - end} more lines)"
        return text, start, min(end, len(lines))

    def defined_in(self, rel: str, start: int, end: int) -> list[tuple[str, str, int]]:
        return [d for d in self.defs[rel] if start < d[2] <= end]

    def describe_defs(self, rng: random.Random, rel: str, path: str, start: int, end: int) -> str:
        defs = self.defined_in(rel, start, end)
        if not defs:
            return (
                f"This part of {self.quote(rng, path)} (lines {start + 1}-{end}) only has "
                "imports, comments and module-level setup; no functions or classes."
            )
        funcs = [n for k, n, _ in defs if k == "function"]
        classes = [n for k, n, _ in defs if k == "class"]
        bits = []
        if funcs:
            bits.append(
                ("the function " if len(funcs) == 1 else "the functions ") + names_phrase(funcs)
            )
        if classes:
            bits.append(
                ("the class " if len(classes) == 1 else "the classes ") + names_phrase(classes)
            )
        lead = rng.choice(
            [
                "Lines {a}-{b} of {p} define ",
                "This part of {p} (lines {a}-{b}) defines ",
                "In lines {a}-{b}, {p} defines ",
            ]
        )
        return lead.format(a=start + 1, b=end, p=self.quote(rng, path)) + " and ".join(bits) + "."

    def def_window_start(self, rng: random.Random, rel: str) -> int:
        if rng.random() < 0.5 or not self.defs[rel]:
            return 0
        return rng.choice(self.defs[rel])[2] - 1

    def test_report(self, rng: random.Random, rel: str) -> tuple[str, str, list[str]]:
        stem = rel.split("/")[-1][:-3]
        funcs = [n for k, n, _ in self.defs[rel] if k == "function"] or [stem]
        n = rng.randint(3, 40)
        failed = (
            []
            if rng.random() < 0.65
            else sorted(
                set("test_" + rng.choice(funcs).lstrip("_") for _ in range(rng.randint(1, 3)))
            )
        )
        failed = failed[: n - 1]
        marks = ["."] * n
        for i in rng.sample(range(n), len(failed)):
            marks[i] = "F"
        secs = rng.uniform(0.05, 4.0)
        lines = [f"collected {n} items", "", f"test_{stem}.py {''.join(marks)} [100%]", ""]
        if failed:
            lines += [f"FAILED test_{stem}.py::{t} - AssertionError" for t in failed]
            lines.append(f"{len(failed)} failed, {n - len(failed)} passed in {secs:.2f}s")
            answer = (
                f"{len(failed)} of {n} tests failed: {names_phrase(failed)}."
                if len(failed) > 1
                else f"1 of {n} tests failed: `{failed[0]}`."
            )
        else:
            lines.append(f"{n} passed in {secs:.2f}s")
            answer = rng.choice(
                [
                    f"All {n} tests passed.",
                    f"All {n} tests pass.",
                    f"The tests pass: {n} passed, 0 failed.",
                ]
            )
        return "\n".join(lines), answer, failed

    def tool_use(self, rng: random.Random) -> tuple[list[dict], list[dict]]:
        """One agent conversation: 1-3 user requests, each served through tool calls."""
        msgs = self.system(rng)
        for _ in range(rng.choice([1, 2, 2, 3])):
            self.exchange(rng, msgs)
        return msgs, self.tools_for(rng)

    def exchange(self, rng: random.Random, msgs: list[dict]) -> None:
        kind = rng.choices(
            ["read", "explain", "test", "fix", "list", "read2"], weights=[26, 12, 34, 10, 12, 6]
        )[0]
        rel = rng.choice(self.func_files if kind == "fix" else self.files)
        path = self.show_path(rng, rel)
        p = self.quote(rng, path)
        if kind in ("read", "explain"):
            asks = READ_ASKS if kind == "read" else EXPLAIN_ASKS
            msgs.append({"role": "user", "content": rng.choice(asks).format(p=p)})
            msgs.append(
                {"role": "assistant", "content": "", "tool_calls": [call("read_file", path=path)]}
            )
            start = self.def_window_start(rng, rel) if kind == "read" else 0
            text, a, b = self.excerpt(rng, rel, start)
            msgs.append({"role": "tool", "content": text})
            answer = self.describe_defs(rng, rel, path, a, b)
            summary = module_summary(self.sources[rel])
            if kind == "explain" and summary:
                answer = f"{self.quote(rng, path)}: {summary}. " + answer
            msgs.append({"role": "assistant", "content": answer})
        elif kind == "test":
            msgs.append({"role": "user", "content": rng.choice(TEST_ASKS).format(p=p)})
            msgs.append(
                {"role": "assistant", "content": "", "tool_calls": [call("run_tests", path=path)]}
            )
            report, answer, _ = self.test_report(rng, rel)
            msgs.append({"role": "tool", "content": report})
            msgs.append({"role": "assistant", "content": answer})
        elif kind == "fix":
            _, fname, line = rng.choice([d for d in self.defs[rel] if d[0] == "function"])
            msgs.append({"role": "user", "content": rng.choice(FIX_ASKS).format(f=fname, p=p)})
            msgs.append(
                {"role": "assistant", "content": "", "tool_calls": [call("read_file", path=path)]}
            )
            text, _, _ = self.excerpt(rng, rel, line - 1)
            msgs.append({"role": "tool", "content": text})
            msgs.append(
                {
                    "role": "assistant",
                    "content": f"`{fname}` starts at line {line}. Let me run the tests to "
                    "reproduce the problem.",
                    "tool_calls": [call("run_tests", path=path)],
                }
            )
            report, answer, failed = self.test_report(rng, rel)
            msgs.append({"role": "tool", "content": report})
            if not failed:
                answer += (
                    f" Nothing fails yet, so I need a failing case: what input makes "
                    f"`{fname}` misbehave, and what did you expect?"
                )
            msgs.append({"role": "assistant", "content": answer})
        elif kind == "list":
            folder = rel.rsplit("/", 1)[0] if "/" in rel and rng.random() < 0.8 else ""
            shown = (
                ("Lib/" + folder).rstrip("/") if path.startswith("Lib/") or not folder else folder
            )
            msgs.append(
                {"role": "user", "content": rng.choice(LIST_ASKS).format(p=self.quote(rng, shown))}
            )
            msgs.append(
                {"role": "assistant", "content": "", "tool_calls": [call("list_dir", path=shown)]}
            )
            entries = self.folders[folder]
            msgs.append({"role": "tool", "content": "\n".join(entries)})
            files = [e for e in entries if not e.endswith("/")]
            dirs = [e for e in entries if e.endswith("/")]
            answer = f"{self.quote(rng, shown)} contains {len(files)} Python file" + (
                "s" if len(files) != 1 else ""
            )
            if dirs:
                answer += f" and {len(dirs)} folder" + ("s" if len(dirs) != 1 else "")
            answer += "."
            if 0 < len(files) <= 6:
                answer += " The files are " + names_phrase(files) + "."
            msgs.append({"role": "assistant", "content": answer})
        else:  # read two files: two calls in one turn, two responses in one user turn
            rel2 = rng.choice(self.files)
            path2 = self.show_path(rng, rel2)
            msgs.append(
                {
                    "role": "user",
                    "content": rng.choice(READ2_ASKS).format(p=p, q=self.quote(rng, path2)),
                }
            )
            msgs.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("read_file", path=path), call("read_file", path=path2)],
                }
            )
            answers = []
            for r, pp in ((rel, path), (rel2, path2)):
                text, a, b = self.excerpt(rng, r, 0)
                msgs.append({"role": "tool", "content": text})
                answers.append(self.describe_defs(rng, r, pp, a, b))
            msgs.append({"role": "assistant", "content": " ".join(answers)})


# --------------------------------------------------------------------------------------------
# Data: tokenizer + per-epoch token streams, cached in the work dir


class Data:
    def __init__(self, args, work: Path):
        import torch

        self.work = work
        self.seed = args.seed
        root = stdlib_root()
        files = list_corpus(root)
        train, held, threshold = split_files(files)
        if args.smoke:
            train = train[: args.smoke_files]
        self.meta = dict(
            python=sys.version.split()[0],
            stdlib=str(root),
            n_files=len(files),
            n_train_files=len(train),
            n_heldout_files=len(held),
            heldout_threshold_percent=threshold,
            heldout_files=held,
        )
        self.sources = read_sources(root, train)
        tok_dir = work / "tokenizer"
        if args.init_from and not (tok_dir / "tokenizer.json").exists():
            tok_dir.mkdir(parents=True, exist_ok=True)  # fine-tuning keeps the model's tokenizer
            for f in TOKENIZER_FILES:
                shutil.copy(args.init_from / "target" / f, tok_dir / f)
        if not (tok_dir / "tokenizer.json").exists():
            log(f"training tokenizer on {len(self.sources)} train files")
            t0 = time.time()
            tok = train_tokenizer([self.sources[f] for f in sorted(self.sources)], VOCAB_SIZE)
            save_tokenizer(tok, tok_dir)
            log(f"tokenizer: {tok.get_vocab_size()} tokens in {time.time() - t0:.0f}s")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        self.eot = self.tokenizer.convert_tokens_to_ids(EOT)
        code_path = work / "code_tokens.pt"
        if code_path.exists():
            self.code = torch.load(code_path)
        else:
            names = sorted(self.sources)
            enc = self.tokenizer._tokenizer.encode_batch([self.sources[f] for f in names])
            self.code = {
                f: torch.tensor(e.ids, dtype=torch.int16) for f, e in zip(names, enc, strict=True)
            }
            torch.save(self.code, code_path)
        self.code_tokens = sum(len(v) for v in self.code.values())
        log(f"code: {len(self.code)} files, {self.code_tokens:,} tokens")
        self.factory = None
        self.epochs: dict[int, torch.Tensor] = {}
        self.epoch_stats: dict[int, dict] = {}

    def render(self, messages, tools) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    def _examples(self, rng, make, budget: int, chat: bool = True) -> list[list[int]]:
        out, total = [], 0
        while total < budget:
            texts = [self.render(*make(rng)) if chat else make(rng) for _ in range(64)]
            for e in self.tokenizer._tokenizer.encode_batch(texts, add_special_tokens=False):
                out.append(e.ids)
                total += len(e.ids) + 1
        return out

    def edit(self, rng: random.Random) -> str:
        """An edit as a plain document or, half of the time, as a chat."""
        if rng.random() < 0.5:
            return self.factory.edit_text(rng)
        return self.render(*self.factory.edit_chat(rng))

    def json_answer(self, rng: random.Random):
        from scripts.json_answers import json_answer

        return json_answer(rng, self.factory)

    def epoch(self, e: int, stream: str = "main"):
        """Token stream of epoch ``e`` (int16 tensor), built deterministically and cached.

        ``main``: every train file once plus the other kinds in ``MIX`` proportion to them.
        ``anneal`` / ``finetune``: ``ANNEAL_EPOCH_TOKENS`` / ``FINETUNE_EPOCH_TOKENS`` tokens in
        ``ANNEAL_MIX`` / ``FINETUNE_MIX`` proportions, code files drawn at random until they
        make their share.
        """
        import torch

        key = (stream, e)
        if key in self.epochs:
            return self.epochs[key]
        path = self.work / (f"epoch_{e}.pt" if stream == "main" else f"{stream}_{e}.pt")
        if path.exists():
            blob = torch.load(path)
        else:
            t0 = time.time()
            if self.factory is None:
                self.factory = ExampleFactory(self.sources)
            rng = random.Random(f"{self.seed}-{'' if stream == 'main' else stream + '-'}epoch-{e}")
            mix = STREAM_MIX[stream]
            code = [v.tolist() for _, v in sorted(self.code.items())]
            if stream == "main":
                total = self.code_tokens / mix["code"]
            else:
                total = ANNEAL_EPOCH_TOKENS if stream == "anneal" else FINETUNE_EPOCH_TOKENS
                rng.shuffle(code)
                budget, kept = mix["code"] * total, []
                for ids in code:
                    if budget <= 0:
                        break
                    kept.append(ids)
                    budget -= len(ids) + 1
                code = kept
            docs = [("code", ids) for ids in code]
            makers = [
                ("instruct", self.factory.instruct, True),
                ("function", self.factory.function, False),
                ("tool", self.factory.tool_use, True),
                ("edit", self.edit, False),
                ("json", self.json_answer, True),
                ("complete", self.factory.complete_chat, True),
                ("question", self.factory.question, True),
            ]
            for kind, make, chat in (m for m in makers if m[0] in mix):
                budget = int(total * mix[kind])
                docs += [(kind, ids) for ids in self._examples(rng, make, budget, chat)]
            rng.shuffle(docs)
            stats = {k: 0 for k in mix}
            counts = {k: 0 for k in mix}
            flat = []
            for kind, ids in docs:
                flat += ids
                flat.append(self.eot)
                stats[kind] += len(ids) + 1
                counts[kind] += 1
            blob = {
                "tokens": torch.tensor(flat, dtype=torch.int16),
                "stats": {"tokens": stats, "documents": counts},
            }
            torch.save(blob, path)
            log(f"{stream} epoch {e}: {len(flat):,} tokens {stats} in {time.time() - t0:.0f}s")
        self.epochs[key] = blob["tokens"]
        self.epoch_stats[key] = blob["stats"]
        return self.epochs[key]

    def batch(self, index: int, batch: int, stream: str = "main"):
        """Sequences ``index*batch ...`` of a stream's epochs, SEQ_LEN+1 tokens each."""
        import torch

        rows = []
        for i in range(index * batch, (index + 1) * batch):
            e = 0
            while True:
                n = (len(self.epoch(e, stream)) - 1) // SEQ_LEN
                if i < n:
                    break
                i -= n
                e += 1
            rows.append(self.epoch(e, stream)[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1].long())
        return torch.stack(rows)


# --------------------------------------------------------------------------------------------
# Training


def tail_mean(values: list[float], n: int, digits: int = 4) -> float | None:
    """Mean of the last n values (rounded), None when there are none."""
    tail = values[-n:]
    return round(sum(tail) / len(tail), digits) if tail else None


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizers(model, lr: float, kind: str, lr_scale: float = 1.0) -> list:
    """AdamW for everything, or Muon for the hidden matrices and AdamW for the rest.

    Every parameter group records its ``peak_lr`` (``lr`` or ``MUON_LR``, times ``lr_scale``);
    the schedule scales all of them alike.
    """
    lr *= lr_scale
    import torch

    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    embeddings = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" in n]
    gains = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": embeddings, "weight_decay": 0.1, "peak_lr": lr},
        {"params": gains, "weight_decay": 0.0, "peak_lr": lr},
    ]
    opts = []
    if kind == "muon":
        from scripts.muon import Muon

        muon_lr = MUON_LR * lr_scale
        opts.append(Muon([{"params": matrices, "peak_lr": muon_lr}], lr=muon_lr))
    else:
        groups.append({"params": matrices, "weight_decay": 0.1, "peak_lr": lr})
    opts.append(torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8))
    return opts


def build_model(name: str, tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=tokenizer.convert_tokens_to_ids(EOT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOT),
        **MODEL_SHAPES[name],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def save_checkpoint(path: Path, state: dict) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def parse_plan(text: str) -> list[list[int]]:
    """'40:612,300:580' -> [[40, 612], [300, 580]]: from step 40 the schedule ends at 612, ..."""
    return [[int(x) for x in item.split(":")] for item in text.split(",") if item]


def format_plan(plan: list[list[int]]) -> str:
    return ",".join(f"{s}:{t}" for s, t in plan)


def total_at(plan: list[list[int]], step: int) -> int | None:
    totals = [t for s, t in plan if s <= step]
    return totals[-1] if totals else None


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def train_model(
    name: str, data: Data, args, fixed_plan: list[list[int]] | None, teacher=None
) -> dict:
    """Train one model. ``fixed_plan`` replays a schedule; None plans it from the time budget.
    ``teacher`` (the trained target, when training the draft) adds the distillation term.

    The schedule is a list of ``[from_step, total_steps]``: the cosine decay of step ``s`` is
    computed against the last entry whose ``from_step <= s``. An adaptive run adds the first entry
    when warmup ends (timing the warmup steps) and re-plans every ``--replan-minutes`` from the
    measured speed, so that a busy machine still finishes near the budget. Replaying the recorded
    plan reproduces the run exactly.
    """
    import torch
    import torch.nn.functional as F

    hp = dict(TRAIN_DEFAULTS[name])
    if args.smoke:
        hp.update(warmup=2, batch=2)
    for key in ("batch", "lr"):
        if getattr(args, f"{name}_{key}") is not None:
            hp[key] = getattr(args, f"{name}_{key}")
    cuda = args.device.startswith("cuda")
    budget = args.target_minutes * 60 if name == "target" else args.draft_minutes * 60
    use_bf16 = args.autocast == "bf16" or (
        args.autocast == "auto" and (cuda or cpu_has_fast_bf16())
    )
    model = build_model(name, data.tokenizer, args.seed + (0 if name == "target" else 1))
    if args.init_from:
        from safetensors.torch import load_file

        weights = load_file(args.init_from / name / "model.safetensors")
        loaded = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:
            sys.exit(f"{args.init_from / name} does not fit the {name} shape: {loaded}")
        model.tie_weights()
        hp["warmup"] = FINETUNE_WARMUP
    if args.copy_heads:
        from scripts import copy_heads

        model.set_attn_implementation("eager")  # copy_heads supervises attention patterns
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    opts = make_optimizers(
        model, hp["lr"], args.optimizer, args.lr_scale if args.init_from else 1.0
    )
    ckpt_path = data.work / f"{name}_ckpt.pt"
    adaptive = fixed_plan is None
    plan = [list(x) for x in fixed_plan] if fixed_plan else []
    step, elapsed, losses, kls, anneal_from = 0, 0.0, [], [], None
    copy_lm, copy_attn = [], []
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False, map_location=args.device)
        if not adaptive and state["plan"] != plan[: len(state["plan"])]:
            sys.exit(
                f"{ckpt_path} follows the plan {format_plan(state['plan'])}, not "
                f"{format_plan(plan)}; delete it or pass the same plan"
            )
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(opts, state["optimizers"]):
            opt.load_state_dict(opt_state)
        step, elapsed, losses = state["step"], state["elapsed"], state["losses"]
        kls = state.get("kls", [])
        copy_lm, copy_attn = state.get("copy_lm", []), state.get("copy_attn", [])
        anneal_from = state.get("anneal_from")
        if adaptive:
            plan = state["plan"]
        log(f"{name}: resumed at step {step} (plan {format_plan(plan)}, {elapsed:.0f}s done)")
    log(
        f"{name}: {n_params:,} parameters, batch {hp['batch']}x{SEQ_LEN}, peak lr {hp['lr']}, "
        f"{'bf16 autocast' if use_bf16 else 'fp32'}, budget {budget:.0f}s, "
        f"plan {format_plan(plan) or 'after warmup'}"
    )

    def checkpoint():
        state = dict(
            model=model.state_dict(),
            optimizers=[o.state_dict() for o in opts],
            step=step,
            elapsed=elapsed,
            losses=losses,
            kls=kls,
            copy_lm=copy_lm,
            copy_attn=copy_attn,
            plan=plan,
            anneal_from=anneal_from,
        )
        save_checkpoint(ckpt_path, state)

    model.train()
    last_ckpt = time.time()
    mark = (step, elapsed)  # speed is measured from here
    while True:
        total = total_at(plan, step)
        if total is not None and step >= total:
            break
        t0 = time.time()
        lr = lr_at(step, total or 10**9, hp["lr"], hp["warmup"])
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * lr / hp["lr"]
        anneals = not args.init_from  # a fine-tune reads the fine-tuning stream throughout
        if anneals and anneal_from is None and total and step >= (1 - ANNEAL_FRACTION) * total:
            anneal_from = step  # a function of the plan, so a replay anneals at the same step
            log(f"{name}: annealing on the task-weighted stream from step {step}")
        if args.init_from:
            batch = data.batch(step, hp["batch"], "finetune")
        elif anneal_from is None:
            batch = data.batch(step, hp["batch"])
        else:
            batch = data.batch(step - anneal_from, hp["batch"], "anneal")
        batch = batch.to(args.device)
        autocast = torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=use_bf16)
        with autocast:
            out = model(input_ids=batch[:, :-1], output_attentions=args.copy_heads)
        logits = out.logits.float().reshape(-1, VOCAB_SIZE)
        loss = F.cross_entropy(logits, batch[:, 1:].reshape(-1))  # logged, as in earlier runs
        objective = loss
        if args.copy_heads:
            rng = random.Random(f"{args.seed}-{name}-copy-{step}")
            extra, lm, attn = copy_heads.copy_loss(
                model, batch[:, :-1], out.attentions, rng, autocast
            )
            objective = objective + extra
            copy_lm.append(round(lm.item(), 4))
            copy_attn.append(round(attn.item(), 4))
        if teacher is not None:
            with torch.no_grad(), autocast:
                target = teacher(input_ids=batch[:, :-1]).logits.float().reshape(-1, VOCAB_SIZE)
            kl = F.kl_div(
                F.log_softmax(logits, -1),
                F.log_softmax(target, -1),
                log_target=True,
                reduction="batchmean",
            )
            objective = objective + DISTILL_WEIGHT * kl
            kls.append(round(kl.item(), 4))
        model.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
        losses.append(round(loss.item(), 4))
        step += 1
        elapsed += time.time() - t0
        if step == 3 and not plan:
            mark = (step, elapsed)  # the first steps are slow (allocation, warm caches)
        due = not plan and step >= hp["warmup"]
        due = due or (plan and elapsed - mark[1] >= args.replan_minutes * 60)
        if adaptive and due:
            per_step = (
                (elapsed - mark[1]) / (step - mark[0]) if step - mark[0] >= 3 else (elapsed / step)
            )
            new_total = max(step + 1, step + round((budget - elapsed) / per_step))
            if args.max_steps:
                new_total = min(new_total, max(step + 1, args.max_steps))
            old_total = total_at(plan, step)
            if old_total is None or abs(new_total - old_total) > 0.02 * old_total:
                plan.append([step, new_total])
                log(f"{name}: {per_step:.2f}s/step -> schedule ends at step {new_total}")
            mark = (step, elapsed)
        total = total_at(plan, step)
        if step % args.log_every == 0 or step == total:
            recent = losses[-args.log_every :]
            tps = step * hp["batch"] * SEQ_LEN / max(elapsed, 1e-9)
            eta = (total - step) * elapsed / step if total else float("nan")
            n = len(recent)
            extra = f"kl {tail_mean(kls, n):.3f} " if kls else ""
            if copy_lm:
                extra += f"copy {tail_mean(copy_lm, n):.3f} heads {tail_mean(copy_attn, n):.3f} "
            log(
                f"{name} step {step}/{total or '?'} loss {sum(recent) / len(recent):.3f} {extra}"
                f"lr {lr:.2e} {tps:,.0f} tok/s elapsed {elapsed:.0f}s eta {eta:.0f}s"
            )
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            checkpoint()
            last_ckpt = time.time()
    checkpoint()
    return dict(
        model=model,
        params=n_params,
        steps=step,
        plan=format_plan(plan),
        batch=hp["batch"],
        default_batch=2 if args.smoke else TRAIN_DEFAULTS[name]["batch"],
        seq_len=SEQ_LEN,
        tokens_seen=step * hp["batch"] * SEQ_LEN,
        anneal_from_step=anneal_from,
        peak_lr=hp["lr"],
        optimizer=args.optimizer,
        muon_lr=MUON_LR if args.optimizer == "muon" else None,
        warmup_steps=hp["warmup"],
        precision="bf16 autocast" if use_bf16 else "fp32",
        device=args.device,
        train_seconds=round(elapsed, 1),
        final_train_loss=tail_mean(losses, 20),
        distill_weight=DISTILL_WEIGHT if teacher is not None else None,
        final_kl_to_target=tail_mean(kls, 20),
        final_copy_row_loss=tail_mean(copy_lm, 20),
        final_copy_head_loss=tail_mean(copy_attn, 20),
        budget_seconds=budget,
        shape=MODEL_SHAPES[name],
    )


def save_model(model, tokenizer_dir: Path, out: Path, tokenizer) -> None:
    import torch
    from transformers import GenerationConfig

    if out.exists():
        shutil.rmtree(out)
    model = model.to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600
    eot, im_end = tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(IM_END)
    GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot
    ).save_pretrained(str(out))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"  # older readers (and the brief) use torch_dtype
    cfg["rope_theta"] = 10000.0  # older readers expect it at top level
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, out / f)


def replay_flags(name: str, res: dict) -> str:
    plan = parse_plan(res["plan"])
    flags = f"--{name}-steps {res['steps']}" if len(plan) <= 1 else f"--{name}-plan {res['plan']}"
    if res["batch"] != res["default_batch"]:
        flags += f" --{name}-batch {res['batch']}"
    if res["peak_lr"] != TRAIN_DEFAULTS[name]["lr"]:
        flags += f" --{name}-lr {res['peak_lr']}"
    return flags


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help=f"data + checkpoints (default {DEFAULT_WORK}, or ..._smoke with --smoke)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="fine-tune: start from the target/ and draft/ weights in this folder and train on "
        "the fine-tuning stream (FINETUNE_MIX) at scaled-down learning rates",
    )
    ap.add_argument(
        "--mix",
        default=None,
        help="fine-tuning: shares of FINETUNE_MIX replaced, 'kind=share,...' (they must sum to 1)",
    )
    ap.add_argument(
        "--lr-scale",
        type=float,
        default=FINETUNE_LR_SCALE,
        help="fine-tuning: the peak learning rates (AdamW and Muon) times this",
    )
    ap.add_argument(
        "--target-minutes",
        type=float,
        default=None,
        help="time budget used to plan the target's steps (default 50; 0.5 with --smoke)",
    )
    ap.add_argument("--draft-minutes", type=float, default=None, help="default 9; 0.15 smoke")
    ap.add_argument(
        "--target-steps",
        type=int,
        default=None,
        help="exact optimizer steps for the target (overrides the time budget)",
    )
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument(
        "--target-plan",
        default=None,
        help="replay a recorded schedule 'from:total,...' (from training.json)",
    )
    ap.add_argument("--draft-plan", default=None)
    ap.add_argument("--replan-minutes", type=float, default=None, help="default 5; 0.1 smoke")
    ap.add_argument(
        "--autocast",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="auto: bf16 autocast only where the CPU has native bf16 (AVX512-BF16/AMX), else fp32",
    )
    ap.add_argument(
        "--optimizer",
        choices=["muon", "adamw"],
        default="muon",
        help="muon: Muon for the hidden matrices, AdamW for embeddings and norms",
    )
    ap.add_argument(
        "--copy-heads",
        action="store_true",
        help="supervise a previous-token and an induction head and add random-token copy rows "
        "(copy_heads.py): teaches the model to copy from its context",
    )
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is available")
    ap.add_argument(
        "--max-steps", type=int, default=None, help="cap on a time-planned schedule's end"
    )
    for name in ("target", "draft"):
        ap.add_argument(f"--{name}-batch", type=int, default=None, help="sequences per step")
        ap.add_argument(f"--{name}-lr", type=float, default=None, help="peak learning rate")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny end-to-end run: few files, ~1 minute"
    )
    ap.add_argument("--smoke-files", type=int, default=60)
    args = ap.parse_args(argv)
    if args.mix:
        for item in args.mix.split(","):
            kind, share = item.split("=")
            if kind not in FINETUNE_MIX:
                sys.exit(f"--mix: no kind {kind!r} in FINETUNE_MIX")
            FINETUNE_MIX[kind] = float(share)
        if abs(sum(FINETUNE_MIX.values()) - 1) > 1e-6:
            sys.exit(f"--mix: the shares sum to {sum(FINETUNE_MIX.values())}, not 1")
    smoke = args.smoke
    for key, full, tiny in (
        ("target_minutes", 50.0, 0.5),
        ("draft_minutes", 9.0, 0.15),
        ("replan_minutes", 5.0, 0.1),
    ):
        if getattr(args, key) is None:
            setattr(args, key, tiny if smoke else full)
    if smoke:
        args.log_every = 1
    work = args.work_dir or (
        DEFAULT_WORK.with_name("demo_train_smoke") if args.smoke else DEFAULT_WORK
    )
    work.mkdir(parents=True, exist_ok=True)
    if args.out_dir.resolve() == DEFAULT_OUT.resolve() and args.smoke:
        sys.exit("refusing to write a smoke model into the bundled assets; pass --out-dir")

    # Sleep rather than spin in OpenMP barriers: this machine is shared with other jobs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    t_start = time.time()
    command = "python -m scripts.train_demo_model " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    data = Data(args, work)
    for stream in ("finetune",) if args.init_from else ("main", "anneal"):
        data.epoch(0, stream)  # later epochs are built when (if) training reaches them
    prep_seconds = time.time() - t_start
    results, teacher = {}, None
    for name in ("target", "draft"):
        steps, plan = getattr(args, f"{name}_steps"), getattr(args, f"{name}_plan")
        fixed = parse_plan(plan) if plan else ([[0, steps]] if steps is not None else None)
        res = train_model(name, data, args, fixed, teacher)
        model = res.pop("model")
        save_model(model, work / "tokenizer", args.out_dir / name, data.tokenizer)
        if name == "target":
            model.set_attn_implementation("sdpa")  # the teacher needs no attention maps
            teacher = model.eval()  # as shipped (bf16): the draft distills from it
        res["epochs_touched"] = [f"{s}_{e}" for s, e in sorted(data.epochs)]
        results[name] = res
        log(f"{name}: saved to {args.out_dir / name}")
        del model
    tokens = {
        stream: {
            "epochs": sorted(e for s, e in data.epoch_stats if s == stream),
            **{
                k: sum(v["tokens"][k] for (s, _), v in data.epoch_stats.items() if s == stream)
                for k in STREAM_MIX[stream]
            },
        }
        for stream in sorted({s for s, _ in data.epoch_stats})
    }
    meta = dict(
        seed=args.seed,
        command=command,
        reproduce=f"python -m scripts.train_demo_model --seed {args.seed} "
        + " ".join(replay_flags(name, results[name]) for name in results)
        + (f" --optimizer {args.optimizer}" if args.optimizer != "muon" else "")
        + (f" --device {args.device}" if args.device != "cpu" else "")
        + (f" --init-from {args.init_from}" if args.init_from else "")
        + (" --copy-heads" if args.copy_heads else "")
        + (f" --mix {args.mix}" if args.mix else "")
        + (
            f" --lr-scale {args.lr_scale}"
            if args.init_from and args.lr_scale != FINETUNE_LR_SCALE
            else ""
        )
        + (" --smoke" if args.smoke else ""),
        smoke=args.smoke,
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        tokenizers=__import__("tokenizers").__version__,
        threads=args.threads,
        hardware=f"{os.cpu_count()}-core {cpu_name()} CPU, no GPU",
        wall_seconds_total=round(time.time() - t_start, 1),
        wall_seconds_data_prep=round(prep_seconds, 1),
        tokenizer=dict(
            type="byte-level BPE",
            vocab_size=len(data.tokenizer),
            special_tokens=SPECIAL_TOKENS,
            added_tokens=TOOL_TOKENS,
        ),
        mix_target_share=MIX,
        anneal=dict(mix=ANNEAL_MIX, last_fraction_of_steps=ANNEAL_FRACTION),
        data_tokens_built=tokens,
        models=results,
        corpus=data.meta,
    )
    if args.init_from:
        base = args.init_from / "training.json"
        meta["finetune"] = dict(
            mix=FINETUNE_MIX, lr_scale=args.lr_scale, warmup_steps=FINETUNE_WARMUP
        )
        meta["base"] = json.loads(base.read_text()) if base.is_file() else str(args.init_from)
    (args.out_dir / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"done in {time.time() - t_start:.0f}s; reproduce with: {meta['reproduce']}")


if __name__ == "__main__":
    main()
