#!/usr/bin/env bash
# On a GPU machine: every test (GPU variants included, no longer skipped), then the GPU
# benchmarks, with the raw output kept under bench/results/ (date, GPU, driver, commit,
# command). Needs what scripts/test.sh needs (Rust, Python), plus a CUDA driver.
set -euo pipefail
cd "$(dirname "$0")/.."
out="bench/results/$(date -u +%Y-%m-%d)-gpu.txt"
{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  echo '$ bash scripts/test.sh'; bash scripts/test.sh
  # The engine suite on the real driver, a missing GPU being a failure; both copy paths.
  for path in auto per-copy; do
    echo "\$ TENSORFERRY_EXPECT_CUDA=1 TENSORFERRY_CUDA_COPY=$path cargo test -p tensorferry --test engine"
    TENSORFERRY_EXPECT_CUDA=1 TENSORFERRY_CUDA_COPY=$path cargo test -q -p tensorferry --lib --test engine
  done
  ./target/debug/tensorferry info
  cargo build -q --release -p tensorferry-cli
  for p in gpt2 llama-like tiny-10k tiny-1k; do
    echo "\$ tensorferry bench --preset $p --device cuda:0"
    ./target/release/tensorferry bench --preset "$p" --device cuda:0
  done
  for p in gpt2 llama-like tiny-10k tiny-1k; do
    echo "\$ python bench/gpu_compare.py --preset $p"
    .venv/bin/python bench/gpu_compare.py --preset "$p"
  done
} 2>&1 | tee "$out"
echo "raw output kept in $out"
