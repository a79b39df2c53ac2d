"""save/load(progress=True): a tqdm bar of bytes on stderr when tqdm is installed, nothing
otherwise; never a change to what is saved or loaded."""

import sys

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _progress


def _big():
    return {"a": np.arange(4 << 20, dtype=np.float32), "b": {"c": np.ones(1 << 20, np.float64)}, "step": 1}


def _bytes(tree):
    return tree["a"].nbytes + tree["b"]["c"].nbytes


@pytest.fixture
def tqdm():
    return pytest.importorskip("tqdm", reason="tqdm is not installed")


@pytest.fixture
def no_tqdm(monkeypatch):
    """tqdm made unimportable, as on a machine without it."""
    for name in [m for m in sys.modules if m == "tqdm" or m.startswith("tqdm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)


def _last_line(err):
    return err.replace("\r", "\n").strip().splitlines()[-1]


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_save_draws_a_bar_of_its_bytes_to_the_end(tqdm, tmp_path, capfd, non_blocking):
    tree = _big()
    handle = tf.save(tree, tmp_path / "big.safetensors", progress=True, non_blocking=non_blocking)
    if non_blocking:
        handle.result(timeout=60)
    err = capfd.readouterr().err
    assert "save big.safetensors" in err, err
    last = _last_line(err)
    assert "100%" in last and "24.0M/24.0M" in last, last  # 24 MiB, in binary units
    np.testing.assert_array_equal(tf.load(tmp_path / "big.safetensors")["a"], tree["a"])


def test_a_sharded_save_counts_every_shard(tqdm, tmp_path, capfd):
    tree = _big()
    tf.save(tree, tmp_path / "model.safetensors", max_shard_size="8MB", progress=True)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    last = _last_line(capfd.readouterr().err)
    assert "100%" in last, last
    np.testing.assert_array_equal(tf.load(tmp_path)["b"]["c"], tree["b"]["c"])


def test_the_bar_follows_the_files_while_they_are_written(tqdm, tmp_path, monkeypatch):
    """The watcher reads the temporary files' sizes while the writer works: a writer slowed
    down shows intermediate counts, never more than the total."""
    seen = []
    real_bar, real_save = _progress.bar, tf._native.save

    def recording_bar(total, what):
        bar = real_bar(total, what)
        update = bar.update

        def record(n):
            update(n)
            seen.append(bar.n)

        bar.update = record
        return bar

    def slow_save(tree, path, *args):
        import os
        import time

        with open(os.path.join(os.path.dirname(path), f".tf-{os.getpid()}-999-0.tmp"), "wb") as f:
            for _ in range(4):
                f.write(b"\0" * (1 << 20))
                f.flush()
                time.sleep(3 * _progress.POLL_SECONDS)
        os.unlink(f.name)
        return real_save(tree, path, *args)

    monkeypatch.setattr(_progress, "bar", recording_bar)
    monkeypatch.setattr(tf._native, "save", slow_save)
    tf.save(_big(), tmp_path / "slow.safetensors", progress=True)
    total = _bytes(_big())
    assert any(0 < n < total for n in seen), seen
    assert seen == sorted(seen) and seen[-1] == total, seen


def test_a_failed_save_leaves_its_bar_unfinished(tqdm, tmp_path, capfd):
    with pytest.raises(tf.FormatError):
        tf.save({"a": np.ones(3), "bad": object()}, tmp_path / "x.safetensors", progress=True)
    assert "100%" not in capfd.readouterr().err


@pytest.mark.parametrize("device", ["cpu", "emu:0"])
def test_a_load_draws_a_bar_of_its_bytes(tqdm, tmp_path, capfd, device):
    tree = _big()
    tf.save(tree, tmp_path / "big.safetensors")
    capfd.readouterr()
    got = tf.load(tmp_path / "big.safetensors", device=device, progress=True)
    err = capfd.readouterr().err
    assert "load big.safetensors" in err and "100%" in _last_line(err), err
    np.testing.assert_array_equal(tf.to_numpy(got)["a"], tree["a"])


@pytest.mark.parametrize("how", [{}, {"device": "emu:0"}, {"device": "emu:0", "dtype": "bfloat16"}],
                         ids=["host", "device", "cast"])
def test_a_bar_of_a_folder_bears_the_folder_s_name(tqdm, tmp_path, capfd, how):
    """A checkpoint named by its folder ("ckpt/") is drawn as "load ckpt", never as a
    bare "load"."""
    (tmp_path / "ckpt").mkdir()
    tf.save(_big(), tmp_path / "ckpt" / "model.safetensors")
    capfd.readouterr()
    tf.load(f"{tmp_path / 'ckpt'}/", progress=True, **how)
    err = capfd.readouterr().err
    assert "load ckpt:" in err and "100%" in _last_line(err), err


def test_without_tqdm_nothing_is_drawn(no_tqdm, tmp_path, capfd):
    tree = _big()
    tf.save(tree, tmp_path / "x.safetensors", progress=True)
    got = tf.load(tmp_path / "x.safetensors", device="emu:0", progress=True)
    got = tf.load(tmp_path / "x.safetensors", progress=True)
    assert capfd.readouterr().err == ""
    np.testing.assert_array_equal(got["a"], tree["a"])


def test_no_bar_unless_asked(tqdm, tmp_path, capfd):
    tf.save(_big(), tmp_path / "x.safetensors")
    tf.load(tmp_path / "x.safetensors", device="emu:0")
    assert capfd.readouterr().err == ""
