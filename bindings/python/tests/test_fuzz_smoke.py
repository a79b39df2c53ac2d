"""The Python-side fuzzer (fuzz/python/fuzz_tree.py) in CI's reach: a few seconds of its
random driver, and its corpus replayed where atheris is installed. Every input must give
the right result or a clear exception; the long runs are in fuzz/python/README.md."""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
FUZZ = os.path.join(ROOT, "fuzz", "python", "fuzz_tree.py")

pytestmark = pytest.mark.skipif(not os.path.exists(FUZZ), reason="the fuzzer is not in this checkout")


def _run(*args):
    return subprocess.run([sys.executable, FUZZ, *args], capture_output=True, text=True, timeout=300)


def test_random_trees_give_right_results_or_clear_errors():
    done = _run("--random", "6")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "0 findings" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_the_corpus_replays_without_findings():
    done = _run("--replay", *sorted(glob.glob(os.path.join(ROOT, "fuzz", "python", "corpus", "*"))))
    assert done.returncode == 0, done.stdout[-4000:]
    assert "FINDING" not in done.stdout
