"""`load(direct=True)`: O_DIRECT reads past the page cache give what the default load gives,
into fresh memory; a refusal reads through the page cache with one warning saying why; onto
a device, the file streams through the staging ring."""

import mmap
import os
import warnings

import numpy as np
import pytest
from _trees import assert_same

import tensorferry as tf

# Sizes around 4096-byte blocks, so that the data section starts and ends mid-block.
_SIZES = [1, 4095, 4096, 4097, 12_345, 3 << 20, (1 << 20) + 3]


def _tree():
    rng = np.random.default_rng(9)
    return {
        "model": {f"t.{i}": rng.integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(_SIZES)},
        "f": rng.standard_normal((33, 17)).astype(np.float32),
        "empty": np.zeros((0, 4), np.float64),
        "step": 3,
        "tag": "run",
    }


def _supports_direct(folder):
    """True when the filesystem holding `folder` reads files opened with O_DIRECT."""
    probe = os.path.join(folder, "direct-probe")
    with open(probe, "wb") as f:
        f.write(b"\1" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        os.unlink(probe)
        return False
    try:
        os.preadv(fd, [mmap.mmap(-1, 4096)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


def test_a_direct_load_equals_the_default_for_numpy_results(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save(_tree(), p)
    direct = _no_warnings(lambda: tf.load(p, direct=True))
    assert_same(direct, tf.load(p))
    assert direct["model"]["t.1"].flags.writeable, "fresh memory, not the map"


def test_a_direct_load_equals_the_default_for_torch_results(tmp_path, torch):
    src = {"w": torch.randn(300, 41), "b": torch.arange(4097, dtype=torch.int16), "h": torch.ones(3, dtype=torch.bfloat16)}
    p = tmp_path / "t.safetensors"
    tf.save(src, p)
    direct = tf.load(p, direct=True)
    assert all(type(v) is torch.Tensor for v in direct.values())
    assert_same(direct, tf.load(p))
    assert_same(direct, src)


def test_direct_wins_over_the_default_mmap(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save({"x": np.arange(10_000, dtype=np.float32)}, p)
    mapped = tf.load(p, like="tensorferry")["x"]
    direct = tf.load(p, mmap=True, direct=True, like="tensorferry")["x"]
    assert mapped.is_read_only and not direct.is_read_only
    np.testing.assert_array_equal(direct.numpy(), mapped.numpy())


def test_a_sharded_checkpoint_loads_directly(tmp_path):
    tree = _tree()
    tf.save(tree, tmp_path / "model.safetensors", max_shard_size="1MB")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 2
    direct = _no_warnings(lambda: tf.load(tmp_path, direct=True))
    assert_same(direct, tf.load(tmp_path))


def test_a_refusal_reads_through_the_page_cache_with_one_warning_saying_why(tmp_path, monkeypatch):
    p = tmp_path / "x.safetensors"
    tree = _tree()
    tf.save(tree, p)
    monkeypatch.setenv("TENSORFERRY_DIRECT_IO", "0")
    with pytest.warns(RuntimeWarning, match="TENSORFERRY_DIRECT_IO=0 turned O_DIRECT off: read through the page cache") as caught:
        back = tf.load(p, direct=True)
    assert len(caught) == 1
    assert caught[0].filename == __file__, "the warning points at the caller"
    assert_same(back, tf.load(p))


def test_a_sharded_checkpoint_whose_shards_all_fall_back_warns_once(tmp_path, monkeypatch):
    tf.save(_tree(), tmp_path / "model.safetensors", max_shard_size="1MB")
    monkeypatch.setenv("TENSORFERRY_DIRECT_IO", "0")
    with pytest.warns(RuntimeWarning) as caught:
        tf.load(tmp_path, direct=True)
    assert len(caught) == 1
    assert str(caught[0].message).count("TENSORFERRY_DIRECT_IO=0") == 1, "one reason, not one per shard"


def test_tmpfs_reads_directly_or_through_the_page_cache_with_its_reason():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        p = os.path.join(folder, "x.safetensors")
        tf.save(_tree(), p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            back = tf.load(p, direct=True)
        assert_same(back, tf.load(p))
        if _supports_direct(folder):
            assert not caught, "tmpfs accepts O_DIRECT on this kernel (Linux 6.6 and later)"
        else:
            assert len(caught) == 1
            assert "tmpfs refused O_DIRECT (EINVAL): read through the page cache" in str(caught[0].message)


def test_a_direct_load_onto_a_device_equals_the_default_one(tmp_path):
    tf.configure_emulated(1)
    tree = _tree()
    tf.save(tree, tmp_path / "model.safetensors", max_shard_size="1MB")
    direct = tf.to_numpy(tf.load(tmp_path, device="emu:1", direct=True))
    assert_same(direct, tf.to_numpy(tf.load(tmp_path, device="emu:1")))
    assert_same(direct, tree)


def test_a_refusal_on_the_way_to_a_device_warns_too(tmp_path, monkeypatch):
    tf.configure_emulated(1)
    p = tmp_path / "x.safetensors"
    tf.save({"x": np.arange(5000, dtype=np.int32)}, p)
    monkeypatch.setenv("TENSORFERRY_DIRECT_IO", "0")
    with pytest.warns(RuntimeWarning, match="TENSORFERRY_DIRECT_IO=0"):
        back = tf.load(p, device="emu:1", direct=True)
    np.testing.assert_array_equal(tf.to_numpy(back)["x"], np.arange(5000, dtype=np.int32))


def test_keys_cannot_be_combined_with_direct(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save({"a": np.zeros(3), "b": np.ones(3)}, p)
    with pytest.raises(ValueError, match="keys=.*direct=True"):
        tf.load(p, keys="a", direct=True)
    tf.configure_emulated(1)
    with pytest.raises(ValueError, match="keys=.*direct=True"):
        tf.load(p, keys="a", direct=True, device="emu:1")


def test_out_cannot_be_combined_with_direct_onto_a_device(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save({"a": np.arange(3.0)}, p)
    tf.configure_emulated(1)
    out = {"a": np.zeros(3)}
    with pytest.raises(ValueError, match="out=.*direct=True with device='emu:1'"):
        tf.load(p, out=out, direct=True, device="emu:1")
    assert not out["a"].any()
    tf.load(p, out=out, direct=True)  # on the host, out= is filled from a direct read
    np.testing.assert_array_equal(out["a"], np.arange(3.0))


def test_a_truncated_file_is_a_format_error_with_direct(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save({"a": np.arange(10_000, dtype=np.float32)}, p)
    os.truncate(p, os.path.getsize(p) - 100)
    with pytest.raises(tf.FormatError):
        tf.load(p, direct=True)
    tf.configure_emulated(1)
    with pytest.raises(tf.FormatError):
        tf.load(p, direct=True, device="emu:1")


@pytest.mark.gpu
def test_a_direct_load_onto_cuda_equals_the_default_one(tmp_path, torch):
    if "cuda:0" not in tf.devices() or not torch.cuda.is_available():
        pytest.skip("no usable CUDA device with PyTorch")
    src = {"w": torch.randn(1000, 513), "b": torch.arange(4097, dtype=torch.int64), "step": 5}
    p = tmp_path / "t.safetensors"
    tf.save(src, p)
    direct = tf.load(p, device="cuda:0", direct=True, staging=(1 << 20, 2))
    default = tf.load(p, device="cuda:0")
    assert direct["w"].device.type == "cuda" and direct["step"] == 5
    for k in ("w", "b"):
        assert torch.equal(direct[k].cpu(), default[k].cpu()) and torch.equal(direct[k].cpu(), src[k])
