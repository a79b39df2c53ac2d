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
# KIT_SKIP_BENCH=1, KIT_ONLY=checkpoint | checkpoint-load | checkpoint-save | dcp | fanout (install,
# then only those benchmarks: a device call of their own; dcp: PyTorch DCP's storage layers on a
# GPU state dict, bench/dcp_compare.py --device cuda; fanout: one checkpoint loaded on 1, 2, 4, 8
# GPUs with process_group= over NCCL, InstantTensor's and fastsafetensors' process-group loaders
# beside it, bench/fanout.py --device cuda; it needs torch to see 2 GPUs or more), KIT_DEADLINE_S (seconds from the start
# by which the checkpoint benchmarks must have ended; default 570, inside a 10-minute call:
# each gets `timeout` and --budget from what is left, and is skipped below a minute),
# KIT_BENCH_DIR (their scratch folder; default /var/tmp or /tmp, the one with more room that
# is not tmpfs; 8 GB there needs 25 GB free, and each step's files are removed after it).
set -uo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
PY=${KIT_PYTHON:-python3}
START=$SECONDS
DEADLINE=${KIT_DEADLINE_S:-570}
ONLY=${KIT_ONLY:-}
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

ckpt_base() { # a local disk with room for the checkpoint files: KIT_BENCH_DIR, else /var/tmp or /tmp
  if [ -n "${KIT_BENCH_DIR:-}" ]; then
    mkdir -p "$KIT_BENCH_DIR" && echo "$KIT_BENCH_DIR"
    return
  fi
  local best=/tmp most=-1 d free
  for d in /var/tmp /tmp; do
    [ -d "$d" ] && [ -w "$d" ] || continue
    [ "$(stat -f -c %T "$d" 2>/dev/null)" = tmpfs ] && continue
    free=$(df -Pk "$d" 2>/dev/null | awk 'NR == 2 { print $4 }')
    if [ "${free:-0}" -gt "$most" ]; then best=$d most=${free:-0}; fi
  done
  echo "$best"
}

time_share() { # time_share NAME SHARE: prints SHARE % of the time left before KIT_DEADLINE_S (at most
  # 900 s); under a minute, says NAME is skipped and fails (the caller records it)
  local left=$(((DEADLINE - (SECONDS - START) - 20) * $2 / 100))
  if [ "$left" -gt 900 ]; then left=900; fi
  if [ "$left" -lt 60 ]; then
    echo >&2
    echo "skipped $1: $((DEADLINE - (SECONDS - START))) s left before KIT_DEADLINE_S=$DEADLINE" >&2
    return 1
  fi
  echo "$left"
}

ckpt_step() { # ckpt_step NAME SHARE SCRIPT ARGS...: a checkpoint bench in a fresh folder, given SHARE % of
  # the time left before KIT_DEADLINE_S (at most 900 s), bounded by `timeout` and its own --budget
  local name=$1 share=$2 script=$3 left dir
  shift 3
  if ! left=$(time_share "$name" "$share"); then
    SUMMARY+=("skip  $name (time: KIT_DEADLINE_S=$DEADLINE; KIT_ONLY=checkpoint runs it in a call of its own)")
    return
  fi
  dir=$(mktemp -d "$CKPT_BASE/tf-kit-ckpt-XXXXXX")
  step "$name" timeout -k 10 "$left" "$PY" "$KIT/src/bench/$script" --dir "$dir" --budget $((left - 15)) "$@"
  rm -rf "$dir"
}

checkpoint_benches() {
  CKPT_BASE=$(ckpt_base)
  echo
  echo "# checkpoint files under $CKPT_BASE ($(stat -f -c %T "$CKPT_BASE" 2>/dev/null)," \
    "$(df -Ph "$CKPT_BASE" | awk 'NR == 2 { print $4 }') free); $((DEADLINE - (SECONDS - START))) s left before KIT_DEADLINE_S"
  # 32 GB is left out: its three files (.safetensors, .pt, reference) would not fit the 64 GiB disk.
  local gb=1,8 small=10000 repeat=3 save_gb=8
  if [ "${KIT_QUICK:-}" = 1 ]; then gb=0.1 small=1000 repeat=1 save_gb=0.1; fi
  if [ "$ONLY" != checkpoint-save ]; then
    local share=60
    if [ "$ONLY" = checkpoint-load ]; then share=100; fi
    ckpt_step "checkpoint_load (cuda:0, $gb GB and $small small tensors)" "$share" checkpoint_load.py \
      --device cuda:0 --rows device --gb "$gb" --small "$small" --repeat "$repeat" --modes warm,cold
  fi
  if [ "$ONLY" != checkpoint-load ]; then
    ckpt_step "checkpoint_save (cuda, $save_gb GB)" 100 checkpoint_save.py --device cuda --gb "$save_gb" --repeat "$repeat"
  fi
}

dcp_bench() { # DCP's storage layers side by side on a state dict in GPU memory (the DCP issue's figures)
  CKPT_BASE=$(ckpt_base)
  local gb=1 repeat=3 left dir
  if [ "${KIT_QUICK:-}" = 1 ]; then gb=0.1 repeat=1; fi
  left=$((DEADLINE - (SECONDS - START) - 20))
  dir=$(mktemp -d "$CKPT_BASE/tf-kit-dcp-XXXXXX")
  step "dcp_compare (cuda, $gb GB)" timeout -k 10 "$left" "$PY" "$KIT/src/bench/dcp_compare.py" --device cuda \
    --gb "$gb" --repeat "$repeat" --no-reshard --dir "$dir"
  rm -rf "$dir"
}

fanout_bench() { # fanout_bench SHARE: read once, fan out over NCCL (needs 2 GPUs or more), with peers
  local share=$1 gpus ranks gb=1 left dir
  if [ "${KIT_QUICK:-}" = 1 ]; then gb=0.1; fi
  if ! "$PY" -c 'import torch.distributed' 2>/dev/null; then
    echo
    echo "skipped fanout: torch (with torch.distributed) is not importable"
    SUMMARY+=("skip  fanout (torch is not importable)")
    return
  fi
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  if ! left=$(time_share fanout "$share"); then
    SUMMARY+=("skip  fanout (time: KIT_DEADLINE_S=$DEADLINE; KIT_ONLY=fanout runs it in a call of its own)")
    return
  fi
  CKPT_BASE=$(ckpt_base)
  dir=$(mktemp -d "$CKPT_BASE/tf-kit-fanout-XXXXXX")
  if [ "$gpus" -ge 2 ]; then
    ranks="1 2"
    if [ "$gpus" -ge 4 ]; then ranks="$ranks 4"; fi
    if [ "$gpus" -ge 8 ]; then ranks="$ranks 8"; fi
    # shellcheck disable=SC2086 # the ranks are words
    step "fanout (cuda, nccl, $gb GB, ranks $ranks, peers)" timeout -k 10 "$left" "$PY" "$KIT/src/bench/fanout.py" \
      --device cuda --backend nccl --gb "$gb" --shards 8 --peers --mbps 0 --ranks $ranks --dir "$dir"
  elif [ "${KIT_QUICK:-}" = 1 ]; then
    # The kit's check: the script runs from the kit (CPU, gloo), the GPU rows wait for GPUs.
    step "fanout (cpu, gloo: torch sees $gpus GPU(s), the script only)" timeout -k 10 "$left" "$PY" \
      "$KIT/src/bench/fanout.py" --gb 0.02 --tensors 20 --ranks 2 --mbps 0 --peers --dir "$dir"
  else
    echo
    echo "skipped fanout: torch sees $gpus GPU(s); the NCCL fan-out needs 2 or more"
    SUMMARY+=("skip  fanout (torch sees $gpus GPU(s); needs 2 or more)")
  fi
  rm -rf "$dir"
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
  case "$ONLY" in
    "") tests_and_benches ;;
    checkpoint | checkpoint-load | checkpoint-save) checkpoint_benches ;;
    dcp) dcp_bench ;;
    fanout) fanout_bench 100 ;;
    *)
      echo "KIT_ONLY=$ONLY: unknown (checkpoint, checkpoint-load, checkpoint-save, dcp or fanout)"
      FAILED=1
      ;;
  esac

  echo
  echo "== summary"
  printf '%s\n' "${SUMMARY[@]}"
  return $FAILED
}

tests_and_benches() {
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
    fanout_bench 30
    checkpoint_benches
  fi
}

run 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "raw output: $LOG"
exit "$status"
