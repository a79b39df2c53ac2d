"""Per-leaf cost of tensorferry's Python calls on dictionaries of many small tensors.

    python bench/python_leaf_floor.py [--count 20000] [--repeat 7] [--faults] [--warm-heap]

Issue 11's Python rows, each beside the loop it replaces, in one run: ``to_numpy`` of NumPy
and of tensorferry leaves, ``load(mmap=True)`` to NumPy, ``to_numpy`` of PyTorch CPU tensors
against ``{k: v.numpy()}`` (issue 24's guard rail), ``to_host(copy=True)`` and
``to_device(..., "cpu", copy=True)`` of PyTorch CPU tensors (in a dict, and in a module's
``state_dict()``, an ``OrderedDict``) against ``{k: v.clone()}``, and
``to_host(copy=True)`` of NumPy leaves against ``{k: v.copy()}``, and ``save`` and
``load(like="torch")`` of PyTorch tensors against ``safetensors.torch``'s ``save_file`` and
``load_file``; PyTorch tensors to the emulated device ``emu:0`` and back. Every leaf is 1,024
float32 (4 KiB). Prints the best of ``--repeat`` runs in microseconds per leaf, and the
ratio to the loop (how many times faster tensorferry is); with ``--faults``, the minor page
faults of each row per leaf and run (fresh memory's first touch, which costs more than
copying 4 KiB on a VM, and how much of it a row pays depends on the allocator's state). On
a GPU machine it adds CUDA PyTorch tensors to the host and back.

The loops' figures depend on the C allocator's state: glibc, by default, gives freed memory
at the top of its heap back to the system, so a loop whose 4 KiB results were freed by the
run before touches fresh pages again (about one page fault a leaf); once the process has
freed a block of a few MiB, glibc raises its thresholds and keeps such memory, and the same
loop runs without faults. ``--warm-heap`` raises those thresholds (``mallopt``) before any
row, so that every row, tensorferry's and the loops', runs on a heap that keeps its memory:
the loops' best case.
"""

import argparse
import itertools
import os
import platform
import tempfile
import time

import numpy as np

try:
    import resource  # page fault counts (not on Windows)
except ImportError:
    resource = None

import tensorferry as tf


CLOCK = time.perf_counter


def best(fn, repeat, setup=None):
    """The best time of ``repeat`` runs, and the minor page faults per run (the first
    touch of fresh memory: the allocator's state decides how many a row pays)."""
    times = []
    minflt = (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt) if resource else (lambda: 0)
    faults = minflt()
    for _ in range(repeat):
        if setup is not None:
            setup()  # untimed
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return min(times), (minflt() - faults) / repeat


def warm_heap():
    """Makes glibc keep freed memory: no trimming of the heap's top, and blocks of up to
    32 MiB (its limit) from the heap instead of their own maps (what it does by itself
    after a process frees a large block)."""
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20)):
        raise SystemExit("mallopt refused: --warm-heap needs glibc")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time (a busy machine)")
    ap.add_argument("--faults", action="store_true", help="also print minor page faults per leaf and run")
    ap.add_argument("--warm-heap", action="store_true", help="keep freed memory in the C heap (glibc mallopt)")
    args = ap.parse_args()
    if args.warm_heap:
        warm_heap()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    n, r = args.count, args.repeat
    rows = []

    def row(name, fn, peer_name=None, peer=None, setup=None):
        t = best(fn, r, setup)
        p = best(peer, r, setup) if peer else None
        rows.append((name, t, peer_name, p))

    arrays = {f"t{i}": np.full(1024, i, np.float32) for i in range(n)}
    natives = {k: tf.Tensor.from_numpy(v) for k, v in arrays.items()}
    row("to_numpy, NumPy leaves", lambda: tf.to_numpy(arrays))
    row("to_numpy, tensorferry leaves", lambda: tf.to_numpy(natives))
    row("to_host(copy=True), NumPy", lambda: tf.to_host(arrays, copy=True),
        "{k: v.copy()}", lambda: {k: v.copy() for k, v in arrays.items()})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "many.safetensors")
        tf.save(arrays, path)
        row("load(mmap=True) -> to_numpy", lambda: tf.to_numpy(tf.load(path)))
    if not args.no_torch:
        import torch

        tensors = {f"t{i}": torch.full((1024,), float(i)) for i in range(n)}
        clone = lambda: {k: v.clone() for k, v in tensors.items()}  # noqa: E731
        row("to_numpy, torch CPU", lambda: tf.to_numpy(tensors), "{k: v.numpy()}",
            lambda: {k: v.numpy() for k, v in tensors.items()})
        row("to_host(copy=True), torch CPU", lambda: tf.to_host(tensors, copy=True), "{k: v.clone()}", clone)
        row("to_device(cpu, copy=True), torch CPU", lambda: tf.to_device(tensors, "cpu", copy=True),
            "{k: v.clone()}", clone)
        # What modules hand out: an OrderedDict (with its _metadata) of detached tensors.
        params = torch.nn.ParameterList(torch.nn.Parameter(v.clone()) for v in tensors.values())
        sd = params.state_dict()
        row("to_host(copy=True), torch state_dict()", lambda: tf.to_host(sd, copy=True), "{k: v.clone()}",
            lambda: {k: v.clone() for k, v in sd.items()})
        with tempfile.TemporaryDirectory() as d:
            # Each save writes a new file (replacing one would time the old one's removal),
            # and the one before is removed first, untimed.
            names = (os.path.join(d, f"save{i}.safetensors") for i in itertools.count())
            from safetensors.torch import save_file

            def clear():
                for name in os.listdir(d):
                    os.remove(os.path.join(d, name))

            row("save(fsync=False), torch CPU", lambda: tf.save(tensors, next(names), fsync=False),
                "safetensors save_file", lambda: save_file(tensors, next(names)), clear)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "many.safetensors")
            tf.save(tensors, path)
            from safetensors.torch import load_file

            row("load(like='torch')", lambda: tf.load(path, like="torch"), "safetensors load_file",
                lambda: load_file(path))
        # The emulated device (no GPU needed): the same dictionaries there and back.
        row("to_device(emu:0), torch CPU", lambda: tf.to_device(tensors, "emu:0"))
        on_emu = tf.to_device(tensors, "emu:0")
        row("to_host of emu:0 tensors", lambda: tf.to_host(on_emu))
        row("to_numpy of emu:0 tensors", lambda: tf.to_numpy(on_emu))
        if torch.cuda.is_available() and "cuda:0" in tf.devices():
            g = {k: v.cuda() for k, v in tensors.items()}
            torch.cuda.synchronize()
            row("to_host, torch CUDA", lambda: tf.to_host(g), "{k: v.cpu()}", lambda: {k: v.cpu() for k, v in g.items()})
            row("to_device(cuda:0), torch CPU", lambda: (tf.to_device(tensors, "cuda:0"), torch.cuda.synchronize()),
                "{k: v.cuda()}", lambda: ({k: v.cuda() for k, v in tensors.items()}, torch.cuda.synchronize()))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} cpus  python {platform.python_version()}")
    clock = "process CPU time" if args.cpu_time else "wall time"
    if args.warm_heap:
        clock += ", warm heap"
    print(f"# {n} leaves of 4 KiB (1024 float32), best of {r} ({clock}); us per leaf; x = loop time / tensorferry time")
    if args.faults:
        print("# faults = minor page faults per leaf and run (tensorferry / the loop)")
    for name, (t, tf_faults), peer_name, peer in rows:
        line = f"{name:<40} {t / n * 1e6:7.2f} us/leaf"
        if peer is not None:
            p, _ = peer
            line += f"   {peer_name:<16} {p / n * 1e6:7.2f} us/leaf   x{p / t:5.2f}"
        if args.faults:
            line += f"   faults {tf_faults / n:.2f}" + (f" / {peer[1] / n:.2f}" if peer is not None else "")
        print(line)


if __name__ == "__main__":
    main()
