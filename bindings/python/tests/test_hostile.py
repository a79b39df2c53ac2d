"""Inputs that must never crash, hang or return wrong data: each is an ordinary exception
that names the key (or the depth, or the cycle), and nothing of the source is lost."""

import collections
import errno
import json
import os

import numpy as np
import pytest

import tensorferry as tf

from _mutating_leaf import AddsATensorWhenAsked

MOVES = {
    "to_host": lambda d, p: tf.to_host(d, copy=True),
    "to_numpy": lambda d, p: tf.to_numpy(d),
    "to_device": lambda d, p: tf.to_device(d, "cpu", copy=True),
    "to_device_emu": lambda d, p: tf.to_device(d, "emu:0"),
    "save": lambda d, p: tf.save(d, p),
    "TensorDict.cpu": lambda d, p: tf.TensorDict(d).cpu(),
}


def _deep(levels, leaf):
    root = node = {}
    for _ in range(levels - 1):
        node["a"] = {}
        node = node["a"]
    node["a"] = leaf
    return root


@pytest.mark.parametrize("call", MOVES)
def test_a_dictionary_that_contains_itself_is_an_error_naming_where(call, tmp_path):
    d = {"w": np.ones(2, np.float32), "inner": {"x": np.zeros(1)}}
    d["inner"]["loop"] = d
    with pytest.raises(tf.FormatError, match=r"contains itself.*|inner/loop"):
        MOVES[call](d, tmp_path / "f.safetensors")
    assert not (tmp_path / "f.safetensors").exists()


@pytest.mark.parametrize("call", MOVES)
def test_nesting_50000_levels_deep_is_an_error_naming_the_depth(call, tmp_path):
    d = _deep(50_000, np.ones(2, np.float32))
    with pytest.raises(tf.FormatError, match=r"deeper than \d+ levels"):
        MOVES[call](d, tmp_path / "f.safetensors")


def test_a_list_nested_50000_levels_deep_is_an_error_not_a_crash():
    data = [1.0]
    for _ in range(50_000):
        data = [data]
    with pytest.raises(tf.FormatError, match=r"deeper than \d+ levels"):
        tf.to_device({"x": data}, "cpu")


def test_a_mapping_subclass_that_contains_itself_is_an_error():
    d = collections.OrderedDict(w=np.ones(2))
    d["self"] = d
    with pytest.raises(tf.FormatError, match="contains itself"):
        tf.to_host({"outer": d}, copy=True)


def test_ordered_dicts_nested_50000_levels_deep_are_an_error_naming_the_depth():
    d = np.ones(2, np.float32)
    for _ in range(50_000):
        d = collections.OrderedDict(a=d)
    with pytest.raises(tf.FormatError, match=r"deeper than \d+ levels"):
        tf.to_host(d, copy=True)


def test_the_same_subtree_twice_is_not_a_cycle():
    shared = {"w": np.arange(3.0)}
    out = tf.to_host({"a": shared, "b": shared}, copy=True)
    np.testing.assert_array_equal(out["a"]["w"], out["b"]["w"])


def test_nesting_within_the_limit_works():
    out = tf.to_host(_deep(tf._tree.MAX_DEPTH - 1, np.arange(3.0)), copy=True)
    node = out
    while isinstance(node, dict):
        node = node["a"]
    np.testing.assert_array_equal(node, np.arange(3.0))


def test_a_tensor_added_during_a_move_is_an_error_naming_its_key():
    d = {}
    d["sneaky"] = AddsATensorWhenAsked(d)
    with pytest.raises(RuntimeError, match="late"):
        tf.to_host(d, copy=True)


class _ClearsItsParent(collections.abc.Mapping):
    def __init__(self, parent):
        self.parent = parent

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        self.parent.clear()
        return iter(())

    def __len__(self):
        return 0


def test_a_dictionary_emptied_during_the_walk_is_no_internal_error():
    d = {"a": np.ones(2), "b": np.ones(2)}
    d["m"] = _ClearsItsParent(d)
    try:
        tf.to_host(d, copy=True)
    except RuntimeError as e:
        assert "internal error" not in str(e)


@pytest.mark.parametrize("value", [2**63, 2**64 + 1, -(2**63) - 1, 10**40])
def test_integers_beyond_int64_are_an_overflow_error_naming_the_key(value):
    with pytest.raises(OverflowError, match="ids"):
        tf.to_device({"batch": {"ids": [1, value]}}, "cpu")
    with pytest.raises(tf.TensorferryOverflowError):
        tf.to_device({"ids": [[1], [value]]}, "cpu")


def test_int64_limits_are_kept_exactly():
    out = tf.to_device({"ids": [2**63 - 1, -(2**63)]}, "cpu")
    assert out["ids"].numpy().tolist() == [2**63 - 1, -(2**63)]


def test_finite_floats_beyond_float32_are_an_overflow_error_naming_the_key():
    with pytest.raises(OverflowError, match="emb"):
        tf.to_device({"emb": [1.0, 1e39]}, "cpu")


def test_infinities_and_nans_in_float_lists_stay_as_they_are():
    out = tf.to_device({"x": [float("inf"), float("-inf"), float("nan"), 3.0e38]}, "cpu")
    got = out["x"].numpy()
    assert np.isposinf(got[0]) and np.isneginf(got[1]) and np.isnan(got[2]) and np.isfinite(got[3])


def test_saving_an_integer_beyond_int64_is_an_overflow_error(tmp_path):
    with pytest.raises(tf.TensorferryOverflowError, match="step"):
        tf.save({"step": 2**70}, tmp_path / "f.safetensors")


def test_keys_that_are_not_valid_unicode_are_an_error_naming_them(tmp_path):
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # as os.fsdecode makes it
    p = tmp_path / "f.safetensors"
    tf.save({"ok": np.ones(1)}, p)
    with pytest.raises(tf.FormatError, match="not valid Unicode"):
        tf.save({bad: np.ones(2)}, p)
    with pytest.raises(tf.FormatError, match="not valid Unicode"):
        tf.save({"name": bad}, p)
    with pytest.raises(tf.FormatError, match="not valid Unicode"):
        tf.save({"ok": np.ones(1)}, p, metadata={"author": bad})
    assert list(tf.load(p)) == ["ok"], "the previous file is intact"
    # Moves never need the key as text.
    assert list(tf.to_host({bad: np.ones(2)}, copy=True)) == [bad]


@pytest.mark.parametrize(
    "record",
    ["[1, 2]", '{"default": 5}', '{"except": []}', '{"except": {"w": 3}}', "not json", '"torch"', "[" * 100_000],
)
def test_a_malformed_framework_record_only_loses_the_hint(record, tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    p = str(tmp_path / "f.safetensors")
    st.save_file({"w": np.arange(3.0)}, p, metadata={"tensorferry.frameworks": record})
    out = tf.load(p)
    np.testing.assert_array_equal(out["w"], np.arange(3.0))


def test_a_tensor_named_metadata_is_refused_before_the_file_is_touched(tmp_path):
    p = tmp_path / "f.safetensors"
    tf.save({"w": np.ones(1)}, p)
    before = p.read_bytes()
    with pytest.raises(tf.FormatError, match="__metadata__"):
        tf.save({"__metadata__": np.ones(2)}, p)
    assert p.read_bytes() == before


def _unexportable_torch(torch):
    yield "meta", torch.empty(3, device="meta")
    yield "quantized", torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    yield "sparse", torch.ones(3, 3).to_sparse()
    yield "nested", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize("call", ["to_host", "to_numpy", "save", "to_device"])
def test_torch_tensors_that_cannot_be_exported_are_an_error_naming_the_key(torch, call, tmp_path):
    for name, t in _unexportable_torch(torch):
        d = {"model": {name: t}, "ok": torch.ones(2)}
        with pytest.raises((tf.FormatError, tf.DeviceUnavailableError)) as info:
            MOVES[call](d, tmp_path / "f.safetensors")
        assert f"model/{name}" in str(info.value), (name, str(info.value))
        assert "internal error" not in str(info.value)


def test_a_missing_file_is_a_file_not_found_error_with_errno_and_path(tmp_path):
    p = str(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError) as info:
        tf.load(p)
    assert isinstance(info.value, tf.TensorferryError)
    assert isinstance(info.value, tf.TensorferryIOError)
    assert info.value.errno == errno.ENOENT and info.value.filename == p and p in str(info.value)


def test_a_directory_is_an_is_a_directory_error(tmp_path):
    with pytest.raises(IsADirectoryError) as info:
        tf.load(tmp_path)
    assert isinstance(info.value, tf.TensorferryError)
    assert info.value.errno == errno.EISDIR


def test_saving_into_a_missing_folder_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        tf.save({"w": np.ones(1)}, tmp_path / "no" / "such" / "f.safetensors")
    assert isinstance(info.value, tf.TensorferryError)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root bypasses permission bits")
def test_an_unreadable_file_is_a_permission_error(tmp_path):
    p = tmp_path / "f.safetensors"
    tf.save({"w": np.ones(1)}, p)
    p.chmod(0)
    with pytest.raises(PermissionError) as info:
        tf.load(p)
    assert isinstance(info.value, tf.TensorferryError)


def test_a_fifo_is_refused_at_once_not_read(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    with pytest.raises((tf.FormatError, tf.TensorferryIOError), match="regular file|FIFO|fifo"):
        tf.load(p)


@pytest.mark.parametrize("path", ["/dev/zero", "/proc/self/status"])
def test_devices_and_procfs_files_are_refused(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} is absent here")
    with pytest.raises(tf.TensorferryError, match="regular file"):
        tf.load(path)


def test_json_of_the_record_is_kept_compact_and_loadable(tmp_path):
    # The record the package writes reads back through the official reader's metadata.
    st = pytest.importorskip("safetensors")
    p = str(tmp_path / "f.safetensors")
    tf.save({"w": np.ones(2, np.float32)}, p)
    with st.safe_open(p, "np") as f:
        record = json.loads(f.metadata()["tensorferry.frameworks"])
    assert record["default"] == "numpy"


@pytest.mark.parametrize("levels", [32, 33, 60])
def test_a_huge_integer_deep_in_a_list_is_an_overflow_error_at_any_depth(levels):
    # Found by fuzz/python/fuzz_tree.py: past NumPy's 32 dimensions it was a RuntimeError.
    data = 2**64
    for _ in range(levels):
        data = [data]
    with pytest.raises(tf.TensorferryOverflowError, match="x"):
        tf.to_device({"x": data}, "cpu")


def test_nested_keys_of_a_tensordict_that_contains_itself_are_an_error():
    # Found by fuzz/python/fuzz_tree.py: a RecursionError after seconds and a gigabyte.
    chain = 1
    for _ in range(400):
        chain = {"d": chain}
    d = {"chain": chain}
    d["self"] = d
    with pytest.raises(tf.FormatError, match="deeper than|contains itself"):
        tf.TensorDict(d).keys(nested=True)
    loop = {"a": 1}
    loop["me"] = loop
    with pytest.raises(tf.FormatError, match="contains itself"):
        tf.TensorDict(loop).keys(nested=True)


def test_messages_about_deep_paths_are_shortened():
    with pytest.raises(tf.FormatError) as info:
        tf.to_device(_deep(5000, [1.0]), "cpu")
    assert len(str(info.value)) < 400, str(info.value)


_LOAD_A_HUGE_INDEX = """
import json, os, sys, time
import tensorferry as tf
folder = sys.argv[1]
index = os.path.join(folder, "m.safetensors.index.json")
with open(index, "w") as f:
    json.dump({"weight_map": {f"t{i}": f"s{i}.safetensors" for i in range(1_500_000)}}, f)
print("go", flush=True)
started = time.monotonic()
try:
    tf.load(index)
except KeyboardInterrupt:
    print(f"interrupted {time.monotonic() - started:.2f}", flush=True)
"""


def test_ctrl_c_interrupts_the_load_of_a_huge_index_at_once(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [sys.executable, "-c", _LOAD_A_HUGE_INDEX, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "go", child.stderr.read()
        time.sleep(0.3)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        try:
            out, err = child.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("Ctrl-C was not answered within 10 s")
        answered = time.monotonic() - sent
    finally:
        child.kill()
        child.wait()
    assert out.strip().startswith("interrupted"), (out, err)
    # The index takes seconds to read; a load that ignored the signal answered after it.
    assert answered < 1.0, f"Ctrl-C answered after {answered:.2f} s"


def _raw_file(path, entries, metadata=None, data=b""):
    """A safetensors file written by hand: ``entries`` {name: (dtype, shape, begin, end)}."""
    import struct

    header = {n: {"dtype": d, "shape": s, "data_offsets": [b, e]} for n, (d, s, b, e) in entries.items()}
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("dtype, nbytes", [("F6_E2M3", 3), ("F6_E3M2", 3), ("F4", 2)])
@pytest.mark.parametrize("how", [{"format": "pt"}, {"format": "flax"}, "torch", "jax"])
def test_packed_floats_a_framework_cannot_hold_stay_tensorferry_tensors(dtype, nbytes, how, tmp_path):
    """A file naming a framework (Hugging Face's "format"), or like=, whose tensors that
    framework has no dtype for (PyTorch has float4_e2m1fn_x2 and no float6; JAX neither):
    those stay tensorferry tensors, as without a format, the others convert."""
    like = how if isinstance(how, str) else None
    framework = like or {"pt": "torch", "flax": "jax"}[how["format"]]
    module = pytest.importorskip(framework)
    path = _raw_file(tmp_path / "p.safetensors", {"p": (dtype, [4], 0, nbytes), "w": ("F32", [2], nbytes, nbytes + 8)},
                     how if isinstance(how, dict) else None, bytes(nbytes + 8))
    got = tf.load(path, like=like)
    held = framework == "torch" and hasattr(module, {"F4": "float4_e2m1fn_x2"}.get(dtype, "-"))
    assert isinstance(got["p"], tf.Tensor) != held, type(got["p"])
    assert not isinstance(got["w"], tf.Tensor), type(got["w"])


def test_a_dimension_beyond_int64_is_an_error_naming_the_tensor(tmp_path):
    """Valid JSON and zero bytes (an empty tensor), but no framework holds the shape."""
    path = _raw_file(tmp_path / "d.safetensors", {"empty": ("F32", [0, 2**64 - 1], 0, 0)})
    for like in (None, "tensorferry"):
        with pytest.raises(tf.FormatError, match=r'tensor "empty".*dimension 18446744073709551615 .*beyond int64'):
            tf.load(path, like=like)
