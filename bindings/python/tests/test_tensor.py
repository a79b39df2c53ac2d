"""tensorferry.Tensor: properties, DLPack and NumPy exchange, zero-copy."""

import threading

import numpy as np
import pytest

import tensorferry as tf


def test_properties_describe_the_tensor():
    t = tf.Tensor.from_numpy(np.zeros((2, 3), np.float16))
    assert (t.shape, t.dtype, t.device, t.nbytes, t.ndim, len(t)) == ((2, 3), "float16", "cpu", 12, 2, 2)
    assert repr(t) == "tensorferry.Tensor(shape=[2, 3], dtype=float16, device=cpu)"


def test_numpy_import_is_zero_copy_and_keeps_strides():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    t = tf.Tensor.from_numpy(a.T)
    assert t.data_ptr == a.ctypes.data and not t.is_contiguous
    np.testing.assert_array_equal(t.numpy(), a.T)


def test_the_imported_array_stays_alive_with_the_tensor():
    t = tf.Tensor.from_numpy(np.arange(5.0))
    import gc

    gc.collect()
    np.testing.assert_array_equal(t.numpy(), np.arange(5.0))


def test_dlpack_export_to_torch_is_zero_copy(torch):
    t = tf.Tensor.from_numpy(np.arange(4, dtype=np.float32))
    x = torch.from_dlpack(t)
    assert x.data_ptr() == t.data_ptr and x.tolist() == [0, 1, 2, 3]


def test_dlpack_import_from_torch_is_zero_copy(torch):
    x = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()
    t = tf.Tensor.from_dlpack(x)
    assert t.data_ptr == x.data_ptr() and t.shape == (3, 2)
    np.testing.assert_array_equal(t.numpy(), x.numpy())


def test_numpy_from_dlpack_reads_our_tensor():
    t = tf.Tensor.from_numpy(np.arange(3, dtype=np.uint16))
    np.testing.assert_array_equal(np.from_dlpack(t), [0, 1, 2])


def test_dlpack_copy_true_gives_new_memory(torch):
    t = tf.Tensor.from_numpy(np.arange(3, dtype=np.float64))
    x = torch.from_dlpack(t.__dlpack__(copy=True))
    assert x.data_ptr() != t.data_ptr


def test_legacy_dlpack_consumers_get_a_capsule():
    t = tf.Tensor.from_numpy(np.ones(2))
    cap = t.__dlpack__()
    assert "dltensor" in repr(cap)
    assert t.__dlpack_device__() == (1, 0)


def _dlpack_2_producer():
    """A producer that ignores max_version=(1, 1) and hands over a DLPack 2.0 tensor (the
    spec has the consumer read nothing but the version, and call the deleter); its
    ``deleted`` lists the addresses its deleter was called with, ``address`` is its own."""
    import ctypes as C

    class Version(C.Structure):
        _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32)]

    class DLTensor(C.Structure):
        _fields_ = [("data", C.c_void_p), ("device_type", C.c_int32), ("device_id", C.c_int32),
                    ("ndim", C.c_int32), ("code", C.c_uint8), ("bits", C.c_uint8),
                    ("lanes", C.c_uint16), ("shape", C.POINTER(C.c_int64)),
                    ("strides", C.c_void_p), ("byte_offset", C.c_uint64)]

    Deleter = C.CFUNCTYPE(None, C.c_void_p)

    class Managed(C.Structure):
        _fields_ = [("version", Version), ("manager_ctx", C.c_void_p), ("deleter", Deleter),
                    ("flags", C.c_uint64), ("dl_tensor", DLTensor)]

    new_capsule = C.pythonapi.PyCapsule_New
    new_capsule.restype = C.py_object
    new_capsule.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]

    class Producer:
        def __init__(self):
            self.data = (C.c_uint8 * 4)(1, 2, 3, 4)
            self.shape = (C.c_int64 * 1)(4)
            self.deleted = []
            self.deleter = Deleter(lambda p: self.deleted.append(p))
            self.managed = Managed(Version(2, 0), None, self.deleter, 0,
                                   DLTensor(C.addressof(self.data), 1, 0, 1, 1, 8, 1, self.shape, None, 0))
            self.address = C.addressof(self.managed)

        def __dlpack__(self, **kwargs):
            return new_capsule(self.address, b"dltensor_versioned", None)

        def __dlpack_device__(self):
            return (1, 0)

    return Producer()


def test_a_dlpack_major_version_we_do_not_know_is_refused_and_released():
    producer = _dlpack_2_producer()
    with pytest.raises(tf.TensorferryError, match="major version 2"):
        tf.Tensor.from_dlpack(producer)
    assert producer.deleted == [producer.address]


def test_a_refusal_that_knows_no_key_is_raised_naming_the_leafs_key(tmp_path):
    # The DLPack import refuses the tensor without knowing where it sits in the tree (its
    # error has no key): the conversion of the tree's leaves re-raises it with the key.
    # Before errors carried their key, the keyless message's prefix passed for a keyed one
    # and the key was lost.
    producer = _dlpack_2_producer()
    with pytest.raises(tf.FormatError, match="major version 2") as info:
        tf.save({"model": {"w": producer}}, tmp_path / "f.safetensors")
    assert "model/w" in str(info.value)
    assert producer.deleted == [producer.address]


def test_a_native_error_about_a_value_carries_its_key_path(tmp_path):
    with pytest.raises(tf.FormatError) as info:
        tf.save({"a": {"b": object()}}, tmp_path / "f.safetensors")
    assert info.value.key == "a/b"
    with pytest.raises(tf.FormatError) as info:
        tf.Tensor.from_dlpack(_dlpack_2_producer())
    assert info.value.key is None


def test_jax_reads_our_tensor(jax):
    import jax.numpy as jnp

    t = tf.Tensor.from_numpy(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(jnp.from_dlpack(t)), np.arange(4))


def test_calls_from_many_threads_at_once_are_safe(tmp_path):
    errors = []

    def work(i):
        try:
            src = {"a": np.full(1000, i, np.int64), "s": str(i)}
            out = tf.to_host(src, copy=True)
            p = tmp_path / f"{i}.safetensors"
            tf.save(out, p)
            back = tf.load(p)
            assert back["s"] == str(i) and (back["a"] == i).all()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_big_endian_and_odd_strides_are_handled():
    be = np.arange(3, dtype=">i4")
    np.testing.assert_array_equal(tf.to_host({"x": be}, copy=True)["x"], [0, 1, 2])
    rec = np.zeros(3, dtype=[("a", "<i4"), ("b", "<i2")])["a"]
    np.testing.assert_array_equal(tf.to_host({"x": rec}, copy=True)["x"], [0, 0, 0])
