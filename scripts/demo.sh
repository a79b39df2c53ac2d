#!/usr/bin/env bash
# Sets everything up (Python environment, wheel) and runs the demo: a state-dict-like
# dictionary built on the best device present, moved, converted to NumPy, saved and
# reloaded, with what happened printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-python.sh
cargo build -q --release -p tensorferry-cli
./target/release/tensorferry info
.venv/bin/python examples/demo.py
