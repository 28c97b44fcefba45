"""What `expresslane serve` checks before it loads the model, so that a mistake costs one line
and exit status 2 instead of a traceback after the load: the types of config-file values, the
device, and the address to listen on (bound here, then handed to uvicorn)."""

from __future__ import annotations

import socket
from dataclasses import fields

_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "None": lambda v: v is None,
}


def check_types(cls, data: dict, table: str) -> None:
    """ValueError naming the first value of `data` whose type does not match the field of the
    dataclass `cls` it sets (annotations such as `int`, `float | None`, `list[str] | None`)."""
    annotations = {f.name: str(f.type) for f in fields(cls)}
    for name, value in data.items():
        spec = annotations.get(name)
        if spec is None:
            continue
        kinds = [part.strip().split("[")[0] for part in spec.split("|")]
        if any(kind not in _CHECKS for kind in kinds):
            continue  # a type this check does not know: left to the code that uses it
        if not any(_CHECKS[kind](value) for kind in kinds):
            want = " or ".join("unset" if k == "None" else k for k in kinds)
            raise ValueError(f"[{table}] {name} = {value!r}: expected {want}")


def device_problem(device: str) -> str | None:
    """Why this torch cannot run on `device`, or None."""
    import torch

    if device == "auto":
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"{device!r} is not a device; use auto, cpu, cuda or cuda:N"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return (
                f"{device}: this torch ({torch.__version__}) has no CUDA device; "
                "use --device cpu or auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"{device}: there are {torch.cuda.device_count()} CUDA device(s)"
    elif dev.type != "cpu":
        return f"{device}: only cpu and cuda devices are supported"
    return None


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts when uvicorn serves on it); OSError with
    a message that names the address if it cannot be had (in use, no such address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, OverflowError, UnicodeError) as e:
        raise OSError(f"cannot listen on {host}:{port}: {_reason(e)}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {_reason(e)}") from None
    sock.set_inheritable(True)
    return sock


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e)
