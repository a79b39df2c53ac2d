"""The CUDA Array Interface: producers that describe CUDA memory with
``__cuda_array_interface__`` (Numba device arrays, CuPy, others) are read without a copy,
after their stream; tensorferry's CUDA tensors expose it, so Numba kernels can take them.

Runs against the fake CUDA driver in CI (``scripts/test.sh``) and on a real GPU through the
GPU kit; skipped with the reason where no CUDA driver is present."""

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _native

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    try:
        _native.ensure_device("cuda:0")
    except tf.DeviceUnavailableError as e:
        pytest.skip(f"no usable CUDA device: {e}")
    return "cuda:0"


class Producer:
    """A minimal producer of the interface, as a library would write one: a view of
    tensorferry device memory described by its pointer, with an optional stream."""

    def __init__(self, owner, stream=None, **changes):
        self.owner = owner
        iface = dict(owner.__cuda_array_interface__)
        iface["stream"] = stream
        iface.update(changes)
        self._iface = iface

    @property
    def __cuda_array_interface__(self):
        return self._iface


def test_device_tensors_expose_the_interface(cuda):
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = tf.to_device({"x": src}, cuda)["x"]
    iface = t.__cuda_array_interface__
    assert iface["version"] == 3 and iface["shape"] == (3, 4) and iface["typestr"] == "<f4"
    assert iface["data"] == (t.data_ptr, False) and iface["strides"] is None
    assert iface["stream"] is None, "pending copies are waited for before export"


def test_host_and_emulated_tensors_have_no_interface():
    assert not hasattr(tf.Tensor.from_numpy(np.ones(2)), "__cuda_array_interface__")
    t = tf.to_device({"x": np.ones(2)}, "emu:0")["x"]
    assert not hasattr(t, "__cuda_array_interface__")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8, np.bool_, np.complex64])
def test_a_producer_comes_to_the_host_as_numpy_without_loss(cuda, dtype):
    src = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    on_gpu = tf.to_device({"x": src}, cuda)["x"]
    out = tf.to_host({"p": Producer(on_gpu), "tag": "t"})
    assert isinstance(out["p"], np.ndarray) and out["p"].dtype == src.dtype
    np.testing.assert_array_equal(out["p"], src)
    np.testing.assert_array_equal(tf.to_numpy({"p": Producer(on_gpu)})["p"], src)


def test_strided_producers_are_read_in_their_layout(cuda):
    src = np.arange(20, dtype=np.float64).reshape(4, 5)
    on_gpu = tf.to_device({"x": src}, cuda)["x"]
    # The transpose of the same memory, described with byte strides.
    transposed = Producer(on_gpu, shape=(5, 4), strides=(8, 40))
    np.testing.assert_array_equal(tf.to_host({"t": transposed})["t"], src.T)


def test_a_producer_moves_to_a_device_and_saves(cuda, tmp_path):
    src = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    on_gpu = tf.to_device({"x": src}, cuda)["x"]
    moved = tf.to_device({"p": Producer(on_gpu)}, cuda, copy=True)["p"]
    assert moved.device == cuda and moved.data_ptr != on_gpu.data_ptr
    np.testing.assert_array_equal(moved.numpy(), src)
    tf.save({"p": Producer(on_gpu)}, tmp_path / "f.safetensors")
    np.testing.assert_array_equal(tf.load(tmp_path / "f.safetensors")["p"], src)


@pytest.mark.parametrize("stream", [1, 2])
def test_the_default_streams_are_accepted(cuda, stream):
    src = np.arange(8, dtype=np.int32)
    on_gpu = tf.to_device({"x": src}, cuda)["x"]
    np.testing.assert_array_equal(tf.to_host({"p": Producer(on_gpu, stream=stream)})["p"], src)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"stream": 0}, "stream 0"),
        ({"mask": object()}, "masked"),
        ({"typestr": ">f4"}, "byte-swapped"),
        ({"typestr": "<V2"}, "typestr"),
        ({"strides": (3,)}, "multiple"),
        ({"shape": (2**62, 2**62)}, "overflow"),
        ({"data": (0, False)}, "null"),
    ],
)
def test_a_bad_description_is_a_clear_error_naming_the_key(cuda, changes, message):
    on_gpu = tf.to_device({"x": np.ones(4, np.float32)}, cuda)["x"]
    with pytest.raises((tf.FormatError, TypeError, ValueError), match=message) as info:
        tf.to_host({"bad": Producer(on_gpu, **changes)})
    assert "bad" in str(info.value)


def test_an_address_the_driver_does_not_know_is_an_error(cuda):
    host = np.ones(4, np.float32)
    fake = Producer(tf.to_device({"x": host}, cuda)["x"], data=(host.ctypes.data, False))
    with pytest.raises(tf.TensorferryError):
        tf.to_host({"p": fake})


def test_numba_takes_tensorferry_tensors_without_a_copy(cuda):
    numba_cuda = pytest.importorskip("numba.cuda", reason="Numba is not installed")
    if not numba_cuda.is_available():
        pytest.skip("Numba has no CUDA support here")
    src = np.arange(16, dtype=np.float32)
    t = tf.to_device({"x": src}, cuda)["x"]

    @numba_cuda.jit
    def double(a):
        i = numba_cuda.grid(1)
        if i < a.size:
            a[i] *= 2

    arr = numba_cuda.as_cuda_array(t)
    double[1, 32](arr)
    numba_cuda.synchronize()
    np.testing.assert_array_equal(t.numpy(), src * 2)
    # And back: a Numba device array comes home as NumPy, and moves stay Numba's.
    out = tf.to_host({"a": numba_cuda.to_device(src)})
    np.testing.assert_array_equal(out["a"], src)
    moved = tf.to_device({"a": numba_cuda.to_device(src)}, cuda, copy=True)["a"]
    assert isinstance(moved, numba_cuda.cudadrv.devicearray.DeviceNDArray)
