"""TensorDict: tensordict-style access and one-call moves."""

import numpy as np
import pytest

import tensorferry as tf


@pytest.fixture
def td(state):
    return tf.TensorDict(state)


def test_tuple_keys_are_paths_and_dotted_keys_are_one_key(td):
    assert td["model", "layer.0.weight"].shape == (3, 4)
    assert ("model", "layer.0.weight") in td and "layer.0.weight" not in td
    assert isinstance(td["model"], tf.TensorDict)


def test_len_counts_top_level_keys_and_keys_can_be_nested(td):
    assert len(td) == 5
    nested = td.keys(nested=True)
    assert ("model", "layer.0.bias") in nested and "tag" in nested


def test_set_and_delete_nested(td):
    td["extra", "x"] = np.ones(1)
    assert td["extra", "x"][0] == 1
    del td["extra", "x"]
    assert ("extra", "x") not in td
    with pytest.raises(KeyError):
        td["missing", "path"]


def test_moves_return_new_dicts(td):
    host = td.cpu()
    assert isinstance(host, tf.TensorDict) and host["tag"] == "run-1"
    assert td.to("cpu")["ids"] is td["ids"]
    assert td.wait() is td and td.is_ready()


def test_numpy_and_to_dict_give_plain_containers(td):
    assert isinstance(td.numpy(), dict) and isinstance(td.to_dict()["model"], dict)


def test_consolidate_packs_into_one_buffer(td):
    c = td.consolidate()
    w = c["model", "layer.0.weight"]
    b = c["model", "layer.0.bias"]
    assert w.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0
    assert w.base is not None and np.shares_memory(w, w)
    np.testing.assert_array_equal(w, td["model", "layer.0.weight"])


def test_device_and_nbytes(td):
    assert td.device == "cpu"
    assert td.nbytes == 12 * 4 + 4 * 4 + 5 * 8


def test_save_and_load(td, tmp_path):
    p = tmp_path / "td.safetensors"
    td.save(p)
    back = tf.TensorDict.load(p)
    np.testing.assert_array_equal(back["model", "layer.0.weight"], td["model", "layer.0.weight"])


def test_cuda_without_a_gpu_says_why(td):
    if any(d.startswith("cuda") for d in tf.devices()):
        pytest.skip("a CUDA device is present")
    with pytest.raises(tf.DeviceUnavailableError):
        td.cuda()
