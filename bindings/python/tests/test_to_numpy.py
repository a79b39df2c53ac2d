"""to_numpy: every tensor leaf becomes a NumPy array, zero-copy for host memory."""

import numpy as np
import pytest

import tensorferry as tf


def test_native_tensors_become_arrays_sharing_memory():
    t = tf.Tensor.from_numpy(np.arange(6, dtype=np.float64).reshape(2, 3))
    arr = tf.to_numpy({"t": t})["t"]
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == t.data_ptr
    np.testing.assert_array_equal(arr, np.arange(6).reshape(2, 3))


def test_numpy_leaves_are_returned_as_is(state):
    out = tf.to_numpy(state)
    assert out["ids"] is state["ids"] and out["tag"] is state["tag"]


def test_torch_tensors_become_arrays_sharing_memory(torch):
    w = torch.arange(4, dtype=torch.float32)
    arr = tf.to_numpy({"w": w})["w"]
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == w.data_ptr()


def test_torch_tensors_numpy_refuses_as_they_are_still_become_arrays(torch, ml_dtypes):
    # .numpy() refuses a tensor that requires grad, a lazy conjugate view and bfloat16;
    # after a plain tensor (which takes the loop's path), each still becomes its array.
    plain = torch.arange(3, dtype=torch.float32)
    src = {
        "plain": plain,
        "grad": torch.nn.Parameter(torch.ones(2)),
        "conj": torch.tensor([1 + 2j]).conj(),
        "bf16": torch.tensor([1.5], dtype=torch.bfloat16),
        "view": plain[1:],
    }
    out = tf.to_numpy(src)
    assert out["plain"].ctypes.data == plain.data_ptr() and out["view"].ctypes.data == plain.data_ptr() + 4
    np.testing.assert_array_equal(out["grad"], [1.0, 1.0])
    np.testing.assert_array_equal(out["conj"], [1 - 2j])
    assert out["bf16"].dtype == np.dtype(ml_dtypes.bfloat16) and float(out["bf16"][0]) == 1.5
    assert all(isinstance(v, np.ndarray) for v in out.values())


def test_a_tree_of_torch_cpu_tensors_is_converted_in_one_native_pass(torch, monkeypatch):
    """When every tensor leaf is a PyTorch CPU tensor whose ``.numpy()`` answers (or a NumPy
    array), the native rebuilder calls ``.numpy()`` as it walks: the leaves are never
    collected first, and containers keep their types."""
    from collections import OrderedDict

    from tensorferry import _native

    def collected(*args, **kwargs):
        raise AssertionError("the leaves were collected")

    monkeypatch.setattr(_native, "collect_tensors", collected)
    w, t = torch.arange(4.0), torch.arange(6).reshape(2, 3).t()
    arr = np.ones(2)
    src = OrderedDict(w=w, n=arr, tag="run-1", nested=[t, (w, 3)])
    out = tf.to_numpy(src)
    assert type(out) is OrderedDict and list(out) == list(src)
    assert out["n"] is arr and out["tag"] == "run-1" and out["nested"][1][1] == 3
    assert out["w"].ctypes.data == w.data_ptr() and out["nested"][1][0].ctypes.data == w.data_ptr()
    assert out["nested"][0].strides == (8, 24) and out["nested"][0].ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(out["nested"][0], np.arange(6).reshape(2, 3).T)


def test_a_tree_mixing_torch_with_other_tensors_still_converts_every_leaf(torch):
    """A tensorferry tensor, a Parameter or a GPU-less device's tensor after PyTorch CPU
    tensors ends the one-pass conversion; the general path then converts every leaf."""
    w = torch.arange(3.0)
    src = {"w": w, "native": tf.Tensor.from_numpy(np.arange(2)), "p": torch.nn.Parameter(torch.ones(2)), "z": w}
    out = tf.to_numpy(src)
    assert out["w"].ctypes.data == w.data_ptr() and out["z"].ctypes.data == w.data_ptr()
    np.testing.assert_array_equal(out["native"], [0, 1])
    np.testing.assert_array_equal(out["p"], [1.0, 1.0])
    with pytest.raises(tf.TensorferryError, match="'m'"):
        tf.to_numpy({"w": w, "m": torch.ones(2, device="meta")})


def test_torch_bfloat16_becomes_an_ml_dtypes_array(torch, ml_dtypes):
    w = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    arr = tf.to_numpy({"w": w})["w"]
    assert arr.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(arr.astype(np.float32), [1.0, 2.5])


def test_jax_arrays_become_arrays(jax):
    import jax.numpy as jnp

    arr = tf.to_numpy({"x": jnp.ones(3)})["x"]
    assert isinstance(arr, np.ndarray)


def test_bfloat16_without_ml_dtypes_names_key_and_dtype(monkeypatch, ml_dtypes):
    import sys

    t = tf.Tensor.from_numpy(np.zeros(2, ml_dtypes.bfloat16))
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(tf.FormatError, match=r"bfloat16.*'layer/w'.*ml_dtypes"):
        tf.to_numpy({"layer": {"w": t}})


def test_a_root_bfloat16_tensor_without_ml_dtypes_is_named_as_the_root(monkeypatch, ml_dtypes):
    import sys

    t = tf.Tensor.from_numpy(np.zeros(2, ml_dtypes.bfloat16))
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(tf.FormatError, match=r"bfloat16.*'<root>'.*ml_dtypes"):
        tf.to_numpy(t)


def test_read_only_memory_gives_read_only_arrays(tmp_path):
    p = tmp_path / "r.safetensors"
    tf.save({"a": np.ones(4, np.float32)}, p)
    arr = tf.load(p, like="numpy")["a"]
    assert not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0] = 2


def test_array_protocol_and_dtype_argument():
    t = tf.Tensor.from_numpy(np.arange(3, dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(t), [0, 1, 2])
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
