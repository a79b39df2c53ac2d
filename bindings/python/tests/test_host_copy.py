"""Host copies in bulk (``copy=True`` to the host of many small PyTorch/NumPy leaves): the
same results as one copy per leaf, whatever the layouts, dtypes and odd leaves in the mix."""

import gc

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _host_copy


def _shares(a, b, torch):
    """True when tensors a and b overlap in memory."""
    a0, a1 = a.data_ptr(), a.data_ptr() + a.element_size() * a.numel()
    b0, b1 = b.data_ptr(), b.data_ptr() + b.element_size() * b.numel()
    return a.numel() and b.numel() and a0 < b1 and b0 < a1


def test_torch_copies_equal_the_inputs_and_share_nothing_with_them(torch):
    src = {
        "w": [torch.randn(3, 4) for _ in range(5)],
        "b": [torch.arange(7, dtype=torch.int64) for _ in range(3)],
        "scalar": [torch.tensor(2.5), torch.tensor(-1.0)],
        "bf16": [torch.randn(2, 2, dtype=torch.bfloat16) for _ in range(2)],
        "t": torch.randn(4, 3).t(),  # not contiguous
        "empty": [torch.empty(0, 3), torch.empty(0, 3)],
        "tag": "run-1",
    }
    src["t2"] = torch.randn(4, 3).t()
    for fn in (lambda d: tf.to_host(d, copy=True), lambda d: tf.to_device(d, "cpu", copy=True)):
        out = fn(src)
        assert out["tag"] is src["tag"]
        flat_in = src["w"] + src["b"] + src["scalar"] + src["bf16"] + [src["t"], src["t2"]] + src["empty"]
        flat_out = out["w"] + out["b"] + out["scalar"] + out["bf16"] + [out["t"], out["t2"]] + out["empty"]
        for a, b in zip(flat_in, flat_out):
            assert type(b) is torch.Tensor
            assert b.dtype == a.dtype and b.shape == a.shape and not b.requires_grad
            assert torch.equal(a, b)
            assert not _shares(a, b, torch)


def test_torch_results_are_independent_of_each_other(torch):
    src = {f"k{i}": torch.full((8,), float(i)) for i in range(10)}
    out = tf.to_host(src, copy=True)
    out["k3"].fill_(-1)
    for i in range(10):
        assert torch.equal(src[f"k{i}"], torch.full((8,), float(i)))
        if i != 3:
            assert torch.equal(out[f"k{i}"], torch.full((8,), float(i)))


def test_parameters_and_grad_tensors_come_back_detached(torch):
    p = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    out = tf.to_host({"p": p}, copy=True)
    for a, b in zip(p, out["p"]):
        assert type(b) is torch.Tensor and not b.requires_grad and torch.equal(a.detach(), b)


def test_conjugate_and_negative_views_are_resolved(torch):
    c = [torch.randn(3, dtype=torch.complex64) for _ in range(2)]
    n = [torch._neg_view(torch.arange(3.0)) for _ in range(2)]
    out = tf.to_host({"c": [x.conj() for x in c], "n": n}, copy=True)
    for a, b in zip(c, out["c"]):
        assert not b.is_conj() and torch.equal(b, a.conj().resolve_conj())
    for b in out["n"]:
        assert not b.is_neg() and torch.equal(b, -torch.arange(3.0))


def test_leaves_the_bulk_path_refuses_still_move_or_fail_by_name(torch):
    dense = [torch.ones(4) for _ in range(3)]
    sparse = torch.ones(4).to_sparse()
    out = tf.to_host({"d": dense, "big": [torch.ones(1 << 15), torch.ones(1 << 15)]}, copy=True)
    assert all(torch.equal(x, torch.ones(4)) for x in out["d"])
    assert torch.equal(out["big"][1], torch.ones(1 << 15))
    with pytest.raises(tf.FormatError, match="s"):
        tf.to_host({"d": dense, "s": sparse}, copy=True)


@pytest.mark.parametrize("odd", ["meta", "sparse"])
def test_a_group_mixing_devices_or_layouts_is_refused_by_name_never_copied_wrong(torch, odd):
    """Leaves are grouped by dtype and shape only; a group that mixes devices or layouts
    (checked on its first leaf) is refused by torch.stack as a whole and left to the engine,
    which copies the dense CPU leaves and names the one it cannot take, first or last."""
    other = torch.ones(4, device="meta") if odd == "meta" else torch.ones(4).to_sparse()
    dense = [torch.full((4,), float(i)) for i in range(3)]
    for leaves in (dense + [other], [other] + dense):
        bad = str(next(i for i, x in enumerate(leaves) if x is other))
        with pytest.raises(tf.FormatError, match=f"'{bad}'"):
            tf.to_host(leaves, copy=True)
    out = tf.to_host(dense, copy=True)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(dense, out))


def test_chunks_split_large_groups(torch, monkeypatch):
    monkeypatch.setattr(_host_copy, "CHUNK_BYTES", 64)
    src = [torch.full((4,), float(i)) for i in range(50)]  # 16 bytes each: 4 per chunk
    out = tf.to_host(src, copy=True)
    assert all(torch.equal(a, b) for a, b in zip(src, out))
    assert len({b.untyped_storage().data_ptr() for b in out}) == 13


def test_one_byte_count_in_several_shapes_is_stacked_shape_by_shape(torch, monkeypatch):
    """Leaves are grouped by dtype and byte count (PyTorch reads that faster than a
    shape); a group whose shapes differ is split by shape when torch.stack refuses it.
    Tiny chunks and blocks make the call cut more stacks than it planned for, so that
    later ones need blocks of their own, and a stack refused gives its space back."""
    monkeypatch.setattr(_host_copy, "CHUNK_BYTES", 96)  # 2 rows of 48 bytes a chunk
    monkeypatch.setattr(_host_copy._Blocks, "BLOCK", 256)  # two stacks a block
    monkeypatch.setattr(_host_copy._Blocks, "HUGE", 512)
    shapes = [(12,), (3, 4), (4, 3), (2, 6), (12, 1)]
    src = [torch.arange(12.0).reshape(shapes[i % 5]) + i for i in range(40)]
    src += [torch.tensor(7.0), torch.ones(1), torch.tensor(8.0), torch.ones(1) * 2]  # () and (1,)
    src += [torch.ones(12, dtype=torch.int32), torch.ones(3, 4, dtype=torch.int32)]  # no partner
    out = tf.to_host(src, copy=True)
    for a, b in zip(src, out):
        assert b.shape == a.shape and b.dtype == a.dtype and torch.equal(a, b)
        assert not _shares(a, b, torch)
    # The float rows of one shape are stacks of two (one storage per pair).
    for k in range(5):
        rows = out[k:40:5]
        assert len({b.untyped_storage().data_ptr() for b in rows}) == len(rows) // 2
    assert out[40].untyped_storage().data_ptr() == out[42].untyped_storage().data_ptr()
    assert out[41].untyped_storage().data_ptr() == out[43].untyped_storage().data_ptr()


def test_a_row_kept_alone_keeps_its_values_and_only_its_stack_in_its_storage(torch):
    """Stacks are cut from one buffer for the call; a row that outlives every other result
    keeps its values while the freed memory around it is reused, and its PyTorch storage
    (what ``torch.save`` writes) is its stack, not the whole buffer."""
    src = {f"k{i}": torch.full((1024,), float(i)) for i in range(1500)}  # 6 MB: several stacks
    out = tf.to_host(src, copy=True)
    keep = out["k700"]
    del out
    gc.collect()
    junk = [torch.full((1024,), -1.0) for _ in range(1500)]
    assert torch.equal(keep, torch.full((1024,), 700.0))
    assert keep.untyped_storage().nbytes() <= _host_copy.CHUNK_BYTES
    assert keep.data_ptr() % 64 == 0 and not _shares(keep, src["k700"], torch)
    del junk


def test_blocks_are_bounded_and_aligned_and_small_calls_take_what_they_need():
    """A kept row holds at most one block, not the call's whole memory; blocks start on a
    2 MiB boundary (huge pages); a call that needs less than a block gets just that."""
    big = _host_copy._Blocks(20 << 20)
    seen, kept = set(), []
    for _ in range(20):
        raw = big.raw(1 << 20)  # 1 MiB chunks
        kept.append(raw)
        seen.add(big.block.__array_interface__["data"][0])
        assert big.block.nbytes <= big.BLOCK + big.HUGE and raw.__array_interface__["data"][0] % 64 == 0
        assert (big.block.__array_interface__["data"][0] + big.end - big.BLOCK) % big.HUGE == 0
    assert len(seen) == 5
    small = _host_copy._Blocks(1000)
    small.raw(1000)
    assert small.block.nbytes == 1000 + _host_copy.ALIGN


def test_rows_that_are_not_contiguous_keep_their_memory_format(torch):
    """Channels-last tensors come back channels-last, as ``clone`` gives them."""
    src = [torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last) for _ in range(3)]
    out = tf.to_host(src, copy=True)
    for a, b in zip(src, out):
        assert torch.equal(a, b) and b.stride() == a.clone().stride()


def test_without_the_numpy_bridge_copies_take_the_engines_path(torch, monkeypatch):
    """A PyTorch built without NumPy support refuses torch.from_numpy, which the bulk path
    views its memory with: every copy then takes the engine's path, with the same results."""

    def refuse(_):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch, "from_numpy", refuse)
    src = {f"k{i}": torch.full((256,), float(i)) for i in range(50)}
    out = tf.to_host(src, copy=True)
    assert all(torch.equal(out[k], v) and not _shares(out[k], v, torch) for k, v in src.items())
    assert all(type(b) is torch.Tensor and b.data_ptr() % 64 == 0 for b in out.values())


def test_torch_copies_are_the_cores_not_torch_stack(torch, monkeypatch):
    """One host-copy engine: the bytes of small PyTorch CPU tensors are copied by the core
    into rows of one buffer a chunk (never by torch.stack), for host copies and for the
    stacks bound for a device alike."""

    def refuse(*args, **kwargs):
        raise RuntimeError("torch.stack was called")

    monkeypatch.setattr(torch, "stack", refuse)
    src = [torch.full((16,), float(i)) for i in range(20)]  # 64-byte rows
    out = tf.to_host(src, copy=True)
    assert all(torch.equal(a, b) and not _shares(a, b, torch) for a, b in zip(src, out))
    assert len({b.untyped_storage().data_ptr() for b in out}) == 1
    chunks = _host_copy.torch_chunks(src, device_bound=True)
    assert [part for part, _ in chunks] == [list(range(20))]
    assert torch.equal(chunks[0][1], torch.arange(20.0).repeat_interleave(16).view(20, 16))


def test_copy_arrays_copies_only_groups_of_plain_contiguous_arrays_into_rows():
    """The core copies an array only when it is exactly an ndarray, C-contiguous, of a plain
    dtype of the machine's byte order and a whole number of rows of ``align`` bytes (at most
    ``max_bytes``), in a group of at least two of one dtype and shape; each copy is a new
    array of the leaf's dtype and shape over its row of the memory given, put in ``out``
    under its id. The other items come back in order; memory too small for a chunk is an
    error before any copy, and no memory at all leaves every item to the caller."""
    from tensorferry import _native

    class Sub(np.ndarray):
        pass

    a, b = np.arange(8, dtype=np.uint8), np.arange(8, 16, dtype=np.uint8)
    c, d = np.arange(4, dtype=np.int16).reshape(2, 2), np.arange(4, 8, dtype=np.int16).reshape(2, 2)
    odd = [np.arange(16, dtype=np.uint8)[::2], np.arange(9, dtype=np.uint8), a.view(Sub), np.ones(2, np.float32)]
    odd += [np.arange(4, dtype=">u2"), np.arange(4, dtype=">u2"), np.zeros((0, 8), np.uint8), np.zeros((0, 8), np.uint8)]
    odd += [np.ones(1, np.longdouble), np.ones(1, np.longdouble), "x", np.zeros(64, np.uint8), np.zeros(64, np.uint8)]
    pairs = [((str(i),), x) for i, x in enumerate([a, c] + odd[:5] + [b] + odd[5:] + [d])]
    memory, asked = np.zeros(40, np.uint8), []

    def blocks(need):
        asked.append(need)
        chunks = iter([memory[:16], memory[16:]])
        return lambda nbytes: next(chunks)[:nbytes]

    out = {}
    rest = _native.copy_arrays(pairs, out, blocks, 8, 32, 1 << 20)
    assert rest == [p for p in pairs if p[1] is not a and p[1] is not b and p[1] is not c and p[1] is not d]
    assert asked == [32] and set(out) == {id(a), id(b), id(c), id(d)}
    for x in (a, b, c, d):
        y = out[id(x)]
        assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == x.shape and y.strides == x.strides
        np.testing.assert_array_equal(x, y)
        assert y.flags.c_contiguous and y.flags.writeable and np.shares_memory(y, memory)
    np.testing.assert_array_equal(memory[:32], np.concatenate([a, b, c.view(np.uint8).ravel(), d.view(np.uint8).ravel()]))
    small = np.zeros(8, np.uint8)
    with pytest.raises(tf.TensorferryError, match="too little memory"):
        _native.copy_arrays([((), a), ((), b)], {}, lambda need: lambda nbytes: small, 8, 32, 1 << 20)
    assert not small.any()  # refused before any copy
    out = {}
    assert _native.copy_arrays(pairs, out, lambda need: lambda nbytes: None, 8, 32, 1 << 20) == pairs and not out


def test_copy_rows_refuses_torch_tensors_whose_bytes_are_not_their_values(torch):
    from tensorferry import _native

    """Negative and conjugate views, tensors off the host, sparse ones and overlapping
    views (24 bytes of values over 12 of memory) are refused; a transposed tensor is
    copied as it lies and its strides come back."""
    src = torch.arange(6.0).view(2, 3)
    odd = [torch._neg_view(src), torch.ones(2, 3, device="meta"), src.to_sparse(), torch.arange(3.0).expand(2, 3)]
    leaves = [src, src.t().contiguous().t()] + odd
    dest = np.zeros(24 * len(leaves), np.uint8)
    assert _native.copy_rows(leaves, dest, 24, False) == [True, (1, 2)] + [False] * len(odd)
    np.testing.assert_array_equal(dest[:48].view(np.float32), [0, 1, 2, 3, 4, 5, 0, 3, 1, 4, 2, 5])  # as it lies
    np.testing.assert_array_equal(dest[48:], 0)
    c = torch.ones(3, dtype=torch.complex64)
    assert _native.copy_rows([c, c.conj()], np.zeros(48, np.uint8), 24, True) == [True, False]


def test_non_blocking_copies_still_come_through_a_transfer(torch):
    src = [torch.ones(3), torch.zeros(3)]
    out = tf.to_host(src, copy=True, non_blocking=True)
    assert isinstance(out, tf.Transfer)
    res = out.result()
    assert torch.equal(res[0], src[0]) and torch.equal(res[1], src[1])


def test_the_collector_is_back_on_after_a_call_and_stays_off_if_it_was():
    src = {"a": np.ones(3), "b": np.ones(3)}
    tf.to_host(src, copy=True)
    assert gc.isenabled()
    gc.disable()
    try:
        tf.to_host(src, copy=True)
        assert not gc.isenabled()
    finally:
        gc.enable()
    looped = {"a": np.ones(2)}
    looped["self"] = looped
    with pytest.raises(tf.TensorferryError):
        tf.to_host(looped, copy=True)
    assert gc.isenabled()


def test_numpy_copies_equal_the_inputs_are_aligned_and_share_nothing():
    rng = np.random.default_rng(0)
    src = {
        "blocks": [rng.standard_normal(1024).astype(np.float32) for _ in range(6)],  # 4 KiB rows: bulk
        "mats": [np.asfortranarray(rng.standard_normal((4, 8))) for _ in range(3)],  # 256 B, Fortran order
        "strided": [np.arange(64, dtype=np.int64)[::2] for _ in range(2)],  # 256 B, not contiguous
        "flags": [rng.random(64) > 0.5 for _ in range(2)],  # bool rows of 64 bytes
        "odd": [np.ones(3, np.float32) for _ in range(3)],  # 12 bytes: the engine's path
        "big_endian": [np.arange(16, dtype=">f4") for _ in range(2)],  # not native: the engine's path
        "tag": "run-1",
    }
    out = tf.to_host(src, copy=True)
    assert out["tag"] is src["tag"]
    for key in ("blocks", "mats", "strided", "flags", "odd", "big_endian"):
        for a, b in zip(src[key], out[key]):
            assert type(b) is np.ndarray and b.shape == a.shape
            assert b.dtype.newbyteorder("=") == a.dtype.newbyteorder("=")
            np.testing.assert_array_equal(a, b)
            assert not np.shares_memory(a, b)
            assert b.flags.c_contiguous and b.flags.writeable
            assert b.__array_interface__["data"][0] % 64 == 0
    # Rows of one buffer are still independent values.
    out["blocks"][2][:] = -1
    assert all((b != -1).all() for i, b in enumerate(out["blocks"]) if i != 2)
    np.testing.assert_array_equal(src["blocks"][2], tf.to_host(src, copy=True)["blocks"][2])


def test_a_numpy_row_kept_alone_keeps_only_its_block_alive():
    """NumPy rows are cut from blocks too: a row kept after the others are freed holds at
    most one block, not the memory of the whole call (20 MB here), and keeps its values."""
    src = {f"k{i}": np.full(1024, float(i), np.float32) for i in range(5000)}
    out = tf.to_host(src, copy=True)
    keep = out["k3000"]
    base = keep
    while base.base is not None:
        base = base.base
    assert base.nbytes <= _host_copy._Blocks.BLOCK + _host_copy._Blocks.HUGE
    del out
    gc.collect()
    junk = [np.full(1024, -1.0, np.float32) for _ in range(5000)]
    np.testing.assert_array_equal(keep, np.full(1024, 3000.0, np.float32))
    assert keep.__array_interface__["data"][0] % 64 == 0 and not np.shares_memory(keep, src["k3000"])
    del junk


def test_numpy_leaves_the_bulk_path_leaves_move_or_fail_by_name():
    blocks = [np.full(16, float(i), np.float32) for i in range(4)]  # 64 B rows: bulk
    objects = np.array([object(), None], dtype=object)
    with pytest.raises(tf.TensorferryError, match="'o'"):
        tf.to_host({"b": blocks, "o": objects}, copy=True)
    out = tf.to_host({"b": blocks, "s": [np.float32(2.5)]}, copy=True)
    assert all((x == float(i)).all() for i, x in enumerate(out["b"]))


# Random groups of small PyTorch tensors for the bulk path: one byte count in several shapes
# (so that groups by dtype and byte count must split by shape), 0-dim and 1-element ones,
# transposed, conjugate, negative and sliced views, Parameters, every common dtype.
_TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                 "complex64"]
_SAME_COUNT = [(6,), (2, 3), (3, 2), (1, 6), (6, 1), (1, 2, 3)]
_ROWS_OF_64 = [(8,), (2, 4), (4, 2), (16,), (4, 4)]  # 64-byte rows for 8-byte (and 4-byte) dtypes
_ONE = [(), (1,), (1, 1)]


def _torch_leaf(torch, dtype, shape, seed, variant):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 100).to(getattr(torch, dtype)) if shape else torch.tensor(seed % 7).to(
        getattr(torch, dtype)
    )
    if variant == "t" and t.dim() == 2:
        t = t.t()
    elif variant == "conj" and t.is_complex():
        t = t.conj()
    elif variant == "neg" and t.dtype.is_floating_point:
        t = torch._neg_view(t)
    elif variant == "param" and (t.dtype.is_floating_point or t.is_complex()):
        t = torch.nn.Parameter(t)
    elif variant == "slice" and t.dim() >= 1:
        t = torch.cat([t, t])[: t.shape[0]]
    return t


@pytest.mark.parametrize("target", ["cpu", "emu:0"])
def test_random_groups_of_small_torch_tensors_copy_exactly(torch, target):
    """Property: whatever the mix, every result has its input's dtype, shape and values,
    shares no memory with any input, and writing one result changes no other."""
    from hypothesis import given, settings, HealthCheck, strategies as st

    leaf = st.tuples(
        st.sampled_from(_TORCH_DTYPES),
        st.sampled_from(_SAME_COUNT + _ONE + _ROWS_OF_64),
        st.integers(0, 10_000),
        st.sampled_from(["plain", "t", "conj", "neg", "param", "slice"]),
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(leaf, min_size=2, max_size=24))
    def check(specs):
        src = [_torch_leaf(torch, *s) for s in specs]
        if target == "cpu":
            out = tf.to_host(src, copy=True)
        else:  # the emulated device's tensors come back as tensorferry tensors
            out = [torch.from_dlpack(t) for t in tf.to_host(tf.to_device(src, target))]
        assert len(out) == len(src)
        for a, b in zip(src, out):
            want = a.detach().resolve_conj().resolve_neg()
            assert type(b) is torch.Tensor and b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(b, want), (a, b)
            assert all(not _shares(b, x, torch) for x in src)
        if target == "cpu":
            before = [b.clone() for b in out]
            raw = out[0].reshape(-1).view(torch.uint8)
            raw[:1] ^= 1
            for b, keep in zip(out[1:], before[1:]):
                assert torch.equal(b.reshape(-1).view(torch.uint8), keep.reshape(-1).view(torch.uint8))

    check()


def test_leaves_are_grouped_natively_by_key_in_order_skipping_others():
    class Sub(np.ndarray):
        pass

    class Odd:
        @property
        def key(self):
            raise ValueError("no key")

    leaves = [np.zeros(2, np.float32), "x", np.zeros(3, np.int8), np.zeros(2, np.float32)]
    leaves += [np.zeros(2, np.float32).view(Sub), np.zeros(3, np.int8), Odd(), np.zeros(2, np.float32)]
    groups = _host_copy._groups(leaves, (np.ndarray, Odd))
    # Keys in the order they first appear, indices in order; exact types only (the
    # subclass is left out) and a leaf whose key raises is left out.
    assert list(groups.items()) == [((np.dtype(np.float32), (2,)), [0, 3, 7]), ((np.dtype(np.int8), (3,)), [2, 5])]
    assert _host_copy._groups(iter(leaves[:1]), [np.ndarray]) == {(np.dtype(np.float32), (2,)): [0]}

    def interrupted(leaf):
        raise KeyboardInterrupt

    # Only an ordinary exception leaves a leaf out: an interrupt still stops the call.
    with pytest.raises(KeyboardInterrupt):
        _host_copy._groups(leaves, (np.ndarray,), interrupted)
