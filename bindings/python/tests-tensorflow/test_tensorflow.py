"""TensorFlow tensors and variables through tensorferry, with the real TensorFlow (CPU).

Run in a process (and an environment) of their own: TensorFlow and PyTorch can crash when
imported into one process. ``scripts/test.sh`` runs this folder with ``.venv-tf``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tensorflow = pytest.importorskip("tensorflow")
import tensorferry as tf  # noqa: E402


@pytest.fixture
def state():
    return {
        "model": {
            "dense.kernel": tensorflow.Variable(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)),
            "dense.bias": tensorflow.constant(np.arange(3, dtype=np.float32)),
            "emb": tensorflow.constant(np.arange(6, dtype=np.float32).reshape(2, 3), dtype=tensorflow.bfloat16),
        },
        "ids": tensorflow.constant([[1, 2], [3, 4]], dtype=tensorflow.int64),
        "mask": tensorflow.constant([True, False]),
        "step": 12,
        "tag": "run-1",
    }


def _np(x):
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def test_to_host_copies_every_tensor_and_variable_into_tensorflow_tensors(state):
    out = tf.to_host(state, copy=True)
    for key in ("dense.kernel", "dense.bias", "emb"):
        assert isinstance(out["model"][key], tensorflow.Tensor), key
        np.testing.assert_array_equal(_np(out["model"][key]), _np(state["model"][key]))
        assert out["model"][key].dtype == state["model"][key].dtype
    assert out["tag"] is state["tag"] and out["step"] == 12
    # A copy: changing the source variable leaves the result as it was.
    before = _np(out["model"]["dense.kernel"]).copy()
    state["model"]["dense.kernel"].assign_add(tensorflow.ones((4, 3)))
    np.testing.assert_array_equal(_np(out["model"]["dense.kernel"]), before)


def test_to_host_without_copy_keeps_host_tensors_as_they_are(state):
    out = tf.to_host(state)
    assert out["model"]["dense.bias"] is state["model"]["dense.bias"]
    assert out["model"]["dense.kernel"] is state["model"]["dense.kernel"]


def test_to_numpy_gives_arrays_with_the_same_values_and_dtypes(state):
    arrays = tf.to_numpy(state)
    assert isinstance(arrays["ids"], np.ndarray) and arrays["ids"].dtype == np.int64
    np.testing.assert_array_equal(arrays["model"]["dense.kernel"], state["model"]["dense.kernel"].numpy())
    assert str(arrays["model"]["emb"].dtype) == "bfloat16"
    np.testing.assert_array_equal(arrays["mask"], [True, False])


def test_save_and_load_give_tensorflow_tensors_back(state, tmp_path):
    p = tmp_path / "ckpt.safetensors"
    tf.save(state, p)
    for mmap in (True, False):
        back = tf.load(p, mmap=mmap)
        assert isinstance(back["model"]["dense.bias"], tensorflow.Tensor)
        np.testing.assert_array_equal(back["model"]["dense.kernel"].numpy(), state["model"]["dense.kernel"].numpy())
        assert back["model"]["emb"].dtype == tensorflow.bfloat16
        assert back["step"] == 12 and back["tag"] == "run-1"
        # TensorFlow may reuse an input's buffer for an op's output: mapped (read-only)
        # memory must have been copied, so ops on the results are safe.
        doubled = back["ids"] * 2 + 1
        np.testing.assert_array_equal(doubled.numpy(), [[3, 5], [7, 9]])


def test_the_official_safetensors_reader_reads_what_tensorflow_tensors_saved(state, tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    p = str(tmp_path / "ckpt.safetensors")
    tf.save({"w": state["model"]["dense.kernel"], "b": state["model"]["dense.bias"]}, p)
    got = st.load_file(p)
    np.testing.assert_array_equal(got["w"], state["model"]["dense.kernel"].numpy())


def test_like_tensorflow_loads_any_file_as_tensorflow_tensors(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save({"x": np.arange(4, dtype=np.int32)}, p)
    x = tf.load(p, like="tensorflow")["x"]
    assert isinstance(x, tensorflow.Tensor) and x.dtype == tensorflow.int32


def test_through_the_emulated_device_and_back(state):
    on_device = tf.to_device(state, "emu:0")
    assert on_device["model"]["dense.bias"].device == "emu:0"
    back = tf.to_numpy(on_device)
    np.testing.assert_array_equal(back["model"]["dense.kernel"], state["model"]["dense.kernel"].numpy())


def test_lists_of_numbers_become_tensorflow_tensors_with_like():
    out = tf.to_device({"embedding_1": [1.0, 2.0, 3.0], "ids": [[1, 2], [3, 4]]}, "cpu", like="tensorflow")
    assert isinstance(out["embedding_1"], tensorflow.Tensor)
    assert out["embedding_1"].dtype == tensorflow.float32 and out["ids"].dtype == tensorflow.int64
    np.testing.assert_array_equal(out["ids"].numpy(), [[1, 2], [3, 4]])


@pytest.mark.parametrize("call", ["to_host", "to_numpy", "save"])
def test_string_tensors_are_an_error_naming_the_key_never_an_abort(call, tmp_path):
    # TensorFlow's own DLPack export aborts the process on string tensors.
    d = {"meta": {"names": tensorflow.constant(["a", "b"])}, "w": tensorflow.ones(2)}
    calls = {
        "to_host": lambda: tf.to_host(d, copy=True),
        "to_numpy": lambda: tf.to_numpy(d),
        "save": lambda: tf.save(d, tmp_path / "f.safetensors"),
    }
    with pytest.raises(tf.FormatError, match="meta/names.*string"):
        calls[call]()


def test_strided_views_are_copied_in_order():
    x = tensorflow.transpose(tensorflow.reshape(tensorflow.range(12, dtype=tensorflow.float32), (3, 4)))
    out = tf.to_host({"x": x}, copy=True)
    np.testing.assert_array_equal(out["x"].numpy(), x.numpy())


@pytest.fixture
def on_tpu(monkeypatch):
    """TensorFlow whose tensors report a TPU ("/device:TPU:0"), as TensorFlow names one; the
    fallback's ``tf.identity`` calls recorded with the device they ran on."""
    from tensorferry import _frameworks

    monkeypatch.setattr(_frameworks, "_tf_device", lambda name: "tpu:0")
    calls = []
    real = tensorflow.identity

    def identity(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        calls.append(out.device)
        return out

    monkeypatch.setattr(tensorflow, "identity", identity)
    return calls


@pytest.mark.parametrize("call", ["to_host", "to_numpy", "save"])
def test_a_tensor_on_a_tpu_moves_through_tf_identity_on_the_host(on_tpu, call, tmp_path):
    d = {"model": {"w": tensorflow.constant([1.0, 2.0])}, "host": np.arange(3), "step": 4}
    if call == "to_host":
        out = tf.to_host(d)
        assert isinstance(out["model"]["w"], tensorflow.Tensor) and out["host"] is d["host"]
    elif call == "to_numpy":
        out = tf.to_numpy(d)
    else:
        tf.save(d, tmp_path / "f.safetensors")
        out = tf.load(tmp_path / "f.safetensors", like="numpy")
    np.testing.assert_array_equal(np.asarray(out["model"]["w"]), [1.0, 2.0])
    assert out["step"] == 4
    assert len(on_tpu) == 1 and on_tpu[0].endswith("CPU:0"), on_tpu
