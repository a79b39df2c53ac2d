#!/usr/bin/env python3
"""Soak test: several threads move, convert, save and load random nested tensor trees
through the emulated devices while a chaos thread injects faults, for a bounded time.

Every result must be exactly right (values bit for bit, dtype, shape, structure, the very
same non-tensor leaves) or a ``tf.TensorferryError``: never wrong data, never another
exception, never a hang. Fault settings are process-global per emulated device, so a
fault armed by the chaos thread may hit any thread's copy: that is expected, and must
surface as an error there too. A watchdog dumps every thread's stack and exits non-zero
when a thread makes no progress for ``--watchdog`` seconds.

    python scripts/soak.py --seconds 120 --threads 4 --seed 1

The last line is a one-line summary; the exit status is 0 only when no result was wrong,
no unexpected exception was raised, no temporary file was left behind and nothing hung.
Needs NumPy and tensorferry; PyTorch leaves are mixed in when PyTorch is importable
(``--no-torch`` leaves them out). Checkpoints are saved one file or sharded, each worker's
own and one all of them share, and (with PyTorch) as DCP checkpoints; with
``TENSORFERRY_CLI`` naming the ``tensorferry`` command, workers also inspect their files
with it.
"""

import argparse
import collections
import faulthandler
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping

import numpy as np

import tensorferry as tf

DEVICES = ("emu:0", "emu:1")
DTYPES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64",
)  # fmt: skip
TORCH_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")
STAGING = ("auto", "off", "on", (4096, 2), (65536, 3))
EXIT_FAILED, EXIT_HUNG = 1, 3

Pair = collections.namedtuple("Pair", "first second")


class Wrong(Exception):
    """A result that is neither right nor an error: the finding this script looks for."""


# -- the record of what happened ----------------------------------------------------------
class Record:
    """Counts shared by all threads: operations, errors by kind, faults armed, findings."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ops = collections.Counter()
        self.failed = collections.Counter()  # operations that ended in an error, by name
        self.ok = 0
        self.errors = collections.Counter()  # (exception class, cause) -> count
        self.armed = collections.Counter()  # chaos settings applied, by kind
        self.wrong = []
        self.unexpected = []
        self.unexplained = []  # tensorferry errors with no injected cause: shown, not failed

    def done(self, op):
        with self.lock:
            self.ops[op] += 1
            self.ok += 1

    def error(self, op, e):
        cause = cause_of(e)
        with self.lock:
            self.ops[op] += 1
            self.failed[op] += 1
            self.errors[(type(e).__name__, cause)] += 1
            if cause == "other" and len(self.unexplained) < 5:
                self.unexplained.append(f"{op}: {type(e).__name__}: {e}")

    def finding(self, kind, op, text):
        with self.lock:
            self.ops[op] += 1
            (self.wrong if kind == "wrong" else self.unexpected).append(f"{op}: {text}")

    def faults_seen(self):
        return sum(n for (_, cause), n in self.errors.items() if cause in ("copy", "alloc", "panic"))

    def by_operation(self):
        return "soak: operations (errors): " + " ".join(
            f"{op}={n}({self.failed[op]})" for op, n in sorted(self.ops.items())
        )

    def summary(self, seconds, args, leftovers, status):
        errors = " ".join(f"{cls}/{cause}={n}" for (cls, cause), n in sorted(self.errors.items()))
        armed = " ".join(f"{k}={n}" for k, n in sorted(self.armed.items()))
        return (
            f"soak: {status} seconds={seconds:.1f} threads={args.threads} seed={args.seed} "
            f"ops={sum(self.ops.values())} ok={self.ok} errors={sum(self.errors.values())} "
            f"[{errors}] armed=[{armed}] faults_seen={self.faults_seen()} "
            f"wrong={len(self.wrong)} unexpected={len(self.unexpected)} leftover_files={leftovers}"
        )


def cause_of(e):
    """Which injected fault an error comes from, judged by its type and message; "clash"
    for the refusal to save keys "a.b" and "a"/"b" side by side, which the trees make on
    purpose."""
    text = str(e)
    if "both map to the tensor name" in text:
        return "clash"
    if "injected fault" in text:
        return "copy"
    if "injected panic" in text:
        return "panic"
    if isinstance(e, tf.OutOfMemoryError):
        return "alloc"
    return "other"


# -- random trees ------------------------------------------------------------------------
def fill(npr, dtype, shape):
    """Random values of ``dtype``: the whole integer range, floats with NaN and infinities."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.asarray(npr.random(shape) < 0.5)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.asarray(npr.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True))
    if dt.kind == "c":
        return np.asarray(npr.standard_normal(shape) + 1j * npr.standard_normal(shape), dtype=dt)
    arr = np.asarray(npr.standard_normal(shape) * 100, dtype=dt)
    if arr.size and npr.random() < 0.2:
        arr.flat[npr.integers(arr.size)] = npr.choice([np.nan, np.inf, -np.inf, -0.0])
    return arr


def random_array(rng, npr, big):
    dtype = rng.choice(DTYPES)
    if big:
        shape = (rng.randint(50_000, 400_000),)
    else:
        shape = tuple(rng.choice((0, 1, 2, 3, 5, 8, 17, 64)) for _ in range(rng.choice((0, 1, 1, 2, 2, 3))))
    if len(shape) >= 1 and rng.random() < 0.25:
        # A view that is not contiguous: every other element of the last axis, or a transpose.
        if len(shape) >= 2 and rng.random() < 0.5:
            return fill(npr, dtype, shape[::-1]).T
        return fill(npr, dtype, shape[:-1] + (shape[-1] * 2,))[..., ::2]
    return fill(npr, dtype, shape)


def random_key(rng, taken):
    while True:
        key = rng.choice(("w", "bias", "layer.0.weight", "a.b", "a", "b", "x" * rng.randint(1, 40), "ü", ""))
        key = key if rng.random() < 0.5 else f"{key}{rng.randint(0, 99)}"
        if key not in taken:
            return key


def random_plain(rng, in_sequence):
    """A leaf that is not a tensor. Numbers only in mappings: a list or tuple of numbers
    is data that to_device makes a tensor of."""
    if in_sequence:
        return rng.choice((None, "run-1", "", "ü∂", ("adam", rng.random())))
    return rng.choice(
        (
            lambda: rng.randint(-(2**63), 2**63 - 1),
            lambda: rng.choice((0.5, float("nan"), float("inf"), -0.0, 1e300)),
            lambda: rng.choice((True, False, None)),
            lambda: rng.choice(("run-1", "", "ü∂", "x" * 300)),
            lambda: ("adam", rng.random()),
        )
    )()


class Trees:
    """Random trees for one worker, with the values each tensor leaf must keep."""

    def __init__(self, seed, worker, torch):
        self.rng = random.Random(f"{seed}/{worker}")
        self.npr = np.random.default_rng([seed, worker])
        self.torch = torch

    def leaf(self, big, in_sequence):
        rng = self.rng
        if rng.random() < 0.25:
            return random_plain(rng, in_sequence)
        if self.torch is not None and rng.random() < 0.15:
            dtype = rng.choice(TORCH_DTYPES)
            shape = tuple(rng.choice((0, 1, 3, 8)) for _ in range(rng.choice((0, 1, 2))))
            return self.torch.from_numpy(np.ascontiguousarray(fill(self.npr, dtype, shape)))
        return random_array(rng, self.npr, big)

    def node(self, depth, big, in_sequence=False):
        rng = self.rng
        if depth >= 4 or rng.random() < 0.45:
            return self.leaf(big and rng.random() < 0.3, in_sequence)
        n = rng.randint(0, 4)
        kind = rng.choice(("dict", "dict", "dict", "ordered", "default", "list", "tuple", "pair"))
        if kind == "pair":
            return Pair(self.node(depth + 1, big, True), self.node(depth + 1, big, True))
        if kind in ("list", "tuple"):
            items = [self.node(depth + 1, big, True) for _ in range(n)]
            return items if kind == "list" else tuple(items)
        return self.mapping(kind, n, depth, big)

    def mapping(self, kind, n, depth, big):
        d = {"dict": dict, "ordered": collections.OrderedDict}.get(kind)
        d = d() if d else collections.defaultdict(list)
        for _ in range(n):
            d[random_key(self.rng, d)] = self.node(depth + 1, big)
        return d

    def tree(self):
        """A dict root with at least one tensor; now and then one of a few megabytes."""
        big = self.rng.random() < 0.05
        root = self.mapping("dict", self.rng.randint(1, 6), 0, big)
        root[random_key(self.rng, root)] = random_array(self.rng, self.npr, big)
        return root


def is_tensor(x):
    return isinstance(x, (np.ndarray, tf.Tensor)) or type(x).__module__.startswith("torch")


def tensors_of(tree):
    """The tensor leaves of ``tree``, in walk order."""
    out, stack = [], [tree]
    while stack:
        x = stack.pop()
        if is_tensor(x):
            out.append(x)
        elif isinstance(x, Mapping):
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
    return out


def expected_values(tree):
    """``{id(leaf): contiguous NumPy copy}`` of every tensor leaf: what results must hold."""
    out = {}
    for t in tensors_of(tree):
        arr = t.numpy() if not isinstance(t, np.ndarray) else t
        out[id(t)] = np.array(arr, copy=True, order="C")
    return out


# -- checks ------------------------------------------------------------------------------
def host_array(x, path, numpy_only):
    """A host result leaf as NumPy (PyTorch and tensorferry host tensors accepted unless
    ``numpy_only``). Reading a tensor whose copy failed raises that copy's error."""
    if isinstance(x, np.ndarray):
        return x
    if numpy_only:
        raise Wrong(f"{path}: a {type(x).__name__} where to_numpy must give numpy.ndarray")
    if isinstance(x, tf.Tensor):
        if x.device != "cpu":
            raise Wrong(f"{path}: on {x.device}, expected the host")
        return x.numpy()
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise Wrong(f"{path}: torch tensor on {x.device}, expected the host")
        return x.numpy()
    raise Wrong(f"{path}: a {type(x).__name__} where a tensor was expected")


def same_array(got, want, path):
    native = want.dtype.newbyteorder("=")
    if got.dtype != native:
        raise Wrong(f"{path}: dtype {got.dtype}, expected {native}")
    if got.shape != want.shape:
        raise Wrong(f"{path}: shape {got.shape}, expected {want.shape}")
    a, b = np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want.astype(native)).view(np.uint8)
    if a.tobytes() != b.tobytes():
        bad = int(np.count_nonzero(a.reshape(-1) != b.reshape(-1)))
        raise Wrong(f"{path}: {bad} of {a.size} bytes differ ({got.dtype}{list(got.shape)})")


def same_plain(got, want, path):
    if type(got) is not type(want):
        raise Wrong(f"{path}: {type(got).__name__} {got!r:.60}, expected {type(want).__name__} {want!r:.60}")
    if isinstance(want, float) and want != want:
        if got == got:
            raise Wrong(f"{path}: {got!r}, expected nan")
    elif got != want or (isinstance(want, float) and str(got) != str(want)):
        raise Wrong(f"{path}: {got!r:.60}, expected {want!r:.60}")


def check(got, src, values, *, plain=False, numpy_only=False, path="root"):
    """Raises :class:`Wrong` unless ``got`` is ``src`` moved: same structure and keys in
    order, tensor leaves holding ``values``, other leaves the very same objects (equal
    ones of the same type after a save and load, with ``plain`` containers)."""
    if is_tensor(src):
        same_array(host_array(got, path, numpy_only), values[id(src)], path)
    elif isinstance(src, Mapping):
        want = dict if plain else type(src)
        if type(got) is not want:
            raise Wrong(f"{path}: a {type(got).__name__}, expected {want.__name__}")
        if list(got.keys()) != list(src.keys()):
            raise Wrong(f"{path}: keys {list(got.keys())!r:.200}, expected {list(src.keys())!r:.200}")
        for k in src:
            check(got[k], src[k], values, plain=plain, numpy_only=numpy_only, path=f"{path}/{k}")
    elif isinstance(src, (list, tuple)):
        want = (list if isinstance(src, list) else tuple) if plain else type(src)
        if type(got) is not want or len(got) != len(src):
            raise Wrong(f"{path}: a {type(got).__name__} of {len(got)}, expected {want.__name__} of {len(src)}")
        for i, (g, s) in enumerate(zip(got, src)):
            check(g, s, values, plain=plain, numpy_only=numpy_only, path=f"{path}/{i}")
    elif plain:
        same_plain(got, src, path)
    elif got is not src:
        raise Wrong(f"{path}: {got!r:.60} is not the very same object as the source's {src!r:.60}")


def check_devices(tree, device):
    for t in tensors_of(tree):
        if not isinstance(t, tf.Tensor) or t.device != device:
            raise Wrong(f"a {type(t).__name__} on {getattr(t, 'device', '?')} where {device} was asked")


def settled(x):
    """The structure of a non-blocking call: its Transfer's result, at once or after a
    moment (the copies may still run; the result waits for them, and so does every read)."""
    if isinstance(x, tf.Transfer):
        if random.random() < 0.3:
            time.sleep(random.random() / 1000)
        return x.result()
    return x


def check_source_intact(src, values):
    for t in tensors_of(src):
        arr = t if isinstance(t, np.ndarray) else t.numpy()
        same_array(arr, values[id(t)], "source (modified by the operation)")


def wait_outcomes(tree):
    """For each tensorferry tensor in ``tree``: did its own copy succeed (``wait()``)?"""
    out = []
    for t in tensors_of(tree):
        if isinstance(t, tf.Tensor):
            try:
                t.wait()
                out.append(True)
            except tf.TensorferryError:
                out.append(False)
    return tuple(out)


# -- one worker --------------------------------------------------------------------------
class Worker:
    """One thread's loop of random operations; each ends right, or as an error."""

    def __init__(self, index, args, record, folder, torch, deadline, progress):
        self.index = index
        self.trees = Trees(args.seed, index, torch)
        self.rng = self.trees.rng
        self.record = record
        self.path = os.path.join(folder, f"w{index}.safetensors")
        self.saved = None  # (src, values) of the file at self.path
        self.checkpoint = os.path.join(folder, f"checkpoint-{index}")  # sharded or not
        self.checkpoint_saved = None
        self.shared = os.path.join(folder, "shared")  # one checkpoint every worker saves
        self.dcp = os.path.join(folder, f"dcp-{index}")  # a PyTorch DCP checkpoint
        self.held = []  # results kept to read again later: (src, values, result, where, outcomes)
        self.deadline = deadline
        self.progress = progress
        self.ops = {
            "to_device": (self.op_to_device, 4),
            "to_host": (self.op_to_host, 4),
            "device_to_device": (self.op_device_to_device, 1),
            "mixed_to_host": (self.op_mixed_to_host, 1),
            "save_load": (self.op_save_load, 3),
            "tensordict": (self.op_tensordict, 2),
            "reread": (self.op_reread, 2),
            "checkpoint": (self.op_checkpoint, 2),
            "shared_checkpoint": (self.op_shared_checkpoint, 2),
            "cli": (self.op_cli, 1),
            "dcp": (self.op_dcp, 1),
        }
        self.names = list(self.ops)
        self.weights = [w for _, w in self.ops.values()]

    def device(self):
        return self.rng.choice(DEVICES)

    def hold(self, src, values, result, where):
        """Keeps a result to read later: what its copies did must not change, and values
        read must still be right (a pinned buffer reused too early would show here)."""
        self.held.append((src, values, result, where, wait_outcomes(result)))
        if len(self.held) > 4:
            self.held.pop(0)

    def run(self):
        while time.monotonic() < self.deadline:
            name = self.rng.choices(self.names, self.weights)[0]
            self.progress[self.index] = time.monotonic()
            try:
                self.ops[name][0]()
                self.record.done(name)
            except Wrong as w:
                self.record.finding("wrong", name, str(w))
            except tf.TensorferryError as e:
                self.record.error(name, e)
            except Exception:
                self.record.finding("unexpected", name, traceback.format_exc())
            self.progress[self.index] = time.monotonic()
        self.progress[self.index] = None

    def checked(self, src, values, fn):
        """Runs ``fn``; whatever it ends with, the source must be as it was."""
        try:
            return fn()
        finally:
            check_source_intact(src, values)

    def op_to_device(self):
        src = self.trees.tree()
        values = expected_values(src)
        dev, nb = self.device(), self.rng.random() < 0.5
        staging = self.rng.choice(STAGING)
        there = self.checked(src, values, lambda: settled(tf.to_device(src, dev, non_blocking=nb, staging=staging)))
        check_devices(there, dev)
        if self.rng.random() < 0.3:
            self.hold(src, values, there, dev)
        check(self.checked(src, values, lambda: tf.to_numpy(there)), src, values, numpy_only=True)

    def op_to_host(self):
        src = self.trees.tree()
        values = expected_values(src)
        there = settled(tf.to_device(src, self.device(), non_blocking=self.rng.random() < 0.5))
        opts = dict(
            non_blocking=self.rng.random() < 0.5,
            copy=self.rng.random() < 0.3,
            pinned=self.rng.random() < 0.4,
            staging=self.rng.choice(STAGING),
        )
        back = settled(tf.to_host(there, **opts))
        if opts["pinned"] and self.rng.random() < 0.3:
            self.hold(src, values, back, "cpu")
        if self.rng.random() < 0.2:
            time.sleep(self.rng.random() / 500)  # let other threads reuse what they can
        check(back, src, values)

    def op_device_to_device(self):
        src = self.trees.tree()
        values = expected_values(src)
        first, second = self.rng.sample(DEVICES, 2)
        there = settled(tf.to_device(settled(tf.to_device(src, first, non_blocking=True)), second, non_blocking=True))
        check_devices(there, second)
        check(tf.to_numpy(there), src, values, numpy_only=True)

    def op_mixed_to_host(self):
        parts = [self.trees.tree() for _ in range(3)]
        values = {}
        for p in parts:
            values.update(expected_values(p))
        src = {"a": parts[0], "b": parts[1], "c": parts[2]}
        moved = {
            "a": settled(tf.to_device(parts[0], "emu:0", non_blocking=True)),
            "b": settled(tf.to_device(parts[1], "emu:1", non_blocking=True)),
            "c": parts[2],
        }
        check(tf.to_numpy(settled(tf.to_host(moved, non_blocking=self.rng.random() < 0.5))), src, values, numpy_only=True)

    def op_save_load(self):
        src = self.trees.tree()
        values = expected_values(src)
        what = self.rng.choice(("host", "device", "pending_host"))
        tree = src
        if what == "device":
            tree = settled(tf.to_device(src, self.device(), non_blocking=self.rng.random() < 0.5))
        elif what == "pending_host":
            # Results of a non-blocking copy home, saved before they are known to be good.
            there = tf.to_device(src, self.device())
            tree = settled(tf.to_host(there, non_blocking=True, copy=True))
        try:
            self.checked(src, values, lambda: tf.save(tree, self.path, fsync=self.rng.random() < 0.1))
        except tf.TensorferryError:
            self.check_previous_file()
            raise
        self.saved = (src, values)
        device = self.rng.choice(("cpu", "cpu") + DEVICES)
        loaded = tf.load(self.path, mmap=self.rng.random() < 0.5, device=device)
        if device != "cpu":
            check_devices(loaded, device)
            loaded = tf.to_numpy(loaded)
        check(loaded, src, values, plain=True)

    def op_checkpoint(self):
        """A save switching at random between one file and shards of random size, over
        this worker's previous checkpoint; after a failure the previous one loads whole."""
        src = self.trees.tree()
        values = expected_values(src)
        tree = src
        if self.rng.random() < 0.5:
            tree = settled(tf.to_device(src, self.device(), non_blocking=self.rng.random() < 0.5))
        shard = self.rng.choice((None, 64, 1024, 1 << 16))
        try:
            self.checked(
                src, values, lambda: tf.save(tree, self.checkpoint + "/", max_shard_size=shard, fsync=False)
            )
        except tf.TensorferryError:
            self.check_previous_file(self.checkpoint, self.checkpoint_saved)
            raise
        self.checkpoint_saved = (src, values)
        check(tf.load(self.checkpoint, mmap=self.rng.random() < 0.5), src, values, plain=True)

    def op_shared_checkpoint(self):
        """Every worker saves stamped trees (every value the stamp) into one checkpoint, one
        file or shards, blocking or not; any load of it gives one whole save: one stamp,
        or an error while another save replaces it, never a mix."""
        stamp = self.rng.randrange(1, 1 << 30)
        tree = {
            "stamp": stamp,
            "t": {f"x{i}": np.full(self.rng.randrange(1, 3000), stamp, np.int64) for i in range(self.rng.randrange(1, 12))},
        }
        shard = self.rng.choice((None, 512, 8192))
        pending = tf.save(tree, self.shared + "/", max_shard_size=shard, fsync=False, non_blocking=self.rng.random() < 0.3)
        if pending is not None:
            pending.result()
        loaded = tf.load(self.shared, mmap=self.rng.random() < 0.5)
        stamps = {int(loaded["stamp"])} | {int(v) for a in loaded["t"].values() for v in np.unique(a)}
        if len(stamps) != 1:
            raise Wrong(f"the shared checkpoint loads as a mix of saves: stamps {sorted(stamps)[:5]}")

    def op_dcp(self):
        """A PyTorch DCP save through tensorferry's storage layer (one process), over this
        worker's previous one, then a load into fresh tensors: the values just saved."""
        torch = self.trees.torch
        if torch is None:
            return
        import torch.distributed.checkpoint as dcp

        from tensorferry.dcp import TensorferryReader, TensorferryWriter

        stamp = self.rng.randrange(1, 1 << 20)
        state = {f"w{i}": torch.full((self.rng.randrange(1, 5000),), stamp) for i in range(self.rng.randrange(1, 6))}
        state["step"] = stamp
        dcp.save(state, storage_writer=TensorferryWriter(self.dcp, sync_files=False), no_dist=True)
        target = {k: (torch.zeros_like(v) if torch.is_tensor(v) else 0) for k, v in state.items()}
        dcp.load(target, storage_reader=TensorferryReader(self.dcp), no_dist=True)
        for k, v in state.items():
            same = torch.equal(target[k], v) if torch.is_tensor(v) else target[k] == v
            if not same:
                raise Wrong(f"a DCP checkpoint loads {k} other than it was saved")

    def op_cli(self):
        """`tensorferry inspect` of this worker's file: status 0, or 1 with one line when a
        save replaced it in between; never a crash."""
        cli = os.environ.get("TENSORFERRY_CLI")
        if not cli or not os.path.exists(self.path):
            return
        run = subprocess.run([cli, "inspect", self.path, *(("--json",) if self.rng.random() < 0.5 else ())],
                             capture_output=True, timeout=30)
        if run.returncode not in (0, 1) or (run.returncode == 1 and len(run.stderr.splitlines()) != 1):
            raise Wrong(f"tensorferry inspect ended with status {run.returncode}: {run.stderr[-500:]!r}")

    def check_previous_file(self, path=None, saved=None):
        """After a failed save, the file there before must be intact and load right."""
        if path is None:
            path, saved = self.path, self.saved
        if saved is None:
            if os.path.exists(path) and not os.path.isdir(path):
                raise Wrong(f"a failed first save left a file at {path}")
            return
        src, values = saved
        try:
            loaded = tf.load(path, mmap=self.rng.random() < 0.5)
        except tf.TensorferryError as e:
            raise Wrong(f"after a failed save the previous file does not load: {type(e).__name__}: {e}") from None
        try:
            check(loaded, src, values, plain=True)
        except Wrong as w:
            raise Wrong(f"after a failed save the previous file changed: {w}") from None

    def op_tensordict(self):
        src = self.trees.tree()
        values = expected_values(src)
        dev = self.device()
        td = settled(tf.TensorDict(src).to(dev, non_blocking=self.rng.random() < 0.5))
        if td.device != dev:
            raise Wrong(f"TensorDict.to({dev!r}).device is {td.device!r}")
        if self.rng.random() < 0.5:
            if td.wait() is not td or not td.is_ready():
                raise Wrong("TensorDict.wait() returned but is_ready() is false")
        back = settled(td.cpu(non_blocking=self.rng.random() < 0.5, pinned=self.rng.random() < 0.3))
        check(back.numpy(), src, values, numpy_only=True)

    def op_reread(self):
        if not self.held:
            return
        src, values, result, where, outcomes = self.rng.choice(self.held)
        again = wait_outcomes(result)
        if again != outcomes:
            raise Wrong(f"the copies of a held result on {where} changed outcome: {outcomes} then {again}")
        if where == "cpu":
            check(result, src, values)
        else:
            check(tf.to_numpy(result), src, values, numpy_only=True)


# -- chaos, watchdog, main ---------------------------------------------------------------
def chaos(args, record, stop, progress, slot):
    """Now and then rearms a fault or changes the speed of one emulated device."""
    rng = random.Random(f"{args.seed}/chaos")
    while not stop.wait(rng.uniform(0.005, 0.08)):
        progress[slot] = time.monotonic()
        index = rng.randrange(len(DEVICES))
        settings = {}
        if rng.random() < 0.5:
            settings["latency_us"] = rng.choice((0, 20, 200, 1000, 5000))
        if rng.random() < 0.2:
            settings["bandwidth_gbps"] = rng.choice((0.5, 5, 50))
        fault = rng.random()
        if fault < 0.45:
            settings["fail_copy"] = rng.randint(1, 6)
        elif fault < 0.75:
            settings["fail_alloc"] = rng.randint(1, 6)
        elif fault < 0.8 and args.panics:
            settings["panic_copy"] = rng.randint(1, 6)
        tf.configure_emulated(index, **settings)
        with record.lock:
            for key in settings or ("reset",):
                record.armed[key] += 1
    progress[slot] = None


def watchdog(args, progress, record, started, stop_watch):
    """Exits the process with every thread's stack when one makes no progress."""
    while not stop_watch.wait(1.0):
        now = time.monotonic()
        for slot, last in list(progress.items()):
            if last is not None and now - last > args.watchdog:
                hang(f"thread {slot} made no progress for {now - last:.0f} s", args, record, started)


def hang(why, args, record, started):
    sys.stderr.write(f"soak: HANG: {why}; the stacks of every thread:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    report(record)
    print(record.summary(time.monotonic() - started, args, "?", "HANG"), flush=True)
    os._exit(EXIT_HUNG)


def report(record):
    for title, items in (("WRONG", record.wrong), ("UNEXPECTED", record.unexpected)):
        for text in items[:10]:
            sys.stderr.write(f"soak: {title}: {text}\n")
    for text in record.unexplained:
        sys.stderr.write(f"soak: note: error with no injected cause: {text}\n")
    sys.stderr.flush()


def final_check(record):
    """Once the faults stop, each device must move data right again."""
    src = {"w": np.arange(1000, dtype=np.float32) * 0.5}
    for dev in DEVICES:
        tf.configure_emulated(int(dev[-1]))
        try:
            back = tf.to_numpy(tf.to_host(tf.to_device(src, dev)))
            same_array(back["w"], src["w"], f"{dev} after the soak")
        except Exception:
            record.finding("unexpected", "final_check", f"{dev}: {traceback.format_exc()}")


def leftover_files(folder):
    """Files no checkpoint names: temporary files of failed saves, shards of saves that
    did not commit, files of an earlier layout."""
    left = []
    for name in os.listdir(folder):
        inner = os.path.join(folder, name)
        if os.path.isdir(inner) and name.startswith("dcp-"):
            # A DCP checkpoint: its metadata, and the rank files of the last save.
            left += [f"{name}/{f}" for f in os.listdir(inner) if not (f == ".metadata" or f.endswith(".safetensors"))]
        elif os.path.isdir(inner):
            index = os.path.join(inner, "model.safetensors.index.json")
            named = {"model.safetensors.index.json"}
            if os.path.exists(index):
                with open(index) as f:
                    named |= set(json.load(f)["weight_map"].values())
            else:
                named = {"model.safetensors"}
            left += [f"{name}/{f}" for f in os.listdir(inner) if f not in named]
        elif not (name.startswith("w") and name.endswith(".safetensors")):
            left.append(name)
    return sorted(left)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="how long the threads run")
    p.add_argument("--threads", type=int, default=4, help="worker threads")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    p.add_argument("--watchdog", type=float, default=30.0, help="seconds without progress that count as a hang")
    p.add_argument("--panics", action="store_true", help="also inject panics on the device stream threads")
    p.add_argument("--no-torch", action="store_true", help="leave PyTorch tensors out even when importable")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    faulthandler.enable()
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            pass
    for dev in DEVICES:
        tf.configure_emulated(int(dev[-1]))
    record = Record()
    folder = tempfile.mkdtemp(prefix="tensorferry-soak-")
    started = time.monotonic()
    deadline = started + args.seconds
    progress = {}
    stop, stop_watch = threading.Event(), threading.Event()
    workers = [Worker(i, args, record, folder, torch, deadline, progress) for i in range(args.threads)]
    threads = [threading.Thread(target=w.run, name=f"worker-{w.index}", daemon=True) for w in workers]
    threads.append(threading.Thread(target=chaos, args=(args, record, stop, progress, "chaos"), daemon=True))
    for slot in [w.index for w in workers] + ["chaos"]:
        progress[slot] = time.monotonic()
    dog = threading.Thread(target=watchdog, args=(args, progress, record, started, stop_watch), daemon=True)
    dog.start()
    for t in threads:
        t.start()
    while time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    stop.set()
    for t in threads:
        t.join(timeout=max(0.0, deadline + args.watchdog - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        hang(f"threads still running {args.watchdog:.0f} s after the deadline: {alive}", args, record, started)
    stop_watch.set()
    final_check(record)
    leftovers = leftover_files(folder)
    shutil.rmtree(folder, ignore_errors=True)
    report(record)
    if leftovers:
        sys.stderr.write(f"soak: files left behind by failed saves: {leftovers[:10]}\n")
    failed = record.wrong or record.unexpected or leftovers
    print(record.by_operation())
    print(record.summary(time.monotonic() - started, args, len(leftovers), "FAIL" if failed else "PASS"), flush=True)
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
