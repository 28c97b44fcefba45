"""Calibrations kept between starts: the timed steps of `calibrate`, one file per machine,
model files, engine settings and code version, so that a restart is ready in seconds and
publishes the promise the first start measured (the live steps refine the fit as before).

The folder is `EngineConfig.calibration_cache`, else $EXPRESSLANE_CALIBRATION_CACHE, else
~/.cache/expresslane/calibration; "off" measures at every start. A file that does not parse
is measured anew and replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from expresslane.config import EngineConfig

log = logging.getLogger("expresslane.engine")
FORMAT = 1  # of the files: a change makes every kept calibration a miss
OFF = "off"


def cache_dir(config: EngineConfig) -> Path | None:
    """Where calibrations are kept; None when they are not."""
    chosen = config.calibration_cache or os.environ.get("EXPRESSLANE_CALIBRATION_CACHE")
    if chosen == OFF:
        return None
    if chosen:
        return Path(chosen)
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "expresslane" / "calibration"


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def machine(device: torch.device) -> dict:
    """What a step's time depends on besides the model and the settings."""
    facts = {
        "cpu": hashlib.sha256(_cpu().encode()).hexdigest()[:16],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device.type,
    }
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


@functools.cache
def code_version() -> str:
    """A digest of the package's sources: any change to the code measures anew."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_files(model_dir: Path) -> list[tuple[str, int, int]]:
    """Name, size and modification time of each file of the model (links followed)."""
    out = []
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            out.append((path.name, stat.st_size, stat.st_mtime_ns))
    return out


def key_parts(config: EngineConfig, model_dir: Path, device: torch.device) -> dict:
    settings = dataclasses.asdict(config)
    for name in ("calibrate", "calibration_cache", "seed"):  # no bearing on a step's time
        settings.pop(name)
    return {
        "format": FORMAT,
        "machine": machine(device),
        "model": [str(model_dir.resolve()), model_files(model_dir)],
        "settings": settings,
        "environment": {
            k: v
            for k, v in os.environ.items()
            if k.startswith("EXPRESSLANE_") and k != "EXPRESSLANE_CALIBRATION_CACHE"
        },
        "code": code_version(),
    }


class CalibrationCache:
    """One calibration's file, named by the digest of its key's parts."""

    def __init__(self, folder: Path, parts: dict):
        self.parts = parts
        text = json.dumps(parts, sort_keys=True, default=str)
        self.path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"

    @classmethod
    def of(cls, config: EngineConfig, model_dir: Path, device: torch.device):
        folder = cache_dir(config)
        return None if folder is None else cls(folder, key_parts(config, model_dir, device))

    def load(self) -> dict | None:
        """The kept step times (`StepLatencyModel.export`), or None."""
        try:
            saved = json.loads(self.path.read_text())
            return saved["steps"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("calibration %s unreadable (%s): measuring anew", self.path, e)
            return None

    def save(self, steps: dict) -> None:
        record = {"measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "key": self.parts}
        record["steps"] = steps
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.part")
            tmp.write_text(json.dumps(record, default=str))
            tmp.replace(self.path)  # whole or not at all, whoever writes last
        except OSError as e:
            log.warning("could not keep the calibration in %s: %s", self.path, e)
