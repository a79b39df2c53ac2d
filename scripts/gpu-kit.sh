#!/usr/bin/env bash
# Builds the GPU kit: everything a GPU machine without Rust and without network needs to
# prove tensorferry there, in one ignored folder under 64 MiB (.gpu-kit/):
#   wheels/   the abi3 tensorferry wheel, and wheels of peers that machine lacks (tensordict,
#             fastsafetensors, instanttensor)
#   bin/      the engine and library test binaries (release, stripped), the release CLI
#   src/      the Python tests, the test corpus and the bench scripts, in their repo layout
#   run.sh    the runner: needs only python3 (and the CUDA driver) on the GPU machine
#   COMMIT    the commit it was built from
#
# Usage here:        bash scripts/gpu-kit.sh            (then carry .gpu-kit to the machine)
# On the GPU machine: bash .gpu-kit/run.sh              (raw output under $OUT or .gpu-kit/out)
# Checked here against the fake driver: bash scripts/gpu-kit.sh --check
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpu-kit
PY=${PYTHON:-python3}
rm -rf "$KIT"
mkdir -p "$KIT/wheels/peers" "$KIT/bin" "$KIT/src"

echo "== wheel"
bash scripts/setup-python.sh --no-frameworks >/dev/null
cp dist/tensorferry-*.whl "$KIT/wheels/"

echo "== test binaries and CLI (release, stripped)"
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo
cargo build -q --release -p tensorferry-cli
cp target/release/tensorferry "$KIT/bin/"
cargo test -q --release -p tensorferry --lib --test engine --no-run --message-format=json 2>/dev/null |
  "$PY" -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = "lib-tests" if m["target"]["kind"] == ["lib"] else m["target"]["name"] + "-tests"
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)
        print("  ", name)
' "$KIT/bin"

echo "== peers the GPU machine lacks (cp312 wheels)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$KIT/wheels/peers" tensordict pyvers orjson || echo "   (peer wheels unavailable: the tensordict rows will say so)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$KIT/wheels/peers" fastsafetensors || echo "   (fastsafetensors wheel unavailable: its rows will say so)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$KIT/wheels/peers" instanttensor || echo "   (instanttensor wheel unavailable: its fan-out rows will say so)"

echo "== tests and bench scripts"
mkdir -p "$KIT/src/bindings/python" "$KIT/src/crates/tensorferry/tests"
cp -r bindings/python/tests "$KIT/src/bindings/python/"
cp bindings/python/pyproject.toml "$KIT/src/bindings/python/" # pytest's markers and options
cp -r crates/tensorferry/tests/corpus "$KIT/src/crates/tensorferry/tests/"
cp -r bench "$KIT/src/"
cp README.md "$KIT/src/" # test_readme.py runs its examples
mkdir -p "$KIT/src/scripts" "$KIT/src/fuzz"
cp scripts/soak.py "$KIT/src/scripts/"
cp -r fuzz/python "$KIT/src/fuzz/"
rm -rf "$KIT/src/bench/results" "$KIT/src/bench/work"
find "$KIT/src" -name __pycache__ -prune -exec rm -rf {} +
cp scripts/gpu-kit-run.sh "$KIT/run.sh"
git rev-parse --short HEAD >"$KIT/COMMIT"
if ! git diff --quiet HEAD -- crates bindings; then echo "(uncommitted changes)" >>"$KIT/COMMIT"; fi
du -sh "$KIT"
size=$(du -sm "$KIT" | cut -f1)
if [ "$size" -ge 64 ]; then
  echo "the kit is ${size} MiB: over the 64 MiB a device call carries" >&2
  exit 1
fi

if [ "${1:-}" = "--check" ]; then
  # The same runner, pointed at the fake driver and this machine's Python (with torch):
  # proves the kit works end to end before it meets a GPU.
  echo "== kit check against the fake CUDA driver"
  cargo build -q -p tensorferry-fake-cuda
  mkdir -p target/fake-cuda
  cp target/debug/libtensorferry_fake_cuda.so target/fake-cuda/libcuda.so
  LD_LIBRARY_PATH="$PWD/target/fake-cuda" TF_FAKE_CUDA_VERSION=12080 TF_FAKE_CUDA_DEVICES=2 \
    KIT_PYTHON="$PWD/.venv/bin/python" KIT_OUT="$PWD/$KIT/out" KIT_QUICK=1 bash "$KIT/run.sh"
fi
