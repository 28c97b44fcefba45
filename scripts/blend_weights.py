"""Blend two checkpoints of the same shape (a weight average, "model soup"): w·A + (1-w)·B per
tensor, computed in float32 and stored in A's dtype; A's other files (config, tokenizer) are
copied beside it. Stage 8 of the demo model (MODEL_CARD.md) is made this way.

    python -m scripts.blend_weights A_DIR B_DIR --weight 0.7 --out-dir OUT
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def blend(a: Path, b: Path, weight: float, out: Path) -> None:
    wa, wb = load_file(a / WEIGHTS), load_file(b / WEIGHTS)
    if wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
        raise SystemExit(f"{a} and {b} do not hold the same tensors")
    out.mkdir(parents=True, exist_ok=True)
    for f in a.iterdir():
        if f.is_file() and f.name != WEIGHTS:
            shutil.copy(f, out / f.name)
    mixed = {k: (weight * wa[k].float() + (1 - weight) * wb[k].float()).to(wa[k].dtype) for k in wa}
    save_file(mixed, out / WEIGHTS, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="a model directory (its config and tokenizer are kept)")
    ap.add_argument("b", type=Path)
    ap.add_argument("--weight", type=float, default=0.5, help="A's share")
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    if not 0.0 <= args.weight <= 1.0:
        ap.error("--weight must be in [0, 1]")
    blend(args.a, args.b, args.weight, args.out_dir)


if __name__ == "__main__":
    main()
