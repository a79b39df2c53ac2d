"""Shared fixtures. Framework tests run against the real packages; a missing one is a
skip with its reason, never an imitation."""

import os

import numpy as np
import pytest

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "crates", "tensorferry", "tests", "corpus")


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed")


@pytest.fixture
def jax():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    jax.config.update("jax_platforms", "cpu")
    return jax


@pytest.fixture
def ml_dtypes():
    return pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")


@pytest.fixture
def state():
    """A state-dict-like tree mixing tensors, strings, scalars and nesting."""
    return {
        "model": {
            "layer.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
            "layer.0.bias": np.zeros(4, dtype=np.float32),
        },
        "optimizer": {"step": 7, "lr": 1e-3, "betas": (0.9, 0.999)},
        "ids": np.arange(5, dtype=np.int64),
        "tag": "run-1",
        "none": None,
    }


@pytest.fixture
def failing_emu0():
    """emu:0 with its next copy failing (an injected fault); reset afterwards."""
    import tensorferry as tf

    tf.configure_emulated(0, fail_copy=1)
    yield "emu:0"
    tf.configure_emulated(0)
