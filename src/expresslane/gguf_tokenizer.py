"""A GGUF file's tokenizer, rebuilt as the Hugging Face `tokenizer.json` and
`tokenizer_config.json` that `Tokenizer` reads.

GGUF keeps a byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`) as its tokens, merges and
token types, and names its pre-tokenizer (`tokenizer.ggml.pre`); the split rules below are
llama.cpp's for those names (the same as the original tokenizers'). A SentencePiece BPE
tokenizer (`llama`: Gemma, Llama 2, Mistral) comes as tokens with scores: its merges are every
pair of pieces that makes another piece, ranked by that piece's score (SentencePiece merges the
best-scoring pair first), spaces are "▁", and characters outside the vocabulary fall back to
byte tokens. Control tokens become special tokens; user-defined ones are added tokens matched
whole.
"""

from __future__ import annotations

import json

from expresslane.errors import ModelLoadError
from expresslane.gguf_file import GgufFile

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> regexes applied in turn (each splits what the one before left)
PRE_TOKENIZERS = {
    "default": [_GPT2],
    "gpt-2": [_GPT2],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
}
_CONTROL, _USER_DEFINED = 3, 4


_NORMAL, _BYTE = 1, 6
SPACE = "\u2581"  # SentencePiece's "▁"


def tokenizer_json(f: GgufFile) -> dict:
    model = f.field("tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece_json(f)
    if model != "gpt2":
        raise ModelLoadError(
            f"{f.path.name}: GGUF tokenizer model {model!r} is not supported yet "
            "(byte-level BPE, 'gpt2', and SentencePiece BPE, 'llama', are)"
        )
    pre = f.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{f.path.name}: GGUF pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens = f.field("tokenizer.ggml.tokens")
    return {
        "version": "1.0",
        "added_tokens": _added_tokens(f, tokens),
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(PRE_TOKENIZERS[pre]),
        "post_processor": _post_processor(f, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True},
        "model": {
            "type": "BPE",
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": f.field("tokenizer.ggml.merges"),
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
        },
    }


def _added_tokens(f: GgufFile, tokens: list[str]) -> list[dict]:
    types = f.field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    return [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": t != _CONTROL,
            "special": t == _CONTROL,
        }
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]


def _sentencepiece_json(f: GgufFile) -> dict:
    tokens = f.field("tokenizer.ggml.tokens")
    unk = f.field("tokenizer.ggml.unknown_token_id")
    normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if f.field("tokenizer.ggml.add_space_prefix", True):
        normalizer = {
            "type": "Sequence",
            "normalizers": [{"type": "Prepend", "prepend": SPACE}, normalizer],
        }
    decoders = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if f.field("tokenizer.ggml.add_space_prefix", True):
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "added_tokens": _added_tokens(f, tokens),
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "post_processor": _post_processor(f, tokens),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": sentencepiece_merges(f, tokens),
            "unk_token": tokens[unk] if unk is not None else None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
        },
    }


def sentencepiece_merges(f: GgufFile, tokens: list[str]) -> list[list[str]]:
    """Every (left, right) whose concatenation is a normal piece, best-scoring result first
    (then by the parts' ids, as transformers' converter orders them)."""
    scores = f.field("tokenizer.ggml.scores")
    types = f.field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    merges = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                merges.append((-scores[i], left, right))
    merges.sort()
    return [[tokens[a], tokens[b]] for _, a, b in merges]


def _pre_tokenizer(regexes: list[str]) -> dict:
    splits = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in regexes
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    return {"type": "Sequence", "pretokenizers": [*splits, {**byte_level, "use_regex": False}]}


def _post_processor(f: GgufFile, tokens: list[str]) -> dict | None:
    bos = f.field("tokenizer.ggml.bos_token_id")
    if not f.field("tokenizer.ggml.add_bos_token", False) or bos is None:
        return None
    special = {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}
    seq = {"Sequence": {"id": "A", "type_id": 0}}
    head = {"SpecialToken": {"id": tokens[bos], "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [head, seq],
        "pair": [head, seq, head, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": special,
    }


def tokenizer_config(f: GgufFile) -> dict:
    tokens = f.field("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = f.field(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(f.field("tokenizer.ggml.add_bos_token", False)),
    }
    template = f.field("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def generation_eos(f: GgufFile) -> list[int]:
    """Every token that ends a turn: eos, and end-of-turn / end-of-message where given."""
    keys = ("eos", "eot", "eom")
    ids = [f.field(f"tokenizer.ggml.{k}_token_id") for k in keys]
    return sorted({i for i in ids if i is not None})


def write_tokenizer(f: GgufFile, out) -> None:
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(f), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(f), indent=2))
