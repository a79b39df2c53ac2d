#!/usr/bin/env bash
# The S3 server the object-storage tests run on the loopback interface: s3s-fs from
# crates.io (SigV4, ranged GETs, multipart uploads over a local folder).
#
#   bash scripts/s3-server.sh install   # into target/tools/bin/s3s-fs, only if missing
#   bash scripts/s3-server.sh path      # prints the binary's path
#   bash scripts/s3-server.sh fast      # builds and prints a second binary for the bench
#
# `fast` is the same release with one constant changed: s3s-fs 0.14.1 streams a GET's body
# from its file in 4 KiB reads, each a hop through tokio's blocking pool (src/s3.rs, the
# `ReaderStream::with_capacity(file, 4096)` of get_object), which caps one server at about
# 0.3-0.4 GB/s on loopback, below every client bench/object_store.py measures. Built with
# 1 MiB reads instead, the server stops being the bottleneck and the bench compares the
# clients. Only the bench uses it (TENSORFERRY_S3S_FS=$(bash scripts/s3-server.sh fast));
# the tests keep the release as published.
#
# The tests (crates/tensorferry/tests/io_object.rs, bindings/python/tests/
# test_object_store.py) start and stop their own servers; they find the binary through
# TENSORFERRY_S3S_FS, else target/tools/bin/s3s-fs, else the PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# 0.14.1: the newest release that builds with the Rust of these machines (1.95; 0.15 and
# later ask for 1.96). Its own lock file pins its dependencies.
VERSION=0.14.1
ROOT="$PWD/target/tools"
BIN="$ROOT/bin/s3s-fs"
case "${1:-install}" in
  install)
    if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "$VERSION"; then
      exit 0
    fi
    echo "== installing s3s-fs $VERSION into target/tools (a real S3 server for the object-storage tests; a one-time build of about 4 minutes on 2 cores)"
    start=$(date +%s)
    cargo install -q --locked --root "$ROOT" s3s-fs --version "$VERSION" --features binary
    echo "   s3s-fs installed in $(( $(date +%s) - start )) s"
    ;;
  path)
    echo "$BIN"
    ;;
  fast)
    FAST="$ROOT/s3s-fs-1m/target/release/s3s-fs"
    if [ ! -x "$FAST" ]; then
      bash "$0" install >&2
      SRC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/s3s-fs-"$VERSION" | head -1)
      rm -rf "$ROOT/s3s-fs-1m" && cp -r "$SRC" "$ROOT/s3s-fs-1m"
      sed -i 's/ReaderStream::with_capacity(file, 4096)/ReaderStream::with_capacity(file, 1 << 20)/' \
        "$ROOT/s3s-fs-1m/src/s3.rs"
      printf '\n[workspace]\n' >> "$ROOT/s3s-fs-1m/Cargo.toml"  # not a member of ours
      grep -q 'ReaderStream::with_capacity(file, 1 << 20)' "$ROOT/s3s-fs-1m/src/s3.rs"
      echo "== building s3s-fs $VERSION with 1 MiB reads into target/tools/s3s-fs-1m (for the bench)" >&2
      (cd "$ROOT/s3s-fs-1m" && cargo build -q --release --locked --features binary >&2)
    fi
    echo "$FAST"
    ;;
  *)
    echo "usage: $0 [install|path|fast]" >&2
    exit 2
    ;;
esac
