"""README.md's TensorFlow snippets, run as written in the TensorFlow environment (the rest of
README runs in the main one: tests/test_readme.py, whose machinery this reuses)."""

import os
import sys

import pytest

pytest.importorskip("tensorflow")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_readme import BLOCKS, run_block, sections  # noqa: E402,F401  (sections: a fixture)

TENSORFLOW_BLOCKS = [b for b in BLOCKS if "tensorflow" in b.needs]


def test_readme_has_a_tensorflow_snippet():
    assert TENSORFLOW_BLOCKS


@pytest.mark.parametrize("block", TENSORFLOW_BLOCKS, ids=[b.id for b in TENSORFLOW_BLOCKS])
def test_readme_tensorflow_snippet_runs(block, sections, tmp_path_factory):  # noqa: F811
    run_block(block, sections, tmp_path_factory)
