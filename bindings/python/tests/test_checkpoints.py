"""Sharded checkpoints as the Hugging Face ecosystem writes them, checked against the real
`safetensors` and `transformers` packages both ways."""

import json
import os
import warnings

import numpy as np
import pytest

import tensorferry as tf


def _state(layers=6):
    rng = np.random.default_rng(0)
    return {
        "model": {f"layer.{i}.weight": rng.standard_normal((16, 16)).astype(np.float32) for i in range(layers)},
        "step": 12,
        "tag": "run-1",
    }


def test_a_dict_saved_in_shards_loads_back_from_the_index_or_the_folder(tmp_path):
    state = _state()
    tf.save(state, tmp_path / "model.safetensors", max_shard_size="2KB")
    files = sorted(os.listdir(tmp_path))
    assert files[-1] == "model.safetensors.index.json"
    assert files[0] == "model-00001-of-00006.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 16 * 16 * 4
    assert index["weight_map"]["model.layer.5.weight"] == "model-00006-of-00006.safetensors"
    for where in (tmp_path / "model.safetensors.index.json", tmp_path):
        back = tf.load(where)
        assert back["step"] == 12 and back["tag"] == "run-1"
        for k, v in state["model"].items():
            np.testing.assert_array_equal(back["model"][k], v)


def test_the_official_reader_reads_every_shard(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    state = _state()
    tf.save(state, tmp_path / "model.safetensors", max_shard_size=3000)
    seen = {}
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            seen.update(st.load_file(str(tmp_path / name)))
    assert sorted(seen) == sorted(f"model.{k}" for k in state["model"])
    np.testing.assert_array_equal(seen["model.layer.3.weight"], state["model"]["layer.3.weight"])


@pytest.mark.parametrize("size, files", [(10**9, 1), ("1GB", 1), ("1KiB", 7), ("1.5kb", 7)])
def test_sizes_are_bytes_or_units(tmp_path, size, files):
    tf.save(_state(), tmp_path / "model.safetensors", max_shard_size=size)
    assert len(os.listdir(tmp_path)) == files


@pytest.mark.parametrize("bad, error", [(0, ValueError), ("5 parsecs", ValueError), (-1, ValueError), (2.5, TypeError)])
def test_a_bad_size_is_refused_before_anything_is_written(tmp_path, bad, error):
    with pytest.raises(error):
        tf.save(_state(), tmp_path / "model.safetensors", max_shard_size=bad)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def tiny_gpt2(torch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers, transformers.GPT2LMHeadModel(config).eval()


def test_tensorferry_loads_what_transformers_saves_in_shards(tiny_gpt2, tmp_path, torch):
    transformers, model = tiny_gpt2
    model.save_pretrained(tmp_path, max_shard_size="20KB", safe_serialization=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    back = tf.load(tmp_path)
    saved = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    assert set(back) == set(saved)
    assert all(type(v) is torch.Tensor for v in back.values()), "the files say format: pt"
    for k, v in back.items():
        assert v.dtype == saved[k].dtype and (v == saved[k]).all(), k


def test_transformers_loads_what_tensorferry_saves_in_shards(tiny_gpt2, tmp_path, torch):
    transformers, model = tiny_gpt2
    model.config.save_pretrained(tmp_path)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tf.save(state, tmp_path / "model.safetensors", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()

    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


# -- non-blocking save: a snapshot, then the write in the background ---------------------


def test_a_non_blocking_save_snapshots_then_writes_in_the_background(tmp_path):
    state = _state()
    expected = {k: v.copy() for k, v in state["model"].items()}
    pending = tf.save(state, tmp_path / "ckpt.safetensors", non_blocking=True)
    assert isinstance(pending, tf.Transfer)
    for v in state["model"].values():
        v += 1000.0  # the next training step overwrites the tensors at once
    assert pending.result() is None and pending.done()
    back = tf.load(tmp_path / "ckpt.safetensors")
    for k, v in expected.items():
        np.testing.assert_array_equal(back["model"][k], v)
    assert back["step"] == 12


def test_a_non_blocking_save_of_device_tensors_snapshots_them(tmp_path):
    tf.configure_emulated(1)
    src = _state()
    on_device = tf.to_device(src, "emu:1")
    pending = tf.save(on_device, tmp_path / "ckpt.safetensors", non_blocking=True, max_shard_size="3KB")
    pending.wait()
    back = tf.load(tmp_path)
    np.testing.assert_array_equal(back["model"]["layer.2.weight"], src["model"]["layer.2.weight"])


def test_a_failed_non_blocking_save_raises_at_wait_and_keeps_the_previous_file(tmp_path):
    p = tmp_path / "ckpt.safetensors"
    tf.save({"w": np.ones(2)}, p)
    before = p.read_bytes()
    pending = tf.save({"w": np.zeros(2), "bad": object()}, p, non_blocking=True)
    with pytest.raises(tf.FormatError, match="bad"):
        pending.wait()
    with pytest.raises(tf.FormatError, match="bad"):
        pending.result()
    assert isinstance(pending.exception(), tf.FormatError)
    assert p.read_bytes() == before
    missing = tf.save({"w": np.ones(2)}, tmp_path / "no" / "such.safetensors", non_blocking=True)
    with pytest.raises(FileNotFoundError):
        missing.result()


def test_a_non_blocking_save_can_be_awaited(tmp_path):
    import asyncio

    async def main():
        await tf.save(_state(), tmp_path / "ckpt.safetensors", non_blocking=True)

    asyncio.run(main())
    assert tf.load(tmp_path / "ckpt.safetensors")["tag"] == "run-1"


# -- load a subset, cast, fill existing tensors ---------------------------------------------


@pytest.fixture
def saved(tmp_path):
    state = _state(4)
    state["model"]["layer.0.bias"] = np.arange(16, dtype=np.int64)
    p = tmp_path / "ckpt.safetensors"
    tf.save(state, p)
    return state, p


@pytest.mark.parametrize(
    "keys, expected",
    [
        ("model.layer.1.weight", ["layer.1.weight"]),
        (("model", "layer.2.weight"), ["layer.2.weight"]),
        ("model.layer.*.weight", ["layer.0.weight", "layer.1.weight", "layer.2.weight", "layer.3.weight"]),
        (["model.layer.0", "step"], ["layer.0.weight", "layer.0.bias"]),
    ],
)
def test_keys_load_a_subset_by_name_path_prefix_or_glob(saved, keys, expected):
    state, p = saved
    back = tf.load(p, keys=keys)
    assert sorted(back["model"]) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(back["model"][k], state["model"][k])
    assert ("step" in back) == ("step" in (keys if isinstance(keys, list) else [keys]))


def test_keys_that_match_nothing_are_a_key_error_naming_them(saved):
    with pytest.raises(tf.TensorferryKeyError, match="model.nope"):
        tf.load(saved[1], keys=["model.layer.0.weight", "model.nope"])


def test_keys_select_from_sharded_checkpoints_too(tmp_path):
    state = _state()
    tf.save(state, tmp_path / "model.safetensors", max_shard_size="2KB")
    back = tf.load(tmp_path, keys="model.layer.5.*")
    assert list(back["model"]) == ["layer.5.weight"]


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "float16"])
def test_dtype_casts_floating_tensors_and_leaves_integers(saved, dtype, ml_dtypes):
    state, p = saved
    back = tf.load(p, dtype=dtype)
    want = "bfloat16" if dtype.startswith("bf") else "float16"
    assert str(back["model"]["layer.1.weight"].dtype) == want
    assert back["model"]["layer.0.bias"].dtype == np.int64
    np.testing.assert_allclose(back["model"]["layer.1.weight"].astype(np.float32), state["model"]["layer.1.weight"], rtol=1e-2)


def test_dtype_casts_torch_tensors_with_torch(saved, torch):
    back = tf.load(saved[1], like="torch", dtype=torch.bfloat16)
    assert back["model"]["layer.1.weight"].dtype == torch.bfloat16
    assert back["model"]["layer.0.bias"].dtype == torch.int64


def test_a_bad_dtype_is_refused(saved):
    with pytest.raises(ValueError, match="int8"):
        tf.load(saved[1], dtype="int8")


def test_out_fills_a_models_state_dict_in_place(tiny_gpt2, tmp_path, torch):
    transformers, model = tiny_gpt2
    p = tmp_path / "model.safetensors"
    tf.save(model.state_dict(), p)
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(model.config).eval()
    target = fresh.state_dict()
    before = {k: v.data_ptr() for k, v in target.items()}
    assert tf.load(p, out=target) is target
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
        assert fresh.state_dict()[k].data_ptr() == before[k], "filled in place, not replaced"


def test_out_names_every_mismatch_and_changes_nothing(saved):
    state, p = saved
    out = {"model": {k: np.zeros_like(v) for k, v in state["model"].items()}, "extra": np.zeros(3)}
    out["model"]["layer.1.weight"] = np.zeros((4, 4), np.float32)
    out["model"]["layer.2.weight"] = np.zeros((16, 16), np.float64)
    del out["model"]["layer.3.weight"]
    with pytest.raises(tf.FormatError) as info:
        tf.load(p, out=out, keys="model")
    text = str(info.value)
    for needle in ["layer.1.weight: shape", "layer.2.weight: dtype", "layer.3.weight: in the file", "extra: in out="]:
        assert needle in text, text
    assert not out["model"]["layer.0.weight"].any(), "nothing was written"


@pytest.mark.parametrize("direct, count", [(False, 10_000_000), (True, 3_000_001)])
def test_a_load_to_a_device_streams_through_a_ring_that_bounds_host_memory(tmp_path, direct, count):
    """Through the page cache or with O_DIRECT (no fallback warning), a load onto a device
    pins the ring and no more."""
    tf.configure_emulated(1)
    rng = np.random.default_rng(3)
    big = {"w": rng.standard_normal(count).astype(np.float32), "b": rng.standard_normal(1000).astype(np.float32)}
    p = tmp_path / "big.safetensors"
    tf.save(big, p)
    ring = 1 << 20
    before = tf.pinned_pool_stats("emu:1")["pinned_bytes"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = tf.load(p, device="emu:1", direct=direct, staging=(ring, 2))
    after = tf.pinned_pool_stats("emu:1")["pinned_bytes"]
    assert back["w"].device == "emu:1"
    assert after - before <= 2 * ring, f"pinned {after - before} bytes for a {4 * count / 1e6:.0f} MB file"
    host = tf.to_numpy(back)
    np.testing.assert_array_equal(host["w"], big["w"])
    np.testing.assert_array_equal(host["b"], big["b"])


def test_a_save_from_a_device_streams_through_a_ring_into_the_same_bytes(tmp_path):
    tf.configure_emulated(1)
    rng = np.random.default_rng(4)
    state = {"w": rng.standard_normal(3_000_000).astype(np.float32), "step": 7,
             "b": rng.standard_normal((300, 7)).astype(np.float16)}
    on_device = tf.to_device(state, "emu:1")
    ring = 1 << 20
    before = tf.pinned_pool_stats("emu:1")["pinned_bytes"]
    tf.save(on_device, tmp_path / "d.safetensors", staging=(ring, 2))
    after = tf.pinned_pool_stats("emu:1")["pinned_bytes"]
    assert after - before <= 2 * 2 * ring, f"pinned {after - before} bytes for a 12 MB save"
    tf.save(state, tmp_path / "h.safetensors")
    (d, h) = ((tmp_path / n).read_bytes() for n in ("d.safetensors", "h.safetensors"))
    data = lambda b: b[8 + int.from_bytes(b[:8], "little"):]
    assert data(d) == data(h), "the same data section (headers differ only in the frameworks recorded)"
    back = tf.load(tmp_path / "d.safetensors", like="numpy")
    assert back["step"] == 7 and all(np.array_equal(back[k], state[k]) for k in ("w", "b"))
    with pytest.raises(ValueError, match="staging"):
        tf.save(on_device, tmp_path / "x.safetensors", staging="sometimes")
    assert not (tmp_path / "x.safetensors").exists()


_PEAK_RSS_OF_A_SAVE = """
import sys, numpy as np, tensorferry as tf
tf.configure_emulated(1)
x = tf.to_device({"w": np.ones(64 << 20, np.float32)}, "emu:1")   # 256 MiB on the device
staging = sys.argv[2] if sys.argv[2] == "off" else (8 << 20, 2)
tf.save(x, sys.argv[1] + "/warm.safetensors", staging=staging, fsync=False)  # pools warmed
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) << 10
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                               # the peak resident size starts again from now
before = status("VmRSS")
tf.save(x, sys.argv[1] + "/w.safetensors", staging=staging, fsync=False)
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("staging, bounded", [("ring", True), ("off", False)])
def test_host_memory_of_a_device_save_is_bounded_by_the_ring(tmp_path, staging, bounded):
    """The process's peak resident memory during a 256 MiB save from a device grows by the
    ring (2 x 8 MiB) plus slack, not by the tensors' size — and does without the ring, which
    shows that the measurement can tell the two apart."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_A_SAVE, str(tmp_path), staging],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    if bounded:
        assert grown < 64 << 20, f"peak resident memory grew {grown >> 20} MiB"
    else:
        assert grown > 200 << 20, f"peak resident memory grew only {grown >> 20} MiB"


def test_a_torch_checkpoint_loads_onto_a_device_without_a_host_copy(tmp_path, torch):
    tf.configure_emulated(1)
    p = tmp_path / "t.safetensors"
    tf.save({"w": torch.arange(1000, dtype=torch.float32)}, p)
    back = tf.load(p, device="emu:1", keys="w", dtype=None)
    assert type(back["w"]) is tf.Tensor and back["w"].device == "emu:1"
    np.testing.assert_array_equal(back["w"].numpy(), np.arange(1000, dtype=np.float32))
    with pytest.raises(ValueError, match="emu:1"):
        tf.load(p, device="emu:1", like="torch")


def test_a_sharded_save_takes_device_tensors_as_they_are(tmp_path):
    tf.configure_emulated(1)
    src = _state()
    on_device = tf.to_device(src, "emu:1")
    tf.save(on_device, tmp_path / "model.safetensors", max_shard_size="3KB")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 3  # 2 × 1 KiB per 3 KB
    back = tf.load(tmp_path)
    for k, v in src["model"].items():
        np.testing.assert_array_equal(back["model"][k], v)
    assert back["step"] == 12


def test_key_path_tuples_match_literally_even_with_glob_characters(tmp_path):
    # Found by the DCP storage layer's tests: tuples went through fnmatch.
    p = tmp_path / "f.safetensors"
    tf.save({"optim.state.*x[1]": np.ones(2), "optim.state.ax1": np.zeros(2)}, p)
    back = tf.load(p, keys=[("optim.state.*x[1]",)])
    assert list(back) == ["optim.state.*x[1]"]


def test_a_subset_without_mmap_is_copied_into_fresh_memory(saved):
    state, p = saved
    back = tf.load(p, keys="model.layer.1.weight", mmap=False)
    w = back["model"]["layer.1.weight"]
    assert w.flags.writeable and w.flags.owndata or w.base is not None
    np.testing.assert_array_equal(w, state["model"]["layer.1.weight"])
    w[0, 0] = 123.0  # fresh memory: writable, the file is untouched
    assert tf.load(p)["model"]["layer.1.weight"][0, 0] == state["model"]["layer.1.weight"][0, 0]


def test_a_corrupt_file_is_a_format_error_naming_the_file(tmp_path):
    p = tmp_path / "corrupt.safetensors"
    p.write_bytes(b"\xff" * 8 + b"{not json")
    with pytest.raises(tf.FormatError, match="corrupt.safetensors"):
        tf.load(p)
    with pytest.raises(tf.FormatError, match="corrupt.safetensors"):
        tf.metadata(p)
