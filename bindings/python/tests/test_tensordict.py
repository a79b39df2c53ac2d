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


# ---- batch_size: the leading dimensions every tensor shares, checked as tensordict does


def _batch():
    return {"obs": np.zeros((4, 3), np.float32), "reward": np.arange(4.0), "info": {"mask": np.ones((4, 2), bool)}}


def test_batch_size_is_an_option_not_a_data_key():
    td = tf.TensorDict(_batch(), batch_size=[4])
    assert "batch_size" not in td and set(td) == {"obs", "reward", "info"}
    assert td.batch_size == (4,) and td.shape == (4,) and td.batch_dims == 1


def test_the_default_batch_size_is_empty_and_checks_nothing(td):
    assert td.batch_size == ()


@pytest.mark.parametrize("size", [[4, 3], (4,), 4, []], ids=["two-dims", "tuple", "int", "empty"])
def test_a_batch_size_that_fits_every_tensor_is_accepted(size):
    td = tf.TensorDict({"obs": np.zeros((4, 3, 2))}, batch_size=size)
    assert td.batch_size == ((size,) if isinstance(size, int) else tuple(size))


def test_a_batch_size_that_does_not_fit_a_tensor_is_a_format_error_naming_key_and_shapes():
    with pytest.raises(tf.FormatError, match=r"batch_size \[4\] does not fit the tensor at 'info/mask', of shape \[5, 2\]") as info:
        tf.TensorDict({"obs": np.zeros((4, 3)), "info": {"mask": np.ones((5, 2))}}, batch_size=[4])
    assert isinstance(info.value, ValueError)


def test_a_batch_size_longer_than_a_tensors_dimensions_is_refused():
    with pytest.raises(tf.FormatError, match=r"'reward', of shape \[4\]"):
        tf.TensorDict(_batch(), batch_size=[4, 3])


def test_plain_values_do_not_take_part_in_the_batch():
    td = tf.TensorDict({"obs": np.zeros((2, 5)), "step": 7, "tag": "run"}, batch_size=[2])
    assert td["step"] == 7


@pytest.mark.parametrize("bad", ["4", [1.5], object()], ids=["str", "float", "object"])
def test_a_batch_size_that_is_not_ints_is_a_type_error(bad):
    with pytest.raises(tf.TensorferryTypeError, match="batch_size"):
        tf.TensorDict({}, batch_size=bad)


def test_a_negative_batch_size_is_a_format_error():
    with pytest.raises(tf.FormatError, match="negative"):
        tf.TensorDict({}, batch_size=[-1])


def test_setting_an_entry_checks_it_against_the_batch_size():
    td = tf.TensorDict(_batch(), batch_size=[4])
    td["info", "extra"] = np.zeros((4, 9))
    with pytest.raises(tf.FormatError, match=r"'info/bad', of shape \[3\]"):
        td["info", "bad"] = np.zeros(3)
    assert ("info", "bad") not in td
    with pytest.raises(tf.FormatError, match=r"'nested/x'"):
        td["nested"] = {"x": np.zeros(2)}


def test_setting_the_batch_size_checks_every_tensor():
    td = tf.TensorDict(_batch())
    td.batch_size = [4]
    assert td.batch_size == (4,)
    with pytest.raises(tf.FormatError):
        td.batch_size = [5]
    assert td.batch_size == (4,)


def test_the_batch_size_is_kept_by_moves_nested_reads_and_copies():
    td = tf.TensorDict(_batch(), batch_size=[4])
    assert td.to("emu:0").batch_size == (4,)
    assert td.to("emu:0").cpu().batch_size == (4,)
    assert td.consolidate().batch_size == (4,)
    assert td["info"].batch_size == (4,)
    assert tf.TensorDict(td).batch_size == (4,)
    assert tf.TensorDict(td, batch_size=[]).batch_size == ()


def test_torch_tensors_and_a_torch_size(torch):
    td = tf.TensorDict({"x": torch.zeros(3, 2)}, batch_size=torch.Size([3]))
    assert td.batch_size == (3,)
    with pytest.raises(tf.FormatError, match=r"'y', of shape \[2\]"):
        td["y"] = torch.zeros(2)


# ---- moves give TensorDicts


def test_cpu_of_a_device_dict_is_a_tensordict_with_its_values():
    td = tf.TensorDict(_batch(), batch_size=[4])
    back = td.to("emu:0").cpu()
    assert isinstance(back, tf.TensorDict) and back.device == "cpu"
    np.testing.assert_array_equal(tf.to_numpy({"obs": back["obs"]})["obs"], td["obs"])


@pytest.mark.parametrize("move", ["to", "cpu"])
def test_a_non_blocking_move_gives_a_tensordict_now_or_from_its_transfer(move):
    td = tf.TensorDict(_batch(), batch_size=[4]).to("emu:0")
    out = td.to("emu:1", non_blocking=True) if move == "to" else td.cpu(non_blocking=True)
    if isinstance(out, tf.Transfer):
        out = out.result()
    assert isinstance(out, tf.TensorDict) and out.batch_size == (4,)
    assert out == td


# ---- waits name the key of a failed copy


def test_a_failed_copy_waited_for_names_the_key(failing_emu0):
    # A tensor whose copy is still queued, made by the native move itself (the public
    # non-blocking moves hand back a Transfer, which waits by itself).
    (pending,) = tf._native.move_tensors(
        [tf.Tensor.from_numpy(np.ones(10, np.float32))], failing_emu0, False, True, False, "off"
    )
    moved = tf.TensorDict({"model": {"w": pending}})
    with pytest.raises(tf.CopyError, match=r"emu:0 failed \(filling 'model/w'\)") as info:
        moved.wait()
    assert info.value.key == "model/w"


# ---- equality: one bool, as for a mapping


def test_equal_contents_compare_equal_and_not_unequal():
    a, b = tf.TensorDict(_batch()), tf.TensorDict(_batch())
    assert a == b and not (a != b)


def test_equality_reads_tensors_wherever_they_are():
    td = tf.TensorDict(_batch(), batch_size=[4])
    assert td.to("emu:0") == td and td.to("emu:0").cpu() == td


def test_equality_with_a_plain_dict_compares_the_contents():
    assert tf.TensorDict(_batch()) == _batch()
    assert _batch() == tf.TensorDict(_batch())


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["info"].__setitem__("mask", np.zeros((4, 2), bool)),
        lambda d: d.__setitem__("reward", np.arange(4)),  # same values, another dtype
        lambda d: d.__setitem__("reward", np.arange(4.0).reshape(4, 1)),  # another shape
        lambda d: d.__setitem__("more", 1),
        lambda d: d.pop("obs"),
        lambda d: d.__setitem__("obs", [0.0] * 12),  # a list is not the tensor
    ],
    ids=["value", "dtype", "shape", "extra-key", "missing-key", "not-a-tensor"],
)
def test_any_difference_makes_them_unequal(change):
    other = _batch()
    change(other)
    assert tf.TensorDict(_batch()) != tf.TensorDict(other)
    assert not (tf.TensorDict(_batch()) == other)


def test_a_different_batch_size_makes_them_unequal():
    assert tf.TensorDict(_batch(), batch_size=[4]) != tf.TensorDict(_batch())


def test_nan_is_unequal_as_with_arrays():
    a = tf.TensorDict({"x": np.array([np.nan])})
    assert a != tf.TensorDict({"x": np.array([np.nan])})


def test_anything_but_a_mapping_is_unequal():
    td = tf.TensorDict(_batch())
    assert td != None and td != 3 and td != [1]  # noqa: E711


def test_a_tensordict_is_not_hashable():
    with pytest.raises(TypeError):
        hash(tf.TensorDict())


def test_load_non_blocking_gives_a_transfer_of_a_tensordict_and_a_list_file_is_named(tmp_path):
    tf.save({"x": np.arange(4.0), "n": 1}, tmp_path / "d.safetensors")
    pending = tf.TensorDict.load(tmp_path / "d.safetensors", non_blocking=True)
    assert isinstance(pending, tf.Transfer)
    td = pending.result()
    assert isinstance(td, tf.TensorDict) and td["n"] == 1
    np.testing.assert_array_equal(td["x"], np.arange(4.0))
    tf.save([np.ones(2)], tmp_path / "l.safetensors")
    with pytest.raises(tf.FormatError, match=r"holds a list, not a dict"):
        tf.TensorDict.load(tmp_path / "l.safetensors")


@pytest.mark.parametrize("obj", [[np.ones(2)], "abc", [("a", 1)]])
def test_a_tensordict_is_made_of_a_mapping_only(obj):
    with pytest.raises(tf.TensorferryTypeError, match=r"TensorDict takes a mapping"):
        tf.TensorDict(obj)


def test_the_module_functions_keep_a_tensordicts_batch_size_as_its_methods_do():
    td = tf.TensorDict({"x": np.ones((4, 3), np.float32), "inner": {"y": np.zeros(4)}}, batch_size=[4])
    for moved in (tf.to_device(td, "emu:0"), tf.to_host(td, copy=True), tf.to_numpy(td), td.to("emu:0"),
                  tf.to_host({"batch": td}, copy=True)["batch"]):
        assert isinstance(moved, tf.TensorDict) and moved.batch_size == (4,), type(moved)


def test_save_and_numpy_take_the_options_of_the_module_functions(tmp_path):
    td = tf.TensorDict({"x": np.arange(4.0)})
    pending = td.save(tmp_path / "d/", non_blocking=True, max_shard_size="1MB")
    assert isinstance(pending, tf.Transfer)
    pending.result()
    np.testing.assert_array_equal(tf.load(tmp_path / "d/")["x"], np.arange(4.0))
    np.testing.assert_array_equal(td.numpy(non_blocking=True).result()["x"], np.arange(4.0))
