"""What `--model` names, resolved to a Hugging Face-format directory that the loader, the
tokenizer and the request factory read:

- a directory with `config.json`: itself;
- a GGUF file, or a directory holding one GGUF file and no `config.json`: a small folder in the
  cache holding the file's metadata as `config.json`, `tokenizer.json`,
  `tokenizer_config.json` and `generation_config.json`, and a link to the file, whose tensors
  `checkpoint.read_checkpoint` reads in place (made once per file, by its path, size and
  modification time);
- `ORG/NAME` that is no local path: a Hub repository, through `huggingface_hub` (its cache;
  a download where the network allows; `HF_HUB_OFFLINE=1` reads the cache only), as vLLM does;
  the snapshot then follows the rules above (a cached snapshot holding one GGUF file serves
  it; GGUF files are not downloaded: a repository holds several, one per quantization).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from expresslane.errors import ModelLoadError

_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
# what a served model needs from a Hub repository
_HUB_FILES = ["*.json", "*.jinja", "*.safetensors", "*.model", "*.txt"]


def model_problem(spec: str) -> str | None:
    """Why `spec` names no model this machine can serve, or None (checked before start)."""
    try:
        resolve_model(spec)
    except ModelLoadError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=16)
def resolve_model(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec} is a file but not a .gguf file; pass a model directory")
        return gguf_view(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_view(ggufs[0])
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ModelLoadError(f"{spec} holds several GGUF files ({names}): pass one of them")
        raise ModelLoadError(
            f"{spec} is not a Hugging Face model directory (it has no config.json) "
            "and holds no .gguf file"
        )
    if _HUB_NAME.fullmatch(spec) and not spec.startswith(("./", "../")):
        return resolve_model(str(hub_snapshot(spec)))  # a GGUF-only snapshot: its file
    raise ModelLoadError(f"{spec} does not exist (a model directory, a .gguf file or ORG/NAME)")


def hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(
            f"{repo_id} is not in the Hugging Face cache and cannot be downloaded here "
            f"(offline or unreachable): {e}"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(
            f"{repo_id} could not be fetched from the Hugging Face Hub: {e}"
        ) from e


def _cache_root() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "expresslane" / "gguf"


def gguf_view(file: Path) -> Path:
    from expresslane.gguf_file import GgufFile
    from expresslane.gguf_tokenizer import generation_eos, write_tokenizer

    file = file.resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = _cache_root() / f"{file.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    g = GgufFile(file)
    tmp = out.with_name(out.name + f".part{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tokenizer(g, tmp)
    eos = generation_eos(g)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    (tmp / "model.gguf").symlink_to(file)
    (tmp / "config.json").write_text(json.dumps(g.config(), indent=2))  # last: marks it whole
    try:
        tmp.replace(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
