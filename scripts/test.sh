#!/usr/bin/env bash
# Runs every test: Rust format and lint checks, Rust tests, then the Python package
# built into .venv and its pytest suite (including the docstring examples).
# GPU tests are part of the same suites and skip with their reason when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo fmt"; cargo fmt --all -- --check
echo "== cargo clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"; cargo test --workspace
echo "== python package"; bash scripts/setup-python.sh
echo "== pytest"
.venv/bin/python -m pytest bindings/python/tests --doctest-modules --pyargs tensorferry -q -p no:cacheprovider
