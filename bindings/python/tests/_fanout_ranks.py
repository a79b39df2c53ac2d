"""Real torch.distributed ranks (gloo, loopback) for the process-group load tests.

``make_checkpoints(folder)`` writes the checkpoints once, in the test process;
``run_ranks(scenario, world, folder)`` starts ``world`` processes of this file, each
joining one process group (with a short timeout) and running every step of ``scenario``
in turn (starting ranks is the slow part). Each step checks its results itself against a
plain ``tf.load`` on the same rank (a failed check fails the rank) and records what the
test process asserts across ranks — bytes read, errors raised — in
``folder/results/<scenario>_<rank>.json``.
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import _ranks
from _trees import assert_same

RANK_TIMEOUT_S = 90
PG_TIMEOUT_S = 10
KILLED_RANK = 3
KILL_AFTER_S = 0.5

# The tensor-parallel checkpoint: what each name is split along (None: replicated).
TP_SPLITS = {
    "embed.weight": 0,  # vocabulary-parallel
    "layers.0.qkv.weight": 0,  # column-parallel
    "layers.0.qkv.bias": 0,
    "layers.0.o.weight": 1,  # row-parallel
    "layers.1.qkv.weight": 0,
    "layers.1.qkv.bias": 0,
    "layers.1.o.weight": 1,
    "conv.weight": 1,  # a 3-D tensor cut in its middle dim: one run per outer index
    "norm.weight": None,
}
TP_SPEC = {"embed.weight": 0, "layers.*.qkv.*": 0, "layers.*.o.weight": 1, "conv.weight": 1}


def run_ranks(scenario, world, folder, expect_killed=None):
    """Runs ``scenario`` on ``world`` ranks; returns ``{rank: results}``. Every rank must
    exit 0 within the deadline, except ``expect_killed``, which must die by SIGKILL."""
    return _ranks.run_ranks(
        __file__, scenario, world, folder, timeout=RANK_TIMEOUT_S, expect_killed=expect_killed,
        results_of_killed=False,
    )


# ---- the checkpoints ---------------------------------------------------------------------


def mixed_tree():
    """Nesting, plain values, a NumPy leaf among PyTorch ones, odd sizes and dtypes."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(1)
    layers = [
        {"w": torch.randn(37 + 11 * i, 29, generator=g), "b": torch.randn(29, generator=g).to(torch.bfloat16)}
        for i in range(24)
    ]
    return {
        "model": {
            "layers": layers,
            "embed": torch.randn(300, 64, generator=g).to(torch.float16),
            "flags": torch.rand(17, generator=g) > 0.5,
            "ids": torch.arange(-50, 50, dtype=torch.int64),
            "bytes": torch.arange(255, dtype=torch.uint8),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "table": np.arange(40, dtype=np.int32).reshape(8, 5),
        },
        "optim": {"step": 12, "lr": 3e-4, "betas": (0.9, 0.999), "name": "adam", "none": None},
    }


def tp_tensors():
    import torch

    g = torch.Generator().manual_seed(2)
    shapes = {
        "embed.weight": (128, 32),
        "layers.0.qkv.weight": (96, 32),
        "layers.0.qkv.bias": (96,),
        "layers.0.o.weight": (32, 32),
        "layers.1.qkv.weight": (96, 32),
        "layers.1.qkv.bias": (96,),
        "layers.1.o.weight": (32, 32),
        "conv.weight": (3, 8, 5),
        "norm.weight": (32,),
    }
    return {name: torch.randn(*shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}


def make_checkpoints(folder):
    """Writes, in ``folder``: ``mixed.safetensors`` (tensorferry's, nested), ``ts/``
    (tensorferry's sharded save), ``hf/`` (a foreign sharded checkpoint: shards written by
    safetensors, an index written by hand), ``tp.safetensors`` (a flat foreign file),
    ``other.safetensors`` (the mixed tree with one shape changed)."""
    from safetensors.torch import save_file

    import tensorferry as tf

    os.makedirs(os.path.join(folder, "results"), exist_ok=True)
    tree = mixed_tree()
    tf.save(tree, os.path.join(folder, "mixed.safetensors"))
    os.makedirs(os.path.join(folder, "ts"))
    tf.save(tree, os.path.join(folder, "ts", "model.safetensors"), max_shard_size=20_000)
    tp = tp_tensors()
    save_file(tp, os.path.join(folder, "tp.safetensors"), metadata={"format": "pt"})
    hf = os.path.join(folder, "hf")
    os.makedirs(hf)
    names = sorted(tp)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tp[n] for n in part}, os.path.join(hf, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tp.values())}, "weight_map": weight_map}, f)
    # The same shards recording the save that wrote them, as tensorferry's sharded saves
    # do: once all of one save, once a shard of another save.
    for copy, second in (("hf_saved", "a"), ("hf_two_saves", "b")):
        os.makedirs(os.path.join(folder, copy))
        for i, part in enumerate(halves):
            shard = f"model-0000{i + 1}-of-00002.safetensors"
            meta = {"format": "pt", "tensorferry.save": "a" if i == 0 else second}
            save_file({n: tp[n] for n in part}, os.path.join(folder, copy, shard), metadata=meta)
        with open(os.path.join(folder, copy, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"tensorferry.save": "a"}, "weight_map": weight_map}, f)
    import torch

    big = {f"w{i}": torch.full(BIG_SHAPE, float(i)) for i in range(BIG_TENSORS)}
    tf.save(big, os.path.join(folder, "big.safetensors"))
    other = mixed_tree()
    other["model"]["embed"] = other["model"]["embed"][:299]
    tf.save(other, os.path.join(folder, "other.safetensors"))
    # A head tied to the embedding: stored once, under the embedding's name alone.
    embedding = torch.arange(6000, dtype=torch.float32).reshape(60, 100)
    tied = {"embed.weight": embedding, "mid": torch.ones(6000), "head.weight": embedding}
    tf.save(tied, os.path.join(folder, "tied.safetensors"))
    tf.save(tied, os.path.join(folder, "tied") + "/", max_shard_size=30_000)


# ---- checks ------------------------------------------------------------------------------


def leaves(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, path + (i,))
    else:
        yield ".".join(map(str, path)), tree


def stats_of(s):
    return {"needed": s.needed, "data": s.data, "header": s.header, "files": s.files}


def expect_error(fn):
    """``{"type", "message"}`` of what ``fn`` raised; it must raise."""
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    raise AssertionError("expected an error")


# ---- scenarios ---------------------------------------------------------------------------


def replicated(folder, pg, out):
    """Every checkpoint loads on every rank as tf.load loads it; bytes counted."""
    import tensorferry as tf
    from tensorferry.dcp import ReadStats

    for name in ("mixed.safetensors", "ts", "hf", "tp.safetensors", "ts/model.safetensors", "ts/model", "hf_saved"):
        path = os.path.join(folder, name)
        stats = ReadStats()
        try:
            want = tf.load(path)
        except Exception as e:
            # A path this build's tf.load does not take (the path a sharded save was given,
            # before native builds resolved it): the same error, through the group.
            err = expect_error(lambda: tf.load(path, process_group=pg))
            assert type(e).__name__ in err["mro"], (e, err)
            continue
        got = tf.load(path, process_group=pg, read_stats=stats)
        assert_same(got, want)
        out[f"replicated:{name}"] = stats_of(stats)


def sharded(folder, pg, out, rank, world):
    """Slices equal tensor_split of the full tensors, for a flat file and a foreign sharded
    checkpoint; a subset of only sliced names reads exactly its slices' bytes."""
    import torch

    import tensorferry as tf
    from tensorferry.dcp import ReadStats

    for name in ("tp.safetensors", "hf"):
        path = os.path.join(folder, name)
        full = tf.load(path)
        stats = ReadStats()
        got = tf.load(path, process_group=pg, shard=TP_SPEC, read_stats=stats)
        assert list(got) == list(full)
        for n, dim in TP_SPLITS.items():
            want = full[n] if dim is None else torch.tensor_split(full[n], world, dim)[rank]
            assert torch.equal(got[n], want) and got[n].is_contiguous(), n
        out[f"sharded:{name}"] = stats_of(stats)
    stats = ReadStats()
    sliced = [n for n, d in TP_SPLITS.items() if d is not None]
    got = tf.load(os.path.join(folder, "tp.safetensors"), process_group=pg, shard=TP_SPEC, keys=sliced, read_stats=stats)
    assert sorted(got) == sorted(sliced)
    out["sharded_only"] = stats_of(stats)
    # Two ranks per part: rank r holds part r % 2.
    got = tf.load(os.path.join(folder, "tp.safetensors"), process_group=pg, shard={"embed.weight": (0, 2)})
    assert torch.equal(got["embed.weight"], torch.tensor_split(full["embed.weight"], 2, 0)[rank % 2])
    # out=: a tensor-parallel model's own parameters, filled in place.
    params = {
        n: torch.zeros_like(full[n] if dim is None else torch.tensor_split(full[n], world, dim)[rank])
        for n, dim in TP_SPLITS.items()
    }
    before = {n: t.data_ptr() for n, t in params.items()}
    filled = tf.load(os.path.join(folder, "tp.safetensors"), process_group=pg, shard=TP_SPEC, out=params)
    assert filled is params and {n: t.data_ptr() for n, t in params.items()} == before
    for n, dim in TP_SPLITS.items():
        want = full[n] if dim is None else torch.tensor_split(full[n], world, dim)[rank]
        assert torch.equal(params[n], want), n


def direct(folder, pg, out, rank, world):
    """direct=True: each rank reads its part with O_DIRECT; results as tf.load's, slices
    as tensor_split's; the bytes read (whole blocks) recorded, with any fallback."""
    import warnings

    import torch

    import tensorferry as tf
    from tensorferry.dcp import ReadStats

    for name in ("mixed.safetensors", "hf"):
        path = os.path.join(folder, name)
        stats = ReadStats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tf.load(path, process_group=pg, direct=True, read_stats=stats)
        assert_same(got, tf.load(path))
        out[f"direct:{name}"] = {**stats_of(stats), "warnings": [str(w.message) for w in caught]}
    path = os.path.join(folder, "tp.safetensors")
    full = tf.load(path)
    stats = ReadStats()
    got = tf.load(path, process_group=pg, shard=TP_SPEC, direct=True, read_stats=stats)
    for n, dim in TP_SPLITS.items():
        want = full[n] if dim is None else torch.tensor_split(full[n], world, dim)[rank]
        assert torch.equal(got[n], want) and got[n].is_contiguous(), n
    out["direct_sharded"] = stats_of(stats)


# What each tensor of the DCP-trained state is split along on the training mesh (None:
# replicated); the same spec loads its consolidated checkpoint tensor-parallel.
DCP_SPLITS = {"embed.weight": 0, "layers.0.qkv.weight": 0, "layers.0.o.weight": 1, "norm.weight": None}


def dcp_full_tensors():
    import torch

    g = torch.Generator().manual_seed(3)
    shapes = {"embed.weight": (64, 16), "layers.0.qkv.weight": (48, 16), "layers.0.o.weight": (16, 48), "norm.weight": (16,)}
    return {n: torch.randn(*shape, generator=g) for n, shape in shapes.items()}


def dcp_state(mesh, fill):
    """A training state as DCP saves it: DTensors sharded by rows, by columns, replicated,
    and an optimizer's values."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = dcp_full_tensors()

    def dt(name):
        t = full[name] if fill else torch.zeros_like(full[name])
        dim = DCP_SPLITS[name]
        return distribute_tensor(t, mesh, [Replicate() if dim is None else Shard(dim)])

    return {
        "model": {n: dt(n) for n in DCP_SPLITS},
        "optim": {"step": 7 if fill else 0, "exp_avg": dt("embed.weight")},
    }


def dcp_interplay(folder, pg, out, rank, world):
    """Training saves with DCP and tensorferry's writer; rank 0 consolidates it into a
    Hugging Face checkpoint (tensorferry.dcp.consolidate); every rank loads that
    tensor-parallel with process_group= and shard= — and gets back the local shards of the
    DTensors it saved, reading only their bytes — or replicated, reading ~1/N. The DCP
    checkpoint itself loads through dcp.load and TensorferryReader on the same ranks,
    reading exactly the bytes each rank needs."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import tensorferry as tf
    from tensorferry.dcp import ReadStats, TensorferryReader, TensorferryWriter, consolidate

    mesh = init_device_mesh("cpu", (world,))
    ckpt, hf = os.path.join(folder, f"dcp_{world}"), os.path.join(folder, f"dcp_{world}_hf")
    saved = dcp_state(mesh, True)
    dcp.save(saved, storage_writer=TensorferryWriter(ckpt))
    if rank == 0:
        consolidate(ckpt, hf, prefix="model.")
    dist.barrier(group=pg)
    spec = {n: dim for n, dim in DCP_SPLITS.items() if dim is not None}
    stats = ReadStats()
    got = tf.load(hf, process_group=pg, shard=spec, read_stats=stats)
    assert list(got) == list(tf.load(hf))
    for n, dim in DCP_SPLITS.items():
        want = saved["model"][n].to_local()
        assert torch.equal(got[n], want), n
    out["dcp:sharded"] = stats_of(stats)
    stats = ReadStats()
    got = tf.load(hf, process_group=pg, read_stats=stats)
    full = dcp_full_tensors()
    assert all(torch.equal(got[n], full[n]) for n in full) and sorted(got) == sorted(full)
    out["dcp:replicated"] = stats_of(stats)
    state = dcp_state(mesh, False)
    reader = TensorferryReader(ckpt)
    dcp.load(state, storage_reader=reader)
    for n in DCP_SPLITS:
        assert torch.equal(state["model"][n].to_local(), saved["model"][n].to_local()), n
    assert state["optim"]["step"] == 7
    out["dcp:reader"] = stats_of(reader.read_stats)


BIG_TENSORS, BIG_SHAPE = 32, (512, 1024)  # 64 MB of float32


def _status_kb(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6")


def peak_rss_growth(fn):
    """Bytes the process's peak resident set grew by while ``fn`` ran (its result held
    until the peak is read): memory freed earlier is given back first (malloc_trim), and
    the peak reset (/proc/self/clear_refs)."""
    import gc

    gc.collect()
    _libc().malloc_trim(0)
    base = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = fn()
    peak = _status_kb("VmHWM")
    del result
    gc.collect()
    return (peak - base) * 1024


def memory(folder, pg, out):
    """Peak host memory of a replicated load onto the host and onto the emulated device
    (whose memory is host memory too), against a plain tf.load(mmap=False)."""
    import tensorferry as tf

    path = os.path.join(folder, "big.safetensors")
    # Large blocks from their own maps, unmapped when freed (glibc would otherwise raise
    # its threshold and keep freed blocks resident, hiding what a load takes anew).
    M_MMAP_THRESHOLD = -3
    _libc().mallopt(M_MMAP_THRESHOLD, 1 << 16)
    # Warm-up: the staging ring and the allocators' first touches stay out of the measure.
    for device in ("cpu", "emu:0"):
        tf.load(path, process_group=pg, device=device)
    out["memory"] = {
        device: peak_rss_growth(lambda: tf.load(path, process_group=pg, device=device)) for device in ("cpu", "emu:0")
    }
    out["memory"]["plain"] = peak_rss_growth(lambda: tf.load(path, mmap=False))


def composed(folder, pg, out):
    """keys= and dtype= give what tf.load gives with them."""
    import tensorferry as tf

    path = os.path.join(folder, "mixed.safetensors")
    for kwargs in ({"keys": "model.layers.*.w"}, {"dtype": "bfloat16"}, {"keys": ["model.embed", "optim"], "dtype": "float32"}):
        assert_same(tf.load(path, process_group=pg, **kwargs), tf.load(path, **kwargs))
    hf = os.path.join(folder, "hf")
    import torch

    got = tf.load(hf, process_group=pg, shard={"embed.weight": 0}, keys="embed.weight", dtype="float16")
    want = torch.tensor_split(tf.load(hf, keys="embed.weight")["embed.weight"], pg.size(), 0)[pg.rank()].to(torch.float16)
    assert torch.equal(got["embed.weight"], want)


def errors(folder, pg, out, rank):
    """Each failure is raised on every rank alike, and the group stays usable after it."""
    import shutil

    import tensorferry as tf

    tp = os.path.join(folder, "tp.safetensors")
    out["error:no_such_tensor"] = expect_error(lambda: tf.load(tp, process_group=pg, shard={"layers.*.mlp.weight": 0}))
    out["error:uneven"] = expect_error(lambda: tf.load(tp, process_group=pg, shard={"conv.weight": 0}))
    out["error:dim"] = expect_error(lambda: tf.load(tp, process_group=pg, shard={"norm.weight": 1}))
    # One rank's path names no file.
    path = os.path.join(folder, "missing.safetensors") if rank == 1 else tp
    out["error:missing_file"] = expect_error(lambda: tf.load(path, process_group=pg))
    # A sharded checkpoint whose second shard is gone (on every rank: one shared folder).
    broken = os.path.join(folder, f"broken_{pg.size()}")
    if rank == 0:
        shutil.copytree(os.path.join(folder, "hf"), broken)
        os.remove(os.path.join(broken, "model-00002-of-00002.safetensors"))
    import torch.distributed as dist

    dist.barrier(group=pg)
    out["error:missing_shard"] = expect_error(lambda: tf.load(broken, process_group=pg))
    # A shard of another save than its index's.
    out["error:two_saves"] = expect_error(lambda: tf.load(os.path.join(folder, "hf_two_saves"), process_group=pg))
    # The last rank loads another checkpoint than the others.
    last = pg.size() - 1
    path = os.path.join(folder, "other.safetensors" if rank == last else "mixed.safetensors")
    out["error:other_checkpoint"] = expect_error(lambda: tf.load(path, process_group=pg))
    # Still in step: a load after all that works.
    assert_same(tf.load(tp, process_group=pg), tf.load(tp))


def replaced(folder, pg, out, rank):
    """A save replaces the checkpoint while rank 0 still reads it (throttled): every rank
    gets the error, none mixes two saves."""
    import shutil
    import threading

    import tensorferry as tf

    path = os.path.join(folder, f"race_{pg.size()}.safetensors")
    if rank == 0:
        shutil.copy(os.path.join(folder, "mixed.safetensors"), path)
    import torch.distributed as dist

    dist.barrier(group=pg)
    if rank == 0:
        os.environ["TENSORFERRY_FANOUT_READ_MBPS"] = "0.05"
        threading.Timer(0.5, tf.save, (mixed_tree(), path)).start()
    out["error:replaced"] = expect_error(lambda: tf.load(path, process_group=pg))
    os.environ.pop("TENSORFERRY_FANOUT_READ_MBPS", None)


def devices_and_frameworks(folder, pg, out):
    """device= a device that is no PyTorch one (the emulated GPU), and like=."""
    import tensorferry as tf

    path = os.path.join(folder, "mixed.safetensors")
    got = tf.load(path, process_group=pg, device="emu:0")
    want = tf.load(path, device="emu:0")
    assert {type(t) for _, t in leaves(got)} == {type(t) for _, t in leaves(want)}
    devices = [t.device for _, t in leaves(got) if isinstance(t, tf.Tensor)]
    assert devices == [t.device for _, t in leaves(want) if isinstance(t, tf.Tensor)] and set(devices) == {"emu:0"}
    assert_same(tf.to_numpy(got), tf.to_numpy(want))
    assert_same(tf.load(path, process_group=pg, like="numpy"), tf.load(path, like="numpy"))


def killed(folder, pg, out, rank):
    """One rank dies (SIGKILL) while it reads, throttled; the others fail, not hang."""
    import threading

    import tensorferry as tf

    if rank == KILLED_RANK:
        os.environ["TENSORFERRY_FANOUT_READ_MBPS"] = "0.01"
        threading.Timer(KILL_AFTER_S, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    out["error:killed"] = expect_error(lambda: tf.load(os.path.join(folder, "mixed.safetensors"), process_group=pg))
    out["killed_after_s"] = time.monotonic() - start


def object_storage(folder, pg, out, rank, world):
    """The checkpoints uploaded to ``$FANOUT_S3_PREFIX`` (an s3s-fs bucket): each loads as
    ``tf.load(url)`` gives it, each rank reading its part with ranged GETs; ``shard=`` reads
    only the slices' runs; an object replaced while rank 0 reads it fails on every rank."""
    import torch
    import torch.distributed as dist

    import tensorferry as tf
    from tensorferry import _fanout, _native
    from tensorferry.dcp import ReadStats

    prefix = os.environ["FANOUT_S3_PREFIX"]
    for name in ("mixed.safetensors", "tp.safetensors", "hf/", "hf/model.safetensors.index.json", "ts/"):
        url = prefix + name
        stats = ReadStats()
        got = tf.load(url, process_group=pg, read_stats=stats)
        assert_same(got, tf.load(url))
        out[f"s3:{name}"] = stats_of(stats)
    full = tf.load(prefix + "tp.safetensors")
    sliced = [n for n, d in TP_SPLITS.items() if d is not None]
    stats = ReadStats()
    got = tf.load(prefix + "tp.safetensors", process_group=pg, shard=TP_SPEC, keys=sliced, read_stats=stats)
    for n in sliced:
        assert torch.equal(got[n], torch.tensor_split(full[n], world, TP_SPLITS[n])[rank]), n
    out["s3:sharded_only"] = stats_of(stats)
    # Indexes the native reader refuses: refused on every rank, as tf.load refuses them.
    refused = {"index_as_shard": ({}, "x.json"), "save_id_not_a_string": ({"tensorferry.save": 5}, "m.safetensors")}
    for case, (metadata, shard) in refused.items():
        url = prefix + f"{case}_{world}/model.safetensors.index.json"
        if rank == 0:
            _native.put(url, json.dumps({"metadata": metadata, "weight_map": {"w": shard}}).encode())
        dist.barrier(group=pg)
        out[f"error:s3_{case}"] = expect_error(lambda: tf.load(url, process_group=pg))
    # Replaced while rank 0 reads its part: the replacement is written as its read starts.
    url = prefix + f"race_{world}.safetensors"
    if rank == 0:
        with open(os.path.join(folder, "mixed.safetensors"), "rb") as f:
            _native.put(url, f.read())
    dist.barrier(group=pg)
    wait = _fanout._Throttle.wait
    if rank == 0:
        os.environ["TENSORFERRY_FANOUT_READ_MBPS"] = "1000000"

        def replace_then_wait(self, nbytes):
            with open(os.path.join(folder, "tp.safetensors"), "rb") as f:
                _native.put(url, f.read())
            _fanout._Throttle.wait = wait
            wait(self, nbytes)

        _fanout._Throttle.wait = replace_then_wait
    out["error:s3_replaced"] = expect_error(lambda: tf.load(url, process_group=pg))
    _fanout._Throttle.wait = wait
    os.environ.pop("TENSORFERRY_FANOUT_READ_MBPS", None)


def tied(folder, pg):
    """A tensor under two names loads as one, whole or alone (keys=), from one file or shards."""
    import tensorferry as tf

    for name in ("tied.safetensors", "tied"):
        path = os.path.join(folder, name)
        got, want = tf.load(path, process_group=pg), tf.load(path)
        assert_same(got, want)
        assert got["head.weight"] is got["embed.weight"], name
        assert_same(tf.load(path, process_group=pg, keys="head.weight"), tf.load(path, keys="head.weight"))


def scenario_s3(rank, world, folder, pg, out):
    object_storage(folder, pg, out, rank, world)


def scenario_four(rank, world, folder, pg, out):
    replicated(folder, pg, out)
    sharded(folder, pg, out, rank, world)
    direct(folder, pg, out, rank, world)
    dcp_interplay(folder, pg, out, rank, world)
    memory(folder, pg, out)
    composed(folder, pg, out)
    errors(folder, pg, out, rank)
    save(folder, "four", rank, out)
    killed(folder, pg, out, rank)


def scenario_two(rank, world, folder, pg, out):
    replicated(folder, pg, out)
    sharded(folder, pg, out, rank, world)
    direct(folder, pg, out, rank, world)
    dcp_interplay(folder, pg, out, rank, world)
    memory(folder, pg, out)
    composed(folder, pg, out)
    devices_and_frameworks(folder, pg, out)
    tied(folder, pg)
    errors(folder, pg, out, rank)
    replaced(folder, pg, out, rank)


def save(folder, scenario, rank, out):
    with open(os.path.join(folder, "results", f"{scenario}_{rank}.json"), "w") as f:
        json.dump(out, f)


def main():
    scenario, rank, world, port, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    out = {}
    globals()[f"scenario_{scenario}"](rank, world, folder, dist.group.WORLD, out)
    save(folder, scenario, rank, out)
    # A rank of a group that lost a member cannot tear it down cleanly: leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
