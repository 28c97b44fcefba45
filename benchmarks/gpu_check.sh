#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): prepare Python, then benchmarks/gpu_check.py's
# parts (the CUDA tests, then the GPU figures), all written to OUT/gpu_check.json.
#
#   bash benchmarks/gpu_check.sh OUT            on a CUDA machine
#   bash benchmarks/gpu_check.sh --dry-run OUT  the same on this CPU, tiny sizes (a default test)
#   bash benchmarks/gpu_check.sh --wheels       where the package registries are reachable:
#                                               fetch into .whl/ the wheels a CUDA machine
#                                               without them lacks (carry .whl along)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=gpu
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    --wheels) mode=wheels; shift ;;
esac

# What a CUDA image with PyTorch, transformers and pytest usually lacks of the project's needs
# (a machine of this workplace's 'cuda' image: the server's stack and two parsers).
MISSING="fastapi fastapi-offline starlette uvicorn pydantic pydantic-core annotated-types
typing-inspection websockets llguidance gguf pytest-asyncio"

if [[ $mode == wheels ]]; then
    # the versions this environment runs, so that pins between them (pydantic and its core)
    # hold; Python 3.12 on x86-64 Linux, as the GPU machines have
    pins=$(python -m pip freeze | grep -iE "^($(echo $MISSING | tr ' ' '|' | sed 's/-/[-_]/g'))==" || true)
    mkdir -p .whl
    platforms=()
    for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # shellcheck disable=SC2086
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl $pins
    ls .whl
    exit 0
fi

out=${1:?usage: bash benchmarks/gpu_check.sh [--dry-run] OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if [[ $mode == dry ]]; then
    exec "${PYTHON:-python}" benchmarks/gpu_check.py "$out" --dry-run
fi

py=python3
if ! $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    # no CUDA build of torch here: PyPI's default Linux wheel is one
    python3 -m venv /tmp/expresslane-gpu-venv
    py=/tmp/expresslane-gpu-venv/bin/python
    $py -m pip install --quiet torch
fi
deps=$($py -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
source=()
[[ -d .whl ]] && source=(--no-index --find-links .whl)  # no registry: the carried wheels
mapfile -t reqs <<<"$deps"
$py -m pip install --quiet "${source[@]}" "${reqs[@]}" pytest pytest-asyncio transformers scipy
exec timeout 540 $py benchmarks/gpu_check.py "$out"
