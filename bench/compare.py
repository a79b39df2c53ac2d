"""tensorferry against its peers, side by side, in one run, on the same data.

Save (to the page cache, and with fsync) and load (from the page cache) of
  - 1 GiB in 200 float32 tensors, and
  - 20,000 tensors of 4 KiB each,
for: raw bytes (the roof: one write/read of the same bytes), tensorferry, safetensors.numpy,
safetensors.torch, pickle protocol 5, numpy.savez, torch.save/torch.load. Then the
per-leaf cost from Python of to_numpy, to_host(copy=True) and load(mmap=True) on 20,000
host tensors.

Usage: python bench/compare.py [--scale 0.25] [--repeat 3] [--dir DIR] [--out FILE]
Peers that are not installed are reported as skipped.
"""

import argparse
import datetime
import gc
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

import tensorferry as tf

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
try:
    import safetensors.numpy as st_np
except ImportError:  # pragma: no cover
    st_np = None
try:
    import safetensors.torch as st_torch
except ImportError:  # pragma: no cover
    st_torch = None


def presets(scale):
    rng = np.random.default_rng(0)
    n_big = max(1, int((1 << 30) * scale) // 200 // 4)
    big = {f"layer.{i}.weight": rng.standard_normal(n_big, dtype=np.float32) for i in range(200)}
    tiny = {f"t.{i}": np.full(1024, i, dtype=np.float32) for i in range(20_000)}
    return {"1GiB-200" if scale == 1 else f"{scale:g}GiB-200": big, "20k-4KiB": tiny}


def best(fn, repeat, setup=None):
    times = []
    for _ in range(repeat):
        if setup:
            setup()
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rm(path):
    def go():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    return go


def writers(d, torch_d):
    """name -> (save(path), load(path) returning something whose data is in memory)."""
    flat = np.concatenate([v.reshape(-1).view(np.uint8) for v in d.values()])

    def raw_save(p):
        with open(p, "wb") as f:
            f.write(memoryview(flat))

    def raw_load(p):
        out = np.empty(os.path.getsize(p), np.uint8)
        with open(p, "rb") as f:
            f.readinto(memoryview(out))
        return out

    w = {"raw bytes (roof)": (raw_save, raw_load)}
    w["tensorferry"] = (lambda p: tf.save(d, p, fsync=False), lambda p: tf.load(p, mmap=False))
    w["tensorferry (mmap load)"] = (None, lambda p: tf.load(p, mmap=True))
    if st_np:
        w["safetensors.numpy"] = (lambda p: st_np.save_file(d, p), st_np.load_file)
    if st_torch and torch_d is not None:
        w["safetensors.torch"] = (lambda p: st_torch.save_file(torch_d, p), st_torch.load_file)

    def pk_save(p):
        with open(p, "wb") as f:
            pickle.dump(d, f, protocol=5)

    def pk_load(p):
        with open(p, "rb") as f:
            return pickle.load(f)

    w["pickle protocol 5"] = (pk_save, pk_load)

    def npz_save(p):
        with open(p, "wb") as f:
            np.savez(f, **d)

    def npz_load(p):
        with np.load(p) as z:
            return {k: z[k] for k in z.files}

    w["numpy.savez"] = (npz_save, npz_load)
    if torch_d is not None:
        w["torch.save"] = (lambda p: torch.save(torch_d, p), lambda p: torch.load(p, weights_only=True))
    return w


def run_io(name, d, repeat, folder, rows):
    torch_d = {k: torch.from_numpy(v) for k, v in d.items()} if torch is not None else None
    nbytes = sum(v.nbytes for v in d.values())
    w = writers(d, torch_d)
    paths = {k: os.path.join(folder, f"{i}.bin") for i, k in enumerate(w)}
    paths["tensorferry (mmap load)"] = paths["tensorferry"]
    results = {}
    for fsync in (False, True):
        for peer, (save, _) in w.items():
            if save is None:
                continue
            p = paths[peer]

            def go(save=save, p=p):
                save(p)
                if fsync:
                    fsync_file(p)

            results[(peer, "save" + (" fsync" if fsync else ""))] = best(go, repeat, rm(p))
    for peer, (save, load) in w.items():
        p = paths[peer]
        load(p)  # warm the page cache
        results[(peer, "load")] = best(lambda: load(p), repeat)
    for op in ("save", "save fsync", "load"):
        roof = results[("raw bytes (roof)", op)]
        base = results.get(("safetensors.numpy", op))
        for peer in w:
            t = results.get((peer, op))
            if t is None:
                continue
            rows.append((name, op, peer, t, nbytes / t / 1e9, roof / t * 100, (base / t) if base else None, len(d)))


def per_leaf(repeat):
    n = 20_000
    arrays = {f"t.{i}": np.full(1024, i, dtype=np.float32) for i in range(n)}
    natives = tf.to_host(arrays, copy=True)
    natives = {k: tf.Tensor.from_numpy(v) for k, v in natives.items()}
    rows = []

    def add(what, t):
        rows.append((what, t / n * 1e6))

    add("to_numpy: tensorferry.Tensor leaves", best(lambda: tf.to_numpy(natives), repeat))
    add("to_numpy: NumPy leaves (identity)", best(lambda: tf.to_numpy(arrays), repeat))
    add("to_host(copy=True): NumPy leaves", best(lambda: tf.to_host(arrays, copy=True), repeat))
    add("peer loop {k: v.copy()}: NumPy leaves", best(lambda: {k: v.copy() for k, v in arrays.items()}, repeat))
    if torch is not None:
        tt = {k: torch.from_numpy(v) for k, v in arrays.items()}
        add("to_numpy: torch CPU leaves", best(lambda: tf.to_numpy(tt), repeat))
        add("peer loop {k: v.numpy()}: torch CPU leaves", best(lambda: {k: v.numpy() for k, v in tt.items()}, repeat))
        add("to_host(copy=True): torch CPU leaves", best(lambda: tf.to_host(tt, copy=True), repeat))
        add("peer loop {k: v.clone()}: torch CPU leaves", best(lambda: {k: v.clone() for k, v in tt.items()}, repeat))
    add("to_device(emu:0): NumPy leaves, one call", best(lambda: tf.to_device(arrays, "emu:0"), repeat))
    add("loop {k: tf.to_device(v, 'emu:0')}: NumPy leaves", best(lambda: {k: tf.to_device(v, "emu:0") for k, v in arrays.items()}, repeat))
    on_emu = tf.to_device(arrays, "emu:0")
    add("to_host: emu:0 leaves, one call", best(lambda: tf.to_host(on_emu), repeat))
    with tempfile.TemporaryDirectory() as folder:
        p = os.path.join(folder, "tiny.safetensors")
        tf.save(arrays, p)
        add("load(mmap=True) -> NumPy", best(lambda: tf.load(p), repeat))
        add("load(mmap=True, like='tensorferry')", best(lambda: tf.load(p, like="tensorferry"), repeat))
        if st_np:
            add("peer safetensors.numpy.load_file", best(lambda: st_np.load_file(p), repeat))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 1 GiB preset")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args()

    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    say(f"# tensorferry peer benchmark, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    say(f"command: python bench/compare.py {' '.join(sys.argv[1:])}")
    say(f"commit {commit or '?'}, tensorferry {tf.__version__}, Python {platform.python_version()}, "
        f"numpy {np.__version__}, torch {getattr(torch, '__version__', 'absent')}, "
        f"safetensors {getattr(sys.modules.get('safetensors'), '__version__', 'absent')}")
    say(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; best of {args.repeat}")
    say()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for name, d in presets(args.scale).items():
            run_io(name, d, args.repeat, folder, rows)
    say("| data | op | library | time (ms) | GB/s | % of raw | × safetensors.numpy |")
    say("|---|---|---|---:|---:|---:|---:|")
    for name, op, peer, t, gbps, pct, ratio, _ in rows:
        r = f"{ratio:.2f}" if ratio else "-"
        say(f"| {name} | {op} | {peer} | {t * 1e3:.1f} | {gbps:.2f} | {pct:.0f}% | {r} |")
    say()
    say("| per-leaf cost from Python, 20,000 host tensors of 4 KiB | µs per leaf |")
    say("|---|---:|")
    for what, us in per_leaf(args.repeat):
        say(f"| {what} | {us:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
