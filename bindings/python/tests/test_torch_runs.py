"""PyTorch results built run by run (one capsule and one strided view per run of evenly
spaced tensors of one dtype and shape): the same tensors as one capsule each."""

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _native


@pytest.fixture
def mixed(tmp_path, torch):
    """A file of interleaved shapes and dtypes, repeated names of one shape, odd sizes."""
    state = {}
    for i in range(40):
        state[f"layer.{i}.weight"] = torch.randn(3, 5)
        state[f"layer.{i}.bias"] = torch.randn(5)
        state[f"layer.{i}.step"] = torch.tensor(i, dtype=torch.int64)
    state["half"] = [torch.randn(7, dtype=torch.bfloat16) for _ in range(6)]
    state["flags"] = [torch.tensor([True, False, True]) for _ in range(4)]
    state["bytes"] = [torch.arange(3, dtype=torch.uint8) for _ in range(4)]
    state["empty"] = [torch.empty(0, 2) for _ in range(3)]
    state["u16"] = [torch.arange(5, dtype=torch.int16) for _ in range(3)]
    path = tmp_path / "mixed.safetensors"
    tf.save(state, path)
    return state, path


@pytest.mark.parametrize("mmap", [True, False])
def test_loaded_torch_tensors_equal_the_saved_ones(torch, mixed, mmap):
    state, path = mixed
    out = tf.load(path, like="torch", mmap=mmap)
    flat_in = tf.to_host(state)  # the same structure, for a parallel walk
    for key in state:
        a, b = flat_in[key], out[key]
        pairs = zip(a, b) if isinstance(a, list) else [(a, b)]
        for x, y in pairs:
            assert type(y) is torch.Tensor and y.dtype == x.dtype and y.shape == x.shape
            assert y.is_contiguous() and torch.equal(x, y)


def test_results_are_writable_and_independent(torch, mixed):
    _, path = mixed
    out = tf.load(path, like="torch", mmap=False)
    before = out["layer.1.weight"].clone()
    out["layer.0.weight"].fill_(0)
    out["layer.2.weight"].add_(1)
    assert torch.equal(out["layer.1.weight"], before)
    again = tf.load(path, like="torch")
    assert not torch.equal(again["layer.0.weight"], out["layer.0.weight"])


def test_a_result_holds_at_most_one_run_of_memory(torch, tmp_path):
    # 300 tensors of 16 KiB: runs stop at 1 MiB, so no result's storage is larger.
    path = tmp_path / "many.safetensors"
    tf.save({f"t{i}": torch.full((4096,), float(i)) for i in range(300)}, path)
    out = tf.load(path, like="torch", mmap=False)
    sizes = {t.untyped_storage().nbytes() for t in out.values()}
    assert max(sizes) <= 1 << 20
    assert all(torch.equal(out[f"t{i}"], torch.full((4096,), float(i))) for i in range(300))


def test_runs_group_only_evenly_spaced_tensors_of_one_dtype_and_shape():
    buf = tf.Tensor.from_numpy(np.arange(64, dtype=np.float32))
    host = tf.to_host({"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32), "c": np.ones(2, np.float32)}, copy=True)
    natives = [tf.Tensor.from_numpy(v) for v in host.values()]
    runs, rest = _native.host_runs(natives + [buf, buf])
    grouped = sorted(i for r in runs for i in r[4])
    assert sorted(grouped + rest) == list(range(5))
    # The same tensor twice is never one run with itself (no spacing).
    assert 3 in rest and 4 in rest


def test_packed_move_results_become_torch_tensors_run_by_run(torch):
    # What a move to the host hands PyTorch (a device's results, packed in one buffer).
    from tensorferry import _frameworks as fw

    src = [np.full((2, 3), i, np.float32) for i in range(10)] + [np.arange(4, dtype=np.int64)] * 3
    moved = _native.move_tensors(_native.from_numpy_many(src), "cpu", True, False, False, "off")
    runs, rest = _native.host_runs(moved)
    assert runs and len(rest) < len(src)
    out = fw.from_native_many(moved, [fw.TORCH] * len(src), [(i,) for i in range(len(src))])
    for a, b in zip(src, out):
        assert type(b) is torch.Tensor and torch.equal(torch.from_numpy(a), b)


def test_runs_never_span_two_buffers(torch):
    from tensorferry import _frameworks as fw

    a = _native.move_tensors(_native.from_numpy_many([np.full(4, i, np.float32) for i in range(3)]), "cpu", True, False, False, "off")
    b = _native.move_tensors(_native.from_numpy_many([np.full(4, 10 + i, np.float32) for i in range(3)]), "cpu", True, False, False, "off")
    mixed = [b[2], a[0], b[0], a[1], b[1], a[2]]
    runs, rest = _native.host_runs(mixed)
    for r in runs:
        assert len({id(mixed[i]) for i in r[4]}) == len(r[4])
        assert all(i % 2 == r[4][0] % 2 for i in r[4])  # one buffer per run
    out = fw.from_native_many(mixed, [fw.TORCH] * 6, [(i,) for i in range(6)])
    for t, o in zip(mixed, out):
        assert torch.equal(torch.from_numpy(np.asarray(t)), o)
