"""A device however the caller names it: a string, a GPU index, a torch.device, a JAX
device, the same on every function that takes one."""

import numpy as np
import pytest

import tensorferry as tf


def _forms():
    forms = [("str", "cpu")]
    try:
        import torch

        forms.append(("torch.device", torch.device("cpu")))
    except ImportError:
        pass
    try:
        import jax

        forms.append(("jax device", jax.devices("cpu")[0]))
    except ImportError:
        pass
    return forms


@pytest.mark.parametrize("name, device", _forms(), ids=[n for n, _ in _forms()])
def test_every_function_that_takes_a_device_takes_each_form(name, device, tmp_path):
    d = {"w": np.arange(4, dtype=np.float32)}
    assert tf.to_device(d, device)["w"].tolist() == [0, 1, 2, 3]
    tf.save(d, tmp_path / "x.safetensors")
    assert tf.load(tmp_path / "x.safetensors", device=device)["w"].tolist() == [0, 1, 2, 3]
    assert tf.TensorDict(d).to(device)["w"].tolist() == [0, 1, 2, 3]
    assert tf.Tensor.from_numpy(d["w"]).to(device).numpy().tolist() == [0, 1, 2, 3]


def test_a_gpu_index_and_a_cuda_torch_device_name_cuda_n(torch):
    if "cuda:0" in tf.devices():
        pytest.skip("a GPU is present: the index would move the data")
    for device in (1, torch.device("cuda:1")):
        with pytest.raises(tf.DeviceUnavailableError, match="cuda:1"):
            tf.to_device({"w": np.ones(2)}, device)


@pytest.mark.parametrize("bad", [3.5, object(), b"cpu", True])
def test_anything_else_is_a_type_error_naming_the_argument(bad):
    with pytest.raises(tf.TensorferryTypeError, match="device=") as info:
        tf.to_device({"w": np.ones(2)}, bad)
    assert isinstance(info.value, TypeError)
    with pytest.raises(tf.TensorferryTypeError, match="device="):
        tf.Tensor.from_numpy(np.ones(2)).to(bad)
