"""save/load: safetensors files, exact round trips, interop, atomicity, hostile files."""

import glob
import hashlib
import json
import math
import os
import types
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest

import tensorferry as tf
from conftest import CORPUS

Pair = namedtuple("Pair", "a b")


def test_a_nested_tree_round_trips_exactly(tmp_path, state):
    p = tmp_path / "s.safetensors"
    tf.save(state, p)
    back = tf.load(p)
    assert list(back) == list(state)
    assert back["tag"] == "run-1" and back["none"] is None
    assert back["optimizer"] == {"step": 7, "lr": 1e-3, "betas": (0.9, 0.999)}
    assert type(back["optimizer"]["betas"]) is tuple
    np.testing.assert_array_equal(back["model"]["layer.0.weight"], state["model"]["layer.0.weight"])
    assert back["ids"].dtype == np.int64


@pytest.mark.parametrize("mmap", [True, False])
def test_special_floats_and_plain_values_round_trip(tmp_path, mmap):
    p = tmp_path / "f.safetensors"
    src = {"nan": float("nan"), "inf": float("inf"), "ninf": -math.inf, "b": True, "i": -3, "s": "é", "l": [1, [2.5, None]]}
    tf.save(src, p)
    back = tf.load(p, mmap=mmap)
    assert math.isnan(back["nan"]) and back["inf"] == math.inf and back["ninf"] == -math.inf
    assert back["b"] is True and back["i"] == -3 and back["s"] == "é" and back["l"] == [1, [2.5, None]]


def test_other_mappings_and_namedtuples_come_back_as_their_base_type(tmp_path):
    p = tmp_path / "m.safetensors"
    tf.save({"od": OrderedDict(x=np.ones(1)), "nt": Pair(np.ones(1), 2)}, p)
    back = tf.load(p)
    assert type(back["od"]) is dict and type(back["nt"]) is tuple and back["nt"][1] == 2


def _varied_tree():
    """Every kind of value and container a save takes, tied arrays and integer keys too."""
    tied = np.arange(12, dtype=np.float32).reshape(3, 4)
    ordered = OrderedDict([("z", np.ones(2, np.float16)), ("a", 1), ("m", None)])
    ordered.move_to_end("z")
    return {
        "model": {"w": tied, "b": np.zeros(4, np.int8), "tied": tied, 3: tf.Tensor.from_numpy(np.ones(2))},
        "ints": {0: "zero", 1: 1.5, -7: True, 2**62: [None, False]},
        "list": [1, 2.5, "three", None, [np.array(7), (4.0,)]],
        "tuple": (np.ones((2, 0)), "s"),
        "pair": Pair(np.full(2, 3.0), Pair(1, "y")),
        "ordered": ordered,
        "default": defaultdict(list, {"k": [3, -4], "n": np.arange(5, dtype=np.int16)}),
        "mapping": types.MappingProxyType({"q": np.array([1.0, 2.0]), "r": "ü€😀"}),
        "floats": [float("nan"), -math.inf, -0.0, 1e-310],
        "big": -(2**63),
        "empty": [{}, [], ()],
        "": "empty key",
        "dotted.key": np.zeros(1, np.uint64),
        "nested": {"a": {"b": [{"c": (np.eye(2, dtype=np.float64),)}]}},
    }


def test_a_varied_tree_is_written_byte_for_byte_as_before(tmp_path):
    """The bytes of the file (header, tree record, frameworks record, data) are pinned: a
    change here is a change of what every reader sees."""
    p = tmp_path / "v.safetensors"
    tf.save(_varied_tree(), p)
    written = hashlib.sha256(p.read_bytes()).hexdigest()
    assert written == "143f9d229dafab8c71c63dd9a0f8c365ee3363d6adaeab08416e744b76433fe5"


def test_the_official_package_reads_our_files_with_dotted_names(tmp_path, state):
    st = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed")
    p = tmp_path / "o.safetensors"
    tf.save(state, p)
    flat = st.load_file(str(p))
    assert set(flat) == {"model.layer.0.weight", "model.layer.0.bias", "ids"}
    np.testing.assert_array_equal(flat["model.layer.0.weight"], state["model"]["layer.0.weight"])


def test_files_of_the_official_package_load_flat_keeping_dots(tmp_path):
    st = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed")
    p = tmp_path / "theirs.safetensors"
    st.save_file({"a.b.c": np.arange(3, dtype=np.float32), "d": np.ones(2, np.int8)}, str(p), metadata={"k": "v"})
    back = tf.load(p)
    assert set(back) == {"a.b.c", "d"}
    np.testing.assert_array_equal(back["a.b.c"], np.arange(3, dtype=np.float32))
    assert tf.metadata(p) == {"k": "v"}


def test_user_metadata_is_kept_and_reserved_keys_refused(tmp_path):
    p = tmp_path / "meta.safetensors"
    tf.save({"x": np.ones(1)}, p, metadata={"author": "me"})
    assert tf.metadata(p) == {"author": "me"}
    with pytest.raises(tf.FormatError, match="reserved"):
        tf.save({"x": np.ones(1)}, p, metadata={"tensorferry": "x"})


def test_colliding_names_are_an_error_naming_both(tmp_path):
    with pytest.raises(tf.FormatError, match=r"a\.b.*a/b|a/b.*a\.b"):
        tf.save({"a.b": np.ones(1), "a": {"b": np.ones(1)}}, tmp_path / "c.safetensors")


def test_unsupported_values_are_errors_naming_key_and_type(tmp_path):
    with pytest.raises(tf.FormatError, match=r"cfg/obj.*object"):
        tf.save({"cfg": {"obj": object()}}, tmp_path / "x.safetensors")
    with pytest.raises(tf.FormatError, match=r'complex128 at "z"'):
        tf.save({"z": np.ones(2, np.complex128)}, tmp_path / "x.safetensors")
    with pytest.raises(tf.FormatError, match="strings or integers, found float"):
        tf.save({1.5: np.ones(1)}, tmp_path / "x.safetensors")


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path):
    p = tmp_path / "keep.safetensors"
    tf.save({"x": np.arange(3)}, p)
    before = p.read_bytes()
    with pytest.raises(tf.FormatError):
        tf.save({"x": np.arange(3), "bad": {1, 2}}, p)
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.safetensors"]


def test_framework_is_recorded_and_like_overrides(tmp_path, torch):
    p = tmp_path / "t.safetensors"
    tf.save({"t": torch.ones(2), "n": np.ones(2)}, p)
    back = tf.load(p)
    assert isinstance(back["t"], torch.Tensor) and isinstance(back["n"], np.ndarray)
    assert isinstance(tf.load(p, like="numpy")["t"], np.ndarray)
    assert isinstance(tf.load(p, like="tensorferry")["n"], tf.Tensor)


def test_the_record_names_only_the_tensors_outside_the_most_common_framework(tmp_path, torch):
    st = pytest.importorskip("safetensors")
    p = tmp_path / "mixed.safetensors"
    src = {"layer": {f"w{i}": torch.full((2,), float(i)) for i in range(3)}, "ids": np.arange(3), "step": 7}
    tf.save(src, p)
    with st.safe_open(str(p), "np") as f:
        meta = f.metadata()
    assert json.loads(meta["tensorferry.frameworks"]) == {"default": "torch", "except": {"ids": "numpy"}}
    assert "format" not in meta  # not every tensor is PyTorch's
    back = tf.load(p)
    assert isinstance(back["ids"], np.ndarray) and back["step"] == 7
    assert all(isinstance(back["layer"][k], torch.Tensor) for k in src["layer"])
    tf.save(src["layer"], p)
    with st.safe_open(str(p), "np") as f:
        assert f.metadata()["format"] == "pt"


def test_bfloat16_and_float8_round_trip_through_ml_dtypes(tmp_path, ml_dtypes):
    p = tmp_path / "b.safetensors"
    src = {
        "bf": np.array([1.5, -2], dtype=ml_dtypes.bfloat16),
        "e4": np.array([0.5, 1], dtype=ml_dtypes.float8_e4m3fn),
        "e5": np.array([2, 4], dtype=ml_dtypes.float8_e5m2),
    }
    tf.save(src, p)
    back = tf.load(p)
    for k, v in src.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k].astype(np.float32), v.astype(np.float32))


def test_mmap_load_is_zero_copy_and_read_load_is_fresh_aligned_memory(tmp_path):
    p = tmp_path / "z.safetensors"
    tf.save({"x": np.arange(1000, dtype=np.float32)}, p)
    mapped = tf.load(p, like="tensorferry")["x"]
    read = tf.load(p, mmap=False, like="tensorferry")["x"]
    assert mapped.is_read_only and not read.is_read_only
    np.testing.assert_array_equal(mapped.numpy(), read.numpy())


def test_a_load_imports_only_the_frameworks_its_file_names(tmp_path, torch):
    """A PyTorch file loaded in a fresh process imports neither JAX nor TensorFlow (both
    installed or not): importing them would cost the first load seconds."""
    import subprocess
    import sys

    pytest.importorskip("jax", reason="needs JAX installed to show it is not imported")
    p = tmp_path / "t.safetensors"
    tf.save({"w": torch.ones(3)}, p)
    code = (f"import sys, torch, tensorferry as tf; tf.load({str(p)!r}); "
            "print(sorted(m for m in ('jax', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _maps_of(path):
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in f if line.rstrip().endswith(real)]


def test_torch_tensors_share_a_private_map_of_the_file_and_their_writes_stay_private(tmp_path, torch):
    p = tmp_path / "t.safetensors"
    src = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    tf.save(src, p)
    before = p.read_bytes()
    back = tf.load(p)
    spans = _maps_of(p)
    assert all(any(lo <= v.data_ptr() < hi for lo, hi in spans) for v in back.values()), "no copy"
    back["w"].add_(1)                                  # writable, as PyTorch tensors must be
    assert torch.equal(back["w"], src["w"] + 1)
    assert p.read_bytes() == before, "the write did not reach the file"
    assert torch.equal(tf.load(p)["w"], src["w"])
    # NumPy views of a map stay read-only.
    assert not tf.load(p, like="numpy")["w"].flags.writeable


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CORPUS, "*.safetensors"))), ids=os.path.basename)
@pytest.mark.parametrize("mmap", [True, False])
def test_hostile_files_raise_format_error(path, mmap):
    if os.path.basename(path).startswith("valid_"):
        tf.load(path, mmap=mmap)
        return
    with pytest.raises(tf.FormatError):
        tf.load(path, mmap=mmap)


def test_the_corpus_is_present():
    assert len(glob.glob(os.path.join(CORPUS, "*.safetensors"))) >= 25
