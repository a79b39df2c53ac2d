"""to_host: the structure comes back, tensors on the host, everything else the same object."""

from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest

import tensorferry as tf

Pair = namedtuple("Pair", ["first", "second"])


def test_non_tensor_leaves_are_the_very_same_objects(state):
    out = tf.to_host(state)
    assert out["tag"] is state["tag"]
    assert out["optimizer"]["lr"] is state["optimizer"]["lr"]
    assert out["none"] is None
    assert out is not state and out["model"] is not state["model"]


def test_host_tensors_are_returned_without_copy_by_default(state):
    out = tf.to_host(state)
    assert out["ids"] is state["ids"]


def test_copy_true_shares_no_memory_and_keeps_values(state):
    out = tf.to_host(state, copy=True)
    for key in ("layer.0.weight", "layer.0.bias"):
        a, b = state["model"][key], out["model"][key]
        assert isinstance(b, np.ndarray)
        assert not np.shares_memory(a, b)
        np.testing.assert_array_equal(a, b)
        assert b.dtype == a.dtype and b.shape == a.shape


def test_the_source_is_never_modified(state):
    before = state["model"]["layer.0.weight"].copy()
    out = tf.to_host(state, copy=True)
    out["model"]["layer.0.weight"][...] = -1
    np.testing.assert_array_equal(state["model"]["layer.0.weight"], before)


def test_container_types_are_kept():
    src = {
        "od": OrderedDict([("b", np.ones(1)), ("a", 2)]),
        "dd": defaultdict(list, {"x": np.ones(1)}),
        "nt": Pair(np.ones(1), "s"),
        "t": (np.ones(1), 1),
        "l": [np.ones(1)],
    }
    out = tf.to_host(src, copy=True)
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]
    assert type(out["dd"]) is defaultdict and out["dd"].default_factory is list
    assert type(out["nt"]) is Pair and out["nt"].second == "s"
    assert type(out["t"]) is tuple and type(out["l"]) is list


def test_strided_arrays_are_copied_in_order():
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    view = base[::2, ::-3]
    out = tf.to_host({"v": view}, copy=True)["v"]
    np.testing.assert_array_equal(out, view)


def test_torch_in_torch_out(torch):
    src = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "p": torch.nn.Parameter(torch.ones(2))}
    out = tf.to_host(src, copy=True)
    assert isinstance(out["w"], torch.Tensor) and out["w"].device.type == "cpu"
    assert torch.equal(out["w"], src["w"])
    assert out["w"].data_ptr() != src["w"].data_ptr()
    assert torch.equal(out["p"], torch.ones(2))


def test_torch_bfloat16_survives(torch):
    src = {"b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}
    out = tf.to_host(src, copy=True)
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], src["b"])


def test_jax_in_jax_out(jax):
    import jax.numpy as jnp

    src = {"x": jnp.arange(4, dtype=jnp.float32)}
    out = tf.to_host(src, copy=True)
    assert isinstance(out["x"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(4, dtype=np.float32))


def test_native_tensors_stay_native():
    t = tf.Tensor.from_numpy(np.arange(3))
    out = tf.to_host({"t": t}, copy=True)["t"]
    assert isinstance(out, tf.Tensor) and out.data_ptr != t.data_ptr
    np.testing.assert_array_equal(out.numpy(), np.arange(3))


def test_copies_are_64_byte_aligned():
    out = tf.to_host({"a": np.ones(3, np.int8), "b": np.ones(5, np.float64)}, copy=True)
    for v in out.values():
        assert v.ctypes.data % 64 == 0


def test_a_root_list_or_tuple_works():
    out = tf.to_host([np.ones(1), ("x", np.zeros(2))], copy=True)
    assert isinstance(out, list) and isinstance(out[1], tuple) and out[1][0] == "x"


def test_the_same_tensor_twice_stays_shared():
    a = np.ones(3)
    out = tf.to_host({"x": a, "y": a}, copy=True)
    assert out["x"] is out["y"]


@pytest.mark.parametrize("non_blocking", [False, True])
def test_non_blocking_numpy_results_come_through_a_transfer(state, non_blocking):
    out = tf.to_host(state, non_blocking=non_blocking, copy=True)
    if non_blocking:
        # NumPy arrays cannot wait for their copies: the handle gives them once done.
        assert isinstance(out, tf.Transfer)
        out = out.result()
    np.testing.assert_array_equal(out["ids"], np.arange(5))
