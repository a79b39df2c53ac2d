#!/usr/bin/env bash
# The S3 server the object-storage tests run on the loopback interface: s3s-fs from
# crates.io (SigV4, ranged GETs, multipart uploads over a local folder).
#
#   bash scripts/s3-server.sh install   # into target/tools/bin/s3s-fs, only if missing
#   bash scripts/s3-server.sh path      # prints the binary's path
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
  *)
    echo "usage: $0 [install|path]" >&2
    exit 2
    ;;
esac
