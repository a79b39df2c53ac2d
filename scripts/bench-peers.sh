#!/usr/bin/env bash
# The peers bench/object_store.py compares tensorferry with, installed into one folder
# (not into the environment: none of them is a dependency of tensorferry).
#
#   bash scripts/bench-peers.sh [DIR]     # default DIR: target/bench-peers
#   PYTHONPATH=bindings/python/python:DIR python bench/object_store.py ...
#
# s3fs is pinned (its releases move with fsspec's); boto3 comes at its newest. The Run:ai
# Model Streamer is installed without its dependencies: it asks for a torch and a boto3 of
# its own choosing, and the bench uses the environment's torch (humanize is the one
# dependency it imports that the environment lacks). Skips the install when DIR holds
# them all already.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-$PWD/target/bench-peers}"
PYTHON="${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}"
if [ -d "$DIR/boto3" ] && [ -d "$DIR/s3fs" ] && [ -d "$DIR/runai_model_streamer" ] \
  && [ -d "$DIR/runai_model_streamer_s3" ] && [ -d "$DIR/humanize" ]; then
  echo "$DIR"
  exit 0
fi
mkdir -p "$DIR"
"$PYTHON" -m pip install -q --target "$DIR" "s3fs==2026.9.0" boto3 >&2
"$PYTHON" -m pip install -q --target "$DIR" --no-deps runai-model-streamer runai-model-streamer-s3 humanize >&2
echo "$DIR"
