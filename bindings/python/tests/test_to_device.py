"""to_device: data lists become tensors in standard dtypes; tensors move."""

import numpy as np
import pytest

import tensorferry as tf


def test_seed_lists_become_float32_and_int64_tensors():
    out = tf.to_device({"embedding_1": [1.0, 2.0, 3.0], "embedding_2": [4.0, 5.0, 6.0], "ids": [[1, 2], [3, 4]]}, "cpu")
    assert out["embedding_1"].dtype == "float32" and out["embedding_1"].shape == (3,)
    assert out["ids"].dtype == "int64" and out["ids"].shape == (2, 2)
    np.testing.assert_array_equal(out["ids"].numpy(), [[1, 2], [3, 4]])
    assert out["embedding_1"].device == "cpu"


def test_bools_stay_bools_and_mixed_numbers_become_float32():
    out = tf.to_device({"m": [True, False], "x": [1, 2.5], "t": (1, 2)}, "cpu")
    assert out["m"].dtype == "bool" and out["x"].dtype == "float32"
    assert out["t"] == (1, 2)  # a tuple is a record, not data (test_training_state.py)


def test_a_ragged_list_is_a_format_error_naming_its_key():
    with pytest.raises(tf.FormatError, match="feats/rows"):
        tf.to_device({"feats": {"rows": [[1, 2], [3]]}}, "cpu")


def test_an_empty_list_stays_a_list_and_strings_are_kept():
    src = {"e": [], "names": ["a", "b"], "mixed": [1, "a"]}
    out = tf.to_device(src, "cpu")
    assert out["e"] == [] and out["names"] == ["a", "b"] and out["mixed"] == [1, "a"]
    assert out["names"][0] is src["names"][0]


def test_tensors_already_on_the_target_are_not_copied(state):
    out = tf.to_device(state, "cpu")
    assert out["ids"] is state["ids"]
    copied = tf.to_device(state, "cpu", copy=True)
    assert not np.shares_memory(copied["ids"], state["ids"])


def test_to_host_and_to_numpy_leave_data_lists_alone():
    src = {"l": [1.0, 2.0]}
    for out in (tf.to_host(src), tf.to_numpy(src), tf.TensorDict(src).to_dict()):
        assert type(out["l"]) is list and out["l"] == [1.0, 2.0]
        assert out["l"][0] is src["l"][0]


def test_torch_cpu_tensors_move_to_cpu_as_torch(torch):
    src = {"w": torch.ones(2, 2)}
    out = tf.to_device(src, "cpu")
    assert out["w"] is src["w"]
