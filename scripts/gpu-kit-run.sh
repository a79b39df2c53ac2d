#!/usr/bin/env bash
# The GPU kit's runner (copied into .gpu-kit/run.sh by scripts/gpu-kit.sh). On a GPU
# machine with python3 and a CUDA driver, and nothing else: installs the kit's wheels,
# runs the Rust test binaries on the real driver for both copy paths (under
# compute-sanitizer too, where it is present), the whole pytest suite with the GPU tests
# no longer skipped, then the GPU benchmarks. Raw output, headed with date, GPU, driver
# and commit, goes to $KIT_OUT (default: $OUT, else .gpu-kit/out). Exit status: non-zero
# when any step failed; the summary at the end lists each step.
#
# Environment: KIT_PYTHON (default python3), KIT_OUT, KIT_QUICK=1 (small benchmarks only),
# KIT_SKIP_BENCH=1.
set -uo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
PY=${KIT_PYTHON:-python3}
OUTDIR=${KIT_OUT:-${OUT:-$KIT/out}}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu-kit-$(date -u +%Y-%m-%d-%H%M).txt"
SUMMARY=()
FAILED=0

step() { # step NAME COMMAND...: runs it, records pass/fail
  local name=$1
  shift
  echo
  echo "\$ $*"
  local start=$SECONDS
  if "$@"; then
    SUMMARY+=("pass  $name ($((SECONDS - start)) s)")
  else
    SUMMARY+=("FAIL  $name ($((SECONDS - start)) s, exit $?)")
    FAILED=1
  fi
}

run() {
  echo "# tensorferry GPU kit, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(tr '\n' ' ' <"$KIT/COMMIT")"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  else
    echo "nvidia-smi: not present (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})"
  fi
  "$PY" -c 'import sys; print("python", sys.version.split()[0])'
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>/dev/null || echo "torch: not importable"

  local site=/tmp/tensorferry-kit-site
  rm -rf "$site"
  step "install tensorferry" "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$KIT"/wheels/*.whl
  # Peers for the benchmarks, one by one: one that does not fit this Python is only missing.
  for w in "$KIT"/wheels/peers/*.whl; do
    [ -e "$w" ] || continue
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$w" 2>/dev/null ||
      echo "peer wheel $(basename "$w") does not install here: its rows will say so"
  done
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  step "tensorferry info" "$KIT/bin/tensorferry" info

  for path in auto per-copy; do
    for t in lib-tests engine-tests; do
      step "$t ($path copies)" env TENSORFERRY_EXPECT_CUDA=1 TENSORFERRY_CUDA_COPY=$path "$KIT/bin/$t" -q --test-threads 4
    done
  done
  if command -v compute-sanitizer >/dev/null; then
    step "engine-tests under compute-sanitizer (memcheck)" env TENSORFERRY_EXPECT_CUDA=1 \
      compute-sanitizer --tool memcheck --error-exitcode 9 "$KIT/bin/engine-tests" -q --test-threads 1 cuda
  else
    echo "compute-sanitizer: not present, skipped"
  fi

  step "pytest (all, GPU tests included)" "$PY" -m pytest "$KIT/src/bindings/python/tests" -q -p no:cacheprovider -rs

  if [ "${KIT_SKIP_BENCH:-}" != 1 ]; then
    local presets="gpt2 llama-like tiny-10k tiny-1k" scale=1
    if [ "${KIT_QUICK:-}" = 1 ]; then presets="tiny-1k"; scale=0.1; fi
    for p in $presets; do
      step "tensorferry bench $p" "$KIT/bin/tensorferry" bench --preset "$p" --device cuda:0 --repeat 3 --scale "$scale"
    done
    for p in $presets; do
      step "gpu_compare $p" "$PY" "$KIT/src/bench/gpu_compare.py" --preset "$p" --scale "$scale"
    done
    step "python_leaf_floor (per-leaf cost, torch CPU and CUDA)" "$PY" "$KIT/src/bench/python_leaf_floor.py" --count 10000
  fi

  echo
  echo "== summary"
  printf '%s\n' "${SUMMARY[@]}"
  return $FAILED
}

run 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "raw output: $LOG"
exit "$status"
