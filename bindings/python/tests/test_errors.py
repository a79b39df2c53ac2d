"""Errors: one base class, each kind also its built-in, with the reason in the message."""

import numpy as np
import pytest

import tensorferry as tf


def test_every_error_class_derives_from_the_base_and_its_builtin():
    assert issubclass(tf.FormatError, tf.TensorferryError) and issubclass(tf.FormatError, ValueError)
    assert issubclass(tf.DeviceUnavailableError, RuntimeError)
    assert issubclass(tf.OutOfMemoryError, MemoryError)
    assert issubclass(tf.InvalidDeviceError, ValueError)
    assert issubclass(tf.TensorferryIOError, OSError)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "", "cpu:0:1"])
def test_a_bad_device_string_is_a_value_error_listing_the_forms(bad):
    with pytest.raises(tf.InvalidDeviceError, match=r"cuda:N") as info:
        tf.to_device({"a": np.ones(1)}, bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, tf.TensorferryError)


def test_an_absent_gpu_raises_device_unavailable_with_the_reason():
    if any(d.startswith("cuda") for d in tf.devices()):
        pytest.skip("a CUDA device is present on this machine")
    src = {"a": np.ones(3)}
    with pytest.raises(tf.DeviceUnavailableError, match=r"cuda:0 is unavailable: .+"):
        tf.to_device(src, "cuda:0")
    np.testing.assert_array_equal(src["a"], np.ones(3))


def test_a_missing_file_is_an_os_error_with_errno_and_name(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(tf.TensorferryIOError) as info:
        tf.load(missing)
    assert isinstance(info.value, FileNotFoundError) or info.value.errno == 2
    assert str(missing) in str(info.value)


def test_devices_lists_the_host_first():
    assert tf.devices()[0] == "cpu"
