"""Servers the tests start on the loopback interface: a free port for one, and the S3 server
(``s3s-fs`` from crates.io: SigV4, ranged GETs, multipart uploads over a local folder) with
fixed credentials and the environment that points a client at it.

Without the ``s3s-fs`` binary a test needing it skips with the reason (``bash
scripts/s3-server.sh install`` builds it); ``scripts/test.sh`` installs it and sets
``TENSORFERRY_REQUIRE_S3=1``, which makes its absence a failure.
"""

import os
import shutil
import socket
import subprocess
import time

import pytest

ACCESS_KEY = "tensorferry-test"
SECRET_KEY = "tensorferry-test-secret"
REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def free_port():
    """A port of 127.0.0.1 that nothing listens on (as the kernel picks one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_binary():
    """``TENSORFERRY_S3S_FS``, else the repository's ``target/tools``, else the PATH; None
    when none holds the binary."""
    given = os.environ.get("TENSORFERRY_S3S_FS")
    if given:
        return given if os.path.isfile(given) else None
    tools = os.path.join(REPO, "target", "tools", "bin", "s3s-fs")
    return tools if os.path.isfile(tools) else shutil.which("s3s-fs")


def missing(requirement, what, reason):
    """Ends the calling test for want of a server or tool: a failure saying ``what`` is
    missing when the variable ``requirement`` is set (scripts/test.sh sets it where it
    installs them), else a skip giving ``reason``."""
    if os.environ.get(requirement):
        pytest.fail(f"{requirement} is set and {what}")
    pytest.skip(reason)


def s3_binary_or_skip():
    """The ``s3s-fs`` binary; without one, the calling test skips, or fails under
    ``TENSORFERRY_REQUIRE_S3``."""
    binary = s3_binary()
    if binary is None:
        missing("TENSORFERRY_REQUIRE_S3", "no s3s-fs binary was found", "no s3s-fs binary: bash scripts/s3-server.sh install")
    return binary


class S3Server:
    """An ``s3s-fs`` process serving ``root`` (bucket ``bucket``) on 127.0.0.1."""

    def __init__(self, binary, root, log=None):
        self.root = root
        self.log = log
        os.makedirs(os.path.join(root, "bucket"), exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.binary = binary
        self.start()

    def start(self):
        """Starts the server (again: same port, same folder) and waits until it answers."""
        # With a log: every request, its headers (ranges) included.
        out = open(self.log, "a") if self.log else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [self.binary, "--host", "127.0.0.1", "--port", str(self.port),
                 "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, self.root],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, RUST_LOG="s3s::service=debug") if self.log else None,
            )
        finally:
            if self.log:
                out.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"s3s-fs did not answer on port {self.port}")
                time.sleep(0.02)

    def file(self, key):
        """The file in which the server keeps ``key`` of the bucket."""
        return os.path.join(self.root, "bucket", key)

    def environment(self):
        """The variables that point an S3 client at this server, with its credentials."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            # Without keys the client asks the instance-metadata service: on loopback here.
            "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
        }

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def point_at(monkeypatch, server):
    """``monkeypatch`` points the client at ``server`` (``S3Server.environment``), its
    retries bounded (one, within two seconds)."""
    for key, value in {**server.environment(), "TENSORFERRY_OBJECT_RETRIES": "1",
                       "TENSORFERRY_OBJECT_RETRY_TIMEOUT": "2"}.items():
        monkeypatch.setenv(key, value)
