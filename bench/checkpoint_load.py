"""Loading a checkpoint: tensorferry.load (mapped, read, streamed to the emulated device)
beside safetensors.torch.load_file, a safetensors.safe_open loop, torch.load (plain and
mmap=True) and fastsafetensors (CPU, nogds; where it installs), warm (file in the page
cache) and cold (evicted), on the same files in one run, with a raw read and a memcpy of
the same bytes as the roofs.

    python bench/checkpoint_load.py [--gb 1[,8,...]] [--tensors 300] [--small 10000]
                                    [--repeat 5] [--modes warm,cold] [--only SUBSTRING]

State dicts: ~`--tensors` bf16 tensors totalling each `--gb` GB, and `--small` tensors of
8 KiB. They are written once with tf.save (the .safetensors file every safetensors-format
row reads) and torch.save (the .pt file of the torch.load rows), plus the raw bytes as the
reference every result is checked against, byte for byte, once per method (not timed).

Every method runs in its own subprocess, so that its peak RSS growth (VmHWM, reset by
/proc/self/clear_refs before the first load call; file pages mapped by the call count) is
its own. Warm: the file is read once before. Cold: fsync, then
posix_fadvise(DONTNEED) before each repeat; mincore checks the eviction (the "res" column:
largest fraction of the file still resident at the start of a timed repeat).

Times are the best of `--repeat`; "1st" is the counted time of the first repeat in the
fresh process (what a process loading its checkpoint once pays). "call" is the load call
itself; "+copy" then copies every tensor's bytes into one preallocated buffer (np.copyto,
one pass), the same for every row. A row is "lazy" when its tensors point into a mapping
of the file (read from /proc/self/maps): its call only maps the file, and it counts as
call + copy, the first time every byte is read. Other rows count as the call alone. GB/s,
% of the roof (the slower of raw read and memcpy in the same mode) and the speed-up over
safetensors.torch.load_file ("x st") are of that counted time. Device rows (emu:0) have no
copy (their tensors are not on the host).
"""

import argparse
import ctypes
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import tensorferry as tf

SMALL_ELEMS = 4096  # 8 KiB bf16 tensors in the small-tensor dict


def _fst(p):
    from fastsafetensors import fastsafe_open

    with fastsafe_open(p, device="cpu", nogds=True) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _safe_open(p):
    from safetensors import safe_open

    with safe_open(p, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _st_load_file(p, **kw):
    import safetensors.torch

    return safetensors.torch.load_file(p, **kw)


# name -> (file read: "st" .safetensors / "pt" torch.save, load function)
METHODS = {
    "raw read (roof)": ("st", None),
    "memcpy (roof)": ("st", None),
    "tf.load(p)": ("st", lambda p: tf.load(p)),
    "tf.load(p, mmap=False)": ("st", lambda p: tf.load(p, mmap=False)),
    "tf.load(p, like='numpy')": ("st", lambda p: tf.load(p, like="numpy")),
    "tf.load(p, like='numpy', mmap=False)": ("st", lambda p: tf.load(p, like="numpy", mmap=False)),
    "tf.load(p, device='emu:0')": ("st", lambda p: tf.load(p, device="emu:0")),
    "safetensors.torch.load_file": ("st", _st_load_file),
    "safetensors.torch.load_file(backend='pread')": ("st", lambda p: _st_load_file(p, backend="pread")),
    "safetensors.safe_open loop": ("st", _safe_open),
    "torch.load(map_location='cpu')": ("pt", lambda p: torch.load(p, map_location="cpu")),
    "torch.load(.., mmap=True)": ("pt", lambda p: torch.load(p, map_location="cpu", mmap=True)),
    "fastsafetensors (cpu, nogds)": ("st", _fst),
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident(path):
    """Fraction of the file's pages in the page cache (mincore)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    os.close(fd)
    vec = (ctypes.c_ubyte * ((size + 4095) // 4096))()
    _libc.mincore(addr, size, vec)
    _libc.munmap(addr, size)
    return float((np.frombuffer(vec, np.uint8) & 1).mean())


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_into(path, buf):
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(buf), 0
        while done < len(buf):
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return done


def as_bytes(x):
    """Flat uint8 NumPy view of a host tensor (no copy)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).view(torch.uint8).numpy()
    return np.asarray(x).reshape(-1).view(np.uint8)


def hwm():
    """Peak RSS (VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def file_mappings(path):
    real, spans = os.path.realpath(path), []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(real):
                lo, hi = line.split()[0].split("-")
                spans.append((int(lo, 16), int(hi, 16)))
    return spans


def child(a):
    man = json.load(open(os.path.join(a.dir, "manifest.json")))
    kind, fn = METHODS[a.method]
    path = os.path.join(a.dir, "ckpt.safetensors" if kind == "st" else "ckpt.pt")
    nbytes, size = man["nbytes"], os.path.getsize(path)
    out = np.ones(nbytes, np.uint8)  # copy-out target, touched before the baseline
    src = np.ones(nbytes, np.uint8) if a.method == "memcpy (roof)" else None
    raw = bytearray(size) if a.method == "raw read (roof)" else None
    if a.mode == "warm":  # read the whole file once, through a small buffer
        with open(path, "rb", buffering=0) as f:
            chunk = bytearray(1 << 24)
            while f.readinto(chunk):
                pass
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS := current (ru_maxrss keeps the parent's
        f.write("5")  # peak across fork + exec)
    base = hwm()
    calls, copies, res_max, rss, r = [], [], 0.0, None, None
    on_device = "emu" in a.method
    for _ in range(a.repeat):
        if a.mode == "cold":
            evict(path)
            res_max = max(res_max, resident(path))
        gc.collect()
        t0 = time.perf_counter()
        if raw is not None:
            read_into(path, raw)
        elif src is not None:
            np.copyto(out, src)
        else:
            r = fn(path)
        t1 = time.perf_counter()
        if rss is None:
            rss = (hwm() - base) / 1024
        if fn is not None and not on_device:
            for k, off, n in man["tensors"]:
                np.copyto(out[off : off + n], as_bytes(r[k]))
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        copies.append(t2 - t0)
        r = None
    verified, lazy = "n/a", False
    if fn is not None:  # once, untimed: every tensor's bytes, shape and dtype against the source
        r = fn(path)
        ref = np.memmap(os.path.join(a.dir, "ref.bin"), np.uint8, "r")
        spans = file_mappings(path)
        ok = len(r) == len(man["tensors"])
        for k, off, n in man["tensors"]:
            t = r[k]
            if on_device:
                t = tf.to_numpy(t)
            ok = ok and str(t.dtype).endswith("bfloat16") and tuple(t.shape) == (n // 2,)
            b = as_bytes(t)
            ok = ok and np.array_equal(b, ref[off : off + n])
            p = b.ctypes.data
            lazy = lazy or any(lo <= p < hi for lo, hi in spans)
        verified = "yes" if ok else "NO"
    print(json.dumps(dict(call=min(calls), copy=min(copies), first=(calls[0], copies[0]), rss=rss, res=res_max, lazy=lazy, verified=verified)))


def write_files(work, gb, count, elems=None):
    g = torch.Generator().manual_seed(0)
    per = elems or int(gb * 1e9 / count / 2)
    sd = {f"layers.{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(count)}
    tf.save(sd, os.path.join(work, "ckpt.safetensors"))
    torch.save(sd, os.path.join(work, "ckpt.pt"))
    tensors, off = [], 0
    with open(os.path.join(work, "ref.bin"), "wb") as f:
        for k, t in sd.items():
            b = as_bytes(t)
            f.write(b.data)
            tensors.append((k, off, b.nbytes))
            off += b.nbytes
    json.dump(dict(nbytes=off, tensors=tensors), open(os.path.join(work, "manifest.json"), "w"))
    return off


def run_preset(a, label, nbytes, work):
    print(f"\n## {label}: {nbytes / 1e9:.3f} GB of tensor data; best of {a.repeat}")
    hdr = f"{'':44s} {'lazy':>4s} {'call ms':>9s} {'+copy ms':>9s} {'1st ms':>7s} {'GB/s':>6s} {'%roof':>6s} {'x st':>5s} {'RSS MB':>7s} {'res':>5s} ok"
    for mode in a.modes.split(","):
        rows = {}
        for name in METHODS:
            if a.only and a.only not in name and "roof" not in name and "load_file" not in name:
                continue
            cmd = [sys.executable, __file__, "--child", name, "--mode", mode, "--dir", work, "--repeat", str(a.repeat)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                rows[name] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            rows[name] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"### {mode}\n{hdr}")
        failed = {n: rows.pop(n)["error"] for n in [n for n, r in rows.items() if "error" in r]}
        for name, r in rows.items():  # counted time: the call, plus the copy-out when lazy
            r["t"], r["t1"] = (r["copy"], r["first"][1]) if r["lazy"] else (r["call"], r["first"][0])
        roof = max(rows[n]["t"] for n in ("raw read (roof)", "memcpy (roof)") if n in rows)  # slower one
        base = rows.get("safetensors.torch.load_file", {}).get("t")
        for name, r in rows.items():
            ratio = f"{base / r['t']:5.2f}" if base else "    -"
            cp = "-" if fn_less(name) else f"{r['copy'] * 1e3:.1f}"
            print(f"{name:44s} {'yes' if r['lazy'] else 'no':>4s} {r['call'] * 1e3:9.1f} {cp:>9s} {r['t1'] * 1e3:7.0f} "
                  f"{nbytes / r['t'] / 1e9:6.2f} {100 * roof / r['t']:5.0f}% {ratio} {r['rss']:7.0f} "
                  f"{r['res']:5.2f} {r['verified']}", flush=True)
        for name, err in failed.items():
            print(f"{name:44s} failed: {err[:120]}")


def fn_less(name):
    return "roof" in name or "emu" in name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", default="1", help="comma-separated sizes in GB")
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--small", type=int, default=10_000, help="count of 8 KiB tensors (0: skip)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--only", default="", help="run only the methods whose name holds this")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    ap.add_argument("--child")
    ap.add_argument("--mode")
    a = ap.parse_args()
    if a.child:
        a.method = a.child
        return child(a)
    try:
        import fastsafetensors

        fst = f"fastsafetensors {fastsafetensors.__version__}"
    except ImportError:
        fst = "fastsafetensors: not installed (row fails)"
    import safetensors

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__))
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, nproc {os.cpu_count()}, "
          f"{mem:.1f} GiB, commit {head.stdout.strip()[:12]}")
    print(f"$ python bench/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}")
    print(f"# torch {torch.__version__}, safetensors {safetensors.__version__}, {fst}, tensorferry {tf.__version__}")
    presets = [(f"{float(g):g} GB, {a.tensors} bf16 tensors", float(g), a.tensors, None) for g in a.gb.split(",")]
    if a.small:
        presets.append((f"{a.small} bf16 tensors of 8 KiB", 0, a.small, SMALL_ELEMS))
    for label, gb, count, elems in presets:
        work = tempfile.mkdtemp(prefix="tf-ckpt-load-", dir=a.dir)
        try:
            nbytes = write_files(work, gb, count, elems)
            run_preset(a, label, nbytes, work)
        finally:
            for f in os.listdir(work):
                os.remove(os.path.join(work, f))
            os.rmdir(work)


if __name__ == "__main__":
    main()
