"""What `--model` may name (`expresslane.model_source`), each checked on real files and, where
it has a counterpart, against real transformers:

- GGUF files in six quant types: a tiny random Llama written here with `gguf.GGUFWriter`, its
  q/k rows permuted as llama.cpp's converter stores them, read as transformers reads it;
- GGUF files and directories that cannot be served: one clear error, one line from the CLI;
- Hub names, offline, from a real `huggingface_hub` cache layout;
- chat templates in the files transformers saves them to;
- a config.json carrying another tool's `quantization_config`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.errors import InvalidRequestError, ModelLoadError
from expresslane.gguf_file import GgufFile
from expresslane.model_source import resolve_model
from expresslane.models import load_model
from expresslane.models.attention import AttentionMetadata, PrefillChunk
from expresslane.tokenizer import Tokenizer

from .conftest import CHAT_TEMPLATE, VOCAB, random_prompts
from .test_cli_errors import _one_line_error

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# K-quant rows are whole super-blocks of 256 values: every matrix row here is 256 or 512 long
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# K-quant super-blocks (gguf's quants.py): byte offsets of the float16 scale d and of dmin
# (Q6_K has no dmin; its d comes last), the range of d giving weights of std ~0.05 like the
# other types', and dmin / d, which centres d * scale * q - dmin * min near zero
K_BLOCKS = {
    Q.Q4_K: (0, 2, (1.5e-4, 3e-4), 7.5),
    Q.Q5_K: (0, 2, (0.7e-4, 1.5e-4), 15.5),
    Q.Q6_K: (208, None, (2.5e-5, 5e-5), None),
}
TEXTS = [
    "def add(a, b):\n    return a + b\n\n\tx = [1, 2]  # done",
    "<|im_start|>user\nhéllo wörld 😀 naïve café<|im_end|>\n",
    "  leading spaces, trailing   \n\n\nnew lines",
    "import json; json.dumps({'key': None}, indent=4)",
]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOL_TEMPLATE = "{% for t in tools %}<tool>{{ t['function']['name'] }}</tool>\n{% endfor %}"
TOOL_TEMPLATE += CHAT_TEMPLATE
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# a packed tensor beside the plain ones: GPTQ's int32 qweight; a uint8 weight (bitsandbytes)
PACKED = {
    "gptq": ("model.layers.0.self_attn.q_proj.qweight", torch.zeros(8, 64, dtype=torch.int32)),
    "bitsandbytes": ("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 32, dtype=torch.uint8)),
}


# --- a GGUF written here --------------------------------------------------------------------


def llama_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (Hugging Face name, shape [out, in]), as llama.cpp and transformers name
    them."""
    kv = KV_HEADS * HIDDEN // HEADS
    out = {
        "token_embd.weight": ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
        "output_norm.weight": ("model.norm.weight", (HIDDEN,)),
        "output.weight": ("lm_head.weight", (VOCAB, HIDDEN)),
    }
    for i in range(LAYERS):
        for gguf_name, hf_name, shape in [
            ("attn_norm", "input_layernorm", (HIDDEN,)),
            ("ffn_norm", "post_attention_layernorm", (HIDDEN,)),
            ("attn_q", "self_attn.q_proj", (HIDDEN, HIDDEN)),
            ("attn_k", "self_attn.k_proj", (kv, HIDDEN)),
            ("attn_v", "self_attn.v_proj", (kv, HIDDEN)),
            ("attn_output", "self_attn.o_proj", (HIDDEN, HIDDEN)),
            ("ffn_gate", "mlp.gate_proj", (FFN, HIDDEN)),
            ("ffn_up", "mlp.up_proj", (FFN, HIDDEN)),
            ("ffn_down", "mlp.down_proj", (HIDDEN, FFN)),
        ]:
            out[f"blk.{i}.{gguf_name}.weight"] = (f"model.layers.{i}.{hf_name}.weight", shape)
    return out


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (each head's two halves of rows
    interleaved), on whole rows: a quantized row moves as its bytes."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)


def random_k_quant(shape: tuple[int, int], qtype, rng: np.random.Generator) -> np.ndarray:
    """Valid raw K-quant rows (the gguf package cannot make them): random quants and packed
    sub-block scales, each super-block's float16 scales finite and varied."""
    values_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[qtype]
    blocks = shape[0] * shape[1] // values_per_block
    raw = rng.integers(0, 256, (blocks, bytes_per_block), dtype=np.uint8)
    d_at, dmin_at, d_range, dmin_ratio = K_BLOCKS[qtype]
    d = rng.uniform(*d_range, blocks).astype(np.float16)
    raw[:, d_at : d_at + 2] = d.view(np.uint8).reshape(blocks, 2)
    if dmin_at is not None:
        dmin = (d.astype(np.float32) * dmin_ratio).astype(np.float16)
        raw[:, dmin_at : dmin_at + 2] = dmin.view(np.uint8).reshape(blocks, 2)
    return raw.reshape(shape[0], -1)


def quantized(shape: tuple[int, int], qtype, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_BLOCKS:
        return random_k_quant(shape, qtype, rng)
    return gguf.quants.quantize(rng.normal(0, 0.05, shape).astype(np.float32), qtype)


def add_tokenizer(w, tokenizer_dir: Path) -> None:
    """The test tokenizer (byte-level BPE) as llama.cpp's converter stores one."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    control = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")  # GPT-2's split, as the test tokenizer was trained with
    w.add_token_list(tokens)
    w.add_token_types([3 if i in control else 1 for i in range(len(tokens))])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_llama_gguf(path: Path, tokenizer_dir: Path, qtype, seed: int = 0) -> dict:
    """A tiny random Llama GGUF, its matrices in `qtype`, its norms float32. Returns the
    Hugging Face-layout values it holds (dequantized, q/k rows in order), by GGUF name."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(w, tokenizer_dir)
    expected = {}
    for name, (_, shape) in llama_tensors().items():
        if len(shape) == 1:
            expected[name] = (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
            w.add_tensor(name, expected[name])
            continue
        rows = quantized(shape, qtype, rng)  # in Hugging Face order
        expected[name] = gguf.quants.dequantize(rows, qtype)
        if ".attn_q." in name or ".attn_k." in name:
            rows = llama_cpp_permute(rows, HEADS if ".attn_q." in name else KV_HEADS)
        w.add_tensor(name, np.ascontiguousarray(rows), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def write_gpt2_gguf(path: Path) -> None:
    """A valid GGUF of an architecture expresslane does not run."""
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- a Hugging Face Hub cache ---------------------------------------------------------------


def hub_cache(root: Path, repo_id: str, files: Path, listed: list[str] | None = None) -> Path:
    """`repo_id` at COMMIT in a cache laid out as `huggingface_hub` 2.x leaves it: files in
    blobs/ (git blob ids; sha256 for LFS files), linked from snapshots/COMMIT/, refs/main
    naming the commit (no newline), and the tree listing it checks a snapshot against offline
    (trees/COMMIT.json: `listed`, by default every file). Returns the snapshot."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    tree = {}
    for f in sorted(p for p in files.iterdir() if p.is_file()):
        data = f.read_bytes()
        git_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        entry = {"size": len(data), "blob_id": git_id}
        blob = git_id
        if f.suffix == ".safetensors":
            blob = hashlib.sha256(data).hexdigest()
            entry |= {"lfs_sha256": blob, "lfs_size": len(data)}
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob))
        tree[f.name] = entry
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    if listed is not None:
        tree = {name: tree.get(name, {"size": 1, "blob_id": "0" * 40}) for name in listed}
    (repo / "trees").mkdir()
    (repo / "trees" / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache, offline. `huggingface_hub.constants` reads HF_HUB_CACHE and
    HF_HUB_OFFLINE once, at import (snapshot_download and its offline check read those
    module attributes), so they are patched there; the variables are set too, for anything
    that reads them later."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # ORG/NAME must not also be a path here
    resolve_model.cache_clear()
    yield cache
    resolve_model.cache_clear()


# --- shared fixtures and helpers ------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def own_gguf_cache(tmp_path_factory):
    """GGUF views go to this module's own $XDG_CACHE_HOME, not the user's. The C++ kernels
    are loaded first: torch builds them under $XDG_CACHE_HOME too, and would build again."""
    from expresslane.kernels import cpu_kernels

    cpu_kernels()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        resolve_model.cache_clear()
        yield
    resolve_model.cache_clear()


@pytest.fixture(scope="module")
def tiny_gguf(llama_dir, tmp_path_factory):
    """qtype -> (the GGUF file, alone in its directory; the values it holds), made once."""
    made = {}

    def make(qtype) -> tuple[Path, dict]:
        if qtype not in made:
            path = tmp_path_factory.mktemp(qtype.name) / "tiny.gguf"
            made[qtype] = path, write_llama_gguf(path, llama_dir, qtype)
        return made[qtype]

    return make


def hf_from_gguf(path: Path, bf16_matrices: bool = False):
    """transformers' own GGUF load, in float32; `bf16_matrices`: the matrices then rounded to
    bf16, as `GgufFile.tensors` widens them for the engine (norms stay float32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    if bf16_matrices:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.copy_(p.to(torch.bfloat16).float())
    return model


def prefill_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model, cfg = load_model(model_dir, torch.float32, torch.device("cpu"), 512)
    T = len(ids)
    model.bind_kv_cache(
        [torch.zeros(2, cfg.num_kv_heads, 512, cfg.head_dim) for _ in range(cfg.num_layers)]
    )
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)])
    with torch.no_grad():
        return model(ids, torch.arange(T), meta)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def model_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


# --- GGUF quant types -----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_gguf_tensors_are_the_hugging_face_ones(tiny_gguf, qtype):
    """Every value exactly as quantized, q/k rows back in Hugging Face order; transformers'
    loader reads the same values (which checks the file too)."""
    path, expected = tiny_gguf(qtype)
    ours = GgufFile(path).tensors(torch.float32)
    theirs = hf_from_gguf(path).state_dict()
    assert set(ours) == set(theirs) == {hf for hf, _ in llama_tensors().values()}
    for gguf_name, (hf_name, _) in llama_tensors().items():
        values = torch.from_numpy(expected[gguf_name])
        # `.to(float32)` also widens a weight kept in its 4-bit blocks
        assert torch.equal(ours[hf_name].to(torch.float32), values), hf_name
        assert torch.equal(theirs[hf_name], values), hf_name


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_gguf_prefill_logits_match_transformers(tiny_gguf, qtype, monkeypatch):
    """The engine keeps a GGUF's matrices in bf16 (`GgufFile.tensors`), so transformers gets
    the same bf16-rounded matrices; both then compute in float32 and differ only in the order
    of sums (measured: under 2e-5, logits up to ~5). The rounding alone moves logits by
    2e-2 to 6e-2, a wrong q/k row order by far more. Weights run dequantized: the 4-bit
    kernels, where a build keeps Q4 blocks, are tested against their own reference."""
    monkeypatch.setenv("EXPRESSLANE_GGUF_4BIT", "0")
    path, _ = tiny_gguf(qtype)
    ids = torch.tensor(random_prompts(1, 80, 81, seed=3)[0])
    ours = prefill_logits(resolve_model(str(path)), ids)
    with torch.no_grad():
        ref = hf_from_gguf(path, bf16_matrices=True)(ids[None]).logits[0]
    assert ref.std() > 0.5  # logits that tell tokens apart
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_gguf_greedy_matches_transformers(tiny_gguf, monkeypatch):
    """`LLM(file.gguf)`, end to end: the view, its config, the tokens it decodes."""
    monkeypatch.setenv("EXPRESSLANE_GGUF_4BIT", "0")
    path, _ = tiny_gguf(Q.Q6_K)
    hf = hf_from_gguf(path, bf16_matrices=True)
    prompts = random_prompts(3, 5, 40, seed=5)
    refs = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        refs.append(out[0, len(p) :].tolist())
    assert greedy(LLM(str(path), dtype="float32"), prompts) == refs
    assert greedy(LLM(str(path.parent), dtype="float32"), prompts) == refs  # its directory


def test_gguf_tokenizer_encodes_as_transformers(tiny_gguf, llama_dir):
    path, _ = tiny_gguf(Q.Q8_0)
    ours = Tokenizer.from_dir(resolve_model(str(path)))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    original = Tokenizer.from_dir(llama_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ids == original.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>")[0] == original.token_to_id("<|im_start|>")
    assert ours.eos_token == "<|im_end|>"


def test_gguf_chat_template_renders(tiny_gguf):
    path, _ = tiny_gguf(Q.Q8_0)
    ours = Tokenizer.from_dir(resolve_model(str(path)))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = ours.apply_chat_template(MESSAGES)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


# --- what cannot be served ------------------------------------------------------------------


def unservable(tmp_path: Path) -> dict[str, tuple[Path, list[str]]]:
    """Case -> (what --model names, what its error must say)."""
    gpt2 = tmp_path / "gpt2" / "model.gguf"
    gpt2.parent.mkdir()
    write_gpt2_gguf(gpt2)
    fake = tmp_path / "fake" / "x.gguf"
    fake.parent.mkdir()
    fake.write_text('{"not": "a gguf file"}\n')
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a-Q4_0.gguf", "b-Q8_0.gguf"):
        write_gpt2_gguf(two / name)
    return {
        "gpt2": (gpt2, ["unsupported GGUF architecture 'gpt2'", "llama"]),
        "not-gguf": (fake, ["x.gguf is not a readable GGUF file"]),
        "two-files": (two, ["several GGUF files", "a-Q4_0.gguf", "b-Q8_0.gguf"]),
    }


@pytest.mark.parametrize("case", ["gpt2", "not-gguf", "two-files"])
def test_unservable_gguf_is_a_clear_error(tmp_path, case):
    path, says = unservable(tmp_path)[case]
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path))
    assert all(s in str(e.value) for s in says), str(e.value)
    views = Path(os.environ["XDG_CACHE_HOME"], "expresslane", "gguf")
    assert not list(views.glob(f"{path.stem}-*"))  # no view, not even a half-made one


@pytest.mark.parametrize("case", ["gpt2", "not-gguf", "two-files"])
def test_unservable_gguf_is_one_line_from_the_cli(capsys, tmp_path, case):
    path, says = unservable(tmp_path)[case]
    line = _one_line_error(capsys, ["serve", "--model", str(path)])
    assert all(s in line for s in says), line


# --- Hub names, offline ---------------------------------------------------------------------


def test_hub_name_resolves_to_the_cached_snapshot(offline_hub, llama_dir):
    snapshot = hub_cache(offline_hub, "tiny-org/tiny-llama", llama_dir)
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    prompts = random_prompts(3, 5, 40, seed=7)
    from_hub = greedy(LLM("tiny-org/tiny-llama", dtype="float32"), prompts)
    assert from_hub == greedy(LLM(str(llama_dir), dtype="float32"), prompts)


def test_hub_name_not_in_the_cache(offline_hub, llama_dir, capsys):
    hub_cache(offline_hub, "tiny-org/tiny-llama", llama_dir)
    with pytest.raises(ModelLoadError, match="tiny-org/other is not in the Hugging Face cache"):
        resolve_model("tiny-org/other")
    line = _one_line_error(capsys, ["serve", "--model", "tiny-org/other"])
    assert "not in the Hugging Face cache" in line and "offline" in line


def test_hub_snapshot_missing_a_listed_file(offline_hub, llama_dir):
    """A snapshot whose download stopped part way: its tree listing names a file it lacks."""
    files = model_copy(llama_dir, offline_hub.parent / "partial")
    (files / "model.safetensors").unlink()
    listed = [f.name for f in files.iterdir()] + ["model.safetensors"]
    hub_cache(offline_hub, "tiny-org/partial", files, listed=listed)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        resolve_model("tiny-org/partial")


# --- chat templates as transformers saves them ----------------------------------------------


def template_dir(tmp_path: Path, llama_dir: Path, where: str) -> Path:
    """The test tokenizer with its chat template moved out of tokenizer_config.json to
    `where` (the default template, and a tool_use one where named)."""
    out = tmp_path / where
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, out)
    config = out / "tokenizer_config.json"
    edit_json(config, chat_template=None)
    if where == "jinja":
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    elif where == "json":
        (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    elif where == "named-files":
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        (out / "additional_chat_templates").mkdir()
        (out / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    elif where == "named-list":
        named = [("default", CHAT_TEMPLATE), ("tool_use", TOOL_TEMPLATE)]
        edit_json(config, chat_template=[{"name": n, "template": t} for n, t in named])
    return out


@pytest.mark.parametrize("where", ["jinja", "json", "named-files", "named-list"])
def test_chat_template_files(tmp_path, llama_dir, where):
    path = template_dir(tmp_path, llama_dir, where)
    ours = Tokenizer.from_dir(path)
    plain = ours.apply_chat_template(MESSAGES)
    with_tools = ours.apply_chat_template(MESSAGES, tools=TOOLS)
    assert plain == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert with_tools == ("<tool>add</tool>\n" + plain if where.startswith("named") else plain)
    if where != "json":  # transformers reads chat_template.json for processors only
        theirs = transformers.AutoTokenizer.from_pretrained(path)
        for tools, text in ((None, plain), (TOOLS, with_tools)):
            kw = dict(tokenize=False, add_generation_prompt=True)
            assert theirs.apply_chat_template(MESSAGES, tools=tools, **kw) == text


def test_no_chat_template_anywhere(tmp_path, llama_dir):
    tok = Tokenizer.from_dir(template_dir(tmp_path, llama_dir, "nowhere"))
    with pytest.raises(InvalidRequestError, match="no chat template") as e:
        tok.apply_chat_template(MESSAGES)
    assert e.value.status == 400
    assert tok.encode("plain text still works")


# --- another tool's quantization_config -----------------------------------------------------


def test_gguf_quantization_config_over_plain_tensors_is_ignored(tmp_path, llama_dir):
    """What transformers writes when it saves a model it loaded from a GGUF."""
    path = model_copy(llama_dir, tmp_path / "from-gguf")
    qc = {"quant_method": "gguf", "gguf_file": "tiny.gguf", "dequantize": False}
    edit_json(path / "config.json", quantization_config=qc)
    prompts = random_prompts(3, 5, 40, seed=9)
    expected = greedy(LLM(str(llama_dir), dtype="float32"), prompts)
    assert greedy(LLM(str(path), dtype="float32"), prompts) == expected


@pytest.mark.parametrize("method", list(PACKED))
def test_packed_tensors_of_another_tool_are_refused(tmp_path, llama_dir, method):
    from safetensors.torch import load_file, save_file

    name, tensor = PACKED[method]
    path = model_copy(llama_dir, tmp_path / method)
    edit_json(path / "config.json", quantization_config={"quant_method": method, "bits": 4})
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, name: tensor}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"quantized by '{method}'"):
        LLM(str(path), dtype="float32")
