"""Loading a checkpoint: tensorferry.load beside safetensors.torch.load_file, a
safetensors.safe_open loop, torch.load (plain and mmap=True) and fastsafetensors (nogds;
where it installs), onto the host and onto a device, warm (file in the page cache) and cold
(evicted), on the same files in one run, with a raw read, a memcpy and (CUDA) one pinned
host-to-device copy of the same bytes as the roofs.

    python bench/checkpoint_load.py [--gb 1[,8,...]] [--tensors 300] [--small 10000]
                                    [--repeat 5] [--modes warm,cold] [--only SUBSTRING]
                                    [--device cuda:0|emu:0|cpu] [--rows all|device|host]
                                    [--budget SECONDS] [--dir DIR]

State dicts: ~`--tensors` bf16 tensors totalling each `--gb` GB, and `--small` tensors of
8 KiB. They are written once with tf.save (the .safetensors file every safetensors-format
row reads) and torch.save (the .pt file of the torch.load rows), plus the raw bytes as the
reference every result is checked against, byte for byte, once per method (not timed):
device results are copied back to the host for it, and must be on the device asked for.

`--device` (default: cuda:0 when torch sees a GPU, else emu:0; cpu: host rows only) adds the
device rows: tf.load(p, device=DEV) and, for CUDA, safetensors.torch.load_file(p,
device=DEV), a safe_open(device=DEV) loop, torch.load(map_location=DEV) and fastsafetensors
onto DEV (nogds), each followed by torch.cuda.synchronize() inside the timed call, and the
roof "pinned copy (roof)": one copy of the same bytes from a pinned torch buffer into a
preallocated device buffer, synchronized. Where tensorferry sees a CUDA device that torch
cannot use (the fake driver), tf.load returns tensorferry tensors (like='tensorferry') and
the torch rows are skipped, saying so. Emulated devices have only the tensorferry row.

Every method runs in its own subprocess, so that its peak RSS growth (VmHWM, reset by
/proc/self/clear_refs before the first load call; file pages mapped by the call count) is
its own; the CUDA context (torch's, which tensorferry shares) exists before that baseline.
Warm: the file is read once before. Cold: fsync, then posix_fadvise(DONTNEED) before each
repeat; mincore checks the eviction (the "res" column: largest fraction of the file still
resident at the start of a timed repeat; "?" where mincore cannot tell, as "RSS MB" is where
/proc/self/clear_refs is missing). The memcpy and pinned-copy roofs read no file:
they are measured in the first mode only and repeated in the others.

Times are the best of `--repeat`; "1st" is the counted time of the first repeat in the
fresh process (what a process loading its checkpoint once pays). "call" is the load call
itself; "+copy" then copies every tensor's bytes into one preallocated buffer (np.copyto,
one pass), the same for every host row. A host row is "lazy" when its tensors point into a
mapping of the file (read from /proc/self/maps): its call only maps the file, and it counts
as call + copy, the first time every byte is read. Other rows count as the call alone.
GB/s, % of the roof and the speed-up over safetensors ("x st") are of that counted time:
host rows against the slower of raw read and memcpy and over safetensors.torch.load_file;
device rows against the slower of raw read and pinned copy and over
safetensors.torch.load_file(device=DEV).

Rows run roofs first, then the device rows, then the host rows (`--rows` picks), and each
is printed as it ends; the state dicts run from the smallest. `--budget` bounds the whole
run: a row that would start after it, or runs past it, is reported as skipped, and the files
are removed all the same. A state dict whose three files do not fit the folder's free space
is skipped. Exit status 1 when a tensorferry or roof row fails or any row loads wrong bytes
(a peer that fails is only reported).
"""

import argparse
import ctypes
import datetime
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import tensorferry as tf
from child_rows import reset_peak, run_child, status_kib  # bench/ is on sys.path when run

SMALL_ELEMS = 4096  # 8 KiB bf16 tensors in the small-tensor dict
_HELD = []  # fastsafetensors handles, closed once their tensors are dropped (untimed)


def _fst(p, device="cpu"):
    from fastsafetensors import fastsafe_open

    # Loads in the constructor. Its tensors share their buffer's ownership in 0.5; older
    # versions free it on close, so the handle stays open until the tensors are dropped.
    f = fastsafe_open(p, device=device, nogds=True)
    _HELD.append(f)
    return {k: f.get_tensor(k) for k in f.keys()}


def release():
    while _HELD:
        _HELD.pop().__exit__(None, None, None)


def _safe_open(p, device="cpu"):
    from safetensors import safe_open

    with safe_open(p, framework="pt", device=device) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _st_load_file(p, **kw):
    import safetensors.torch

    return safetensors.torch.load_file(p, **kw)


ST_HOST = "safetensors.torch.load_file"


def st_device(dev):
    return f"safetensors.torch.load_file(device='{dev}')"


def methods(dev):
    """name -> (where, file, load function, needs torch CUDA), in the order they run.

    where: "roof" (raw read: both tables), "host roof", "device roof", "host", "device";
    file: "st" (.safetensors) or "pt" (torch.save)."""
    cuda = dev.startswith("cuda")
    m = {"raw read (roof)": ("roof", "st", None, False)}
    if cuda:
        m["pinned copy (roof)"] = ("device roof", "st", None, True)
    m["memcpy (roof)"] = ("host roof", "st", None, False)
    if dev != "cpu":
        if cuda:
            m[st_device(dev)] = ("device", "st", lambda p: _st_load_file(p, device=dev), True)
        if cuda and not torch.cuda.is_available():  # the fake driver: torch cannot hold its memory
            m[f"tf.load(p, device='{dev}', like='tensorferry')"] = (
                "device", "st", lambda p: tf.load(p, device=dev, like="tensorferry"), False)
        else:
            m[f"tf.load(p, device='{dev}')"] = ("device", "st", lambda p: tf.load(p, device=dev), False)
        like = {"like": "tensorferry"} if cuda and not torch.cuda.is_available() else {}
        m[f"tf.load(p, device='{dev}', direct=True)"] = (
            "device", "st", lambda p: tf.load(p, device=dev, direct=True, **like), False)
        if cuda:
            m[f"safetensors.safe_open(device='{dev}') loop"] = ("device", "st", lambda p: _safe_open(p, dev), True)
            m[f"torch.load(map_location='{dev}')"] = ("device", "pt", lambda p: torch.load(p, map_location=dev), True)
            m[f"fastsafetensors ({dev}, nogds)"] = ("device", "st", lambda p: _fst(p, dev), True)
    m.update({
        ST_HOST: ("host", "st", _st_load_file, False),
        "tf.load(p)": ("host", "st", lambda p: tf.load(p), False),
        "tf.load(p, mmap=False)": ("host", "st", lambda p: tf.load(p, mmap=False), False),
        "tf.load(p, direct=True)": ("host", "st", lambda p: tf.load(p, direct=True), False),
        "tf.load(p, like='numpy')": ("host", "st", lambda p: tf.load(p, like="numpy"), False),
        "tf.load(p, like='numpy', mmap=False)": ("host", "st", lambda p: tf.load(p, like="numpy", mmap=False), False),
        "safetensors.torch.load_file(backend='pread')": ("host", "st", lambda p: _st_load_file(p, backend="pread"), False),
        "safetensors.safe_open loop": ("host", "st", _safe_open, False),
        "torch.load(map_location='cpu')": ("host", "pt", lambda p: torch.load(p, map_location="cpu"), False),
        "torch.load(.., mmap=True)": ("host", "pt", lambda p: torch.load(p, map_location="cpu", mmap=True), False),
        "fastsafetensors (cpu, nogds)": ("host", "st", _fst, False),
    })
    return m


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident(path):
    """Fraction of the file's pages in the page cache (mincore); -1 where it cannot tell."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        return -1.0
    vec = (ctypes.c_ubyte * ((size + 4095) // 4096))()
    failed = _libc.mincore(addr, size, vec) != 0
    _libc.munmap(addr, size)
    return -1.0 if failed else float((np.frombuffer(vec, np.uint8) & 1).mean())


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


def to_host(t):
    """A device result's host copy (untimed verification)."""
    return t.cpu() if isinstance(t, torch.Tensor) else tf.to_numpy(t)


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
    dev = a.device
    where, kind, fn, _ = methods(dev)[a.method]
    path = os.path.join(a.dir, "ckpt.safetensors" if kind == "st" else "ckpt.pt")
    nbytes, size = man["nbytes"], os.path.getsize(path)
    on_device = where in ("device", "device roof")
    sync = on_device and dev.startswith("cuda") and torch.cuda.is_available()
    if on_device:  # the device's context exists before the baseline: its host memory is no method's
        tf.devices()
        if sync:
            torch.zeros(1, device=dev)
            torch.cuda.synchronize()
    memcpy = a.method == "memcpy (roof)"
    out = np.ones(nbytes, np.uint8) if where == "host" or memcpy else None  # copy-out target, touched
    src = np.ones(nbytes, np.uint8) if memcpy else None
    raw = bytearray(size) if a.method == "raw read (roof)" else None
    pin = dst = None
    if a.method == "pinned copy (roof)":
        pin = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
    if a.mode == "warm":  # read the whole file once, through a small buffer
        with open(path, "rb", buffering=0) as f:
            chunk = bytearray(1 << 24)
            while f.readinto(chunk):
                pass
    peak_reset = reset_peak()  # peak RSS := current (ru_maxrss keeps the parent's peak across fork + exec)
    base = status_kib("VmHWM")
    calls, copies, res_max, rss, r = [], [], 0.0, None, None
    for _ in range(a.repeat):
        if a.mode == "cold":
            evict(path)
            res = resident(path)
            res_max = -1.0 if res < 0 or res_max < 0 else max(res_max, res)
        gc.collect()
        t0 = time.perf_counter()
        if raw is not None:
            read_into(path, raw)
        elif src is not None:
            np.copyto(out, src)
        elif pin is not None:
            dst.copy_(pin, non_blocking=True)
        else:
            r = fn(path)
        if sync:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if rss is None:
            rss = (status_kib("VmHWM") - base) / 1024 if peak_reset else -1.0
        if fn is not None and where == "host":
            for k, off, n in man["tensors"]:
                np.copyto(out[off : off + n], as_bytes(r[k]))
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        copies.append(t2 - t0)
        r = None
        release()
    verified, lazy = "n/a", False
    if fn is not None:  # once, untimed: every tensor's bytes, shape, dtype (and device) against the source
        r = fn(path)
        ref = np.memmap(os.path.join(a.dir, "ref.bin"), np.uint8, "r")
        spans = file_mappings(path)
        ok = len(r) == len(man["tensors"])
        for k, off, n in man["tensors"]:
            t = r[k]
            if on_device:
                ok = ok and str(t.device) == dev
                t = to_host(t)
            ok = ok and str(t.dtype).endswith("bfloat16") and tuple(t.shape) == (n // 2,)
            b = as_bytes(t)
            ok = ok and np.array_equal(b, ref[off : off + n])
            if not on_device:
                p = b.ctypes.data
                lazy = lazy or any(lo <= p < hi for lo, hi in spans)
        verified = "yes" if ok else "NO"
        r = None
        release()
    print(json.dumps(dict(call=min(calls), copy=min(copies), first=(calls[0], copies[0]), rss=rss, res=res_max, lazy=lazy, verified=verified)))


def write_files(work, gb, count, elems=None):
    per = elems or int(gb * 1e9 / count / 2)
    if torch.cuda.is_available():  # generated on the GPU: seconds instead of minutes for 8 GB
        g = torch.Generator(device="cuda").manual_seed(0)
        sd = {f"layers.{i}.weight": torch.randn(per, generator=g, device="cuda").to(torch.bfloat16).cpu() for i in range(count)}
    else:
        g = torch.Generator().manual_seed(0)
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


def selected(a):
    """The methods this run measures, and why others are skipped (name -> reason)."""
    rows, skip = {}, {}
    keep = {"all": ("roof", "host roof", "device roof", "host", "device"),
            "device": ("roof", "device roof", "device"), "host": ("roof", "host roof", "host")}[a.rows]
    fst = importlib.util.find_spec("fastsafetensors") is not None
    for name, (where, kind, fn, needs_cuda) in methods(a.device).items():
        if where not in keep:
            continue
        if a.only and a.only not in name and "roof" not in name and "load_file" not in name:
            continue
        if needs_cuda and not torch.cuda.is_available():
            skip[name] = (f"skipped: torch {torch.__version__} has no CUDA here (torch.cuda.is_available() is False; "
                          f"tensorferry sees {', '.join(d for d in tf.devices() if d.startswith('cuda')) or 'none'})")
        elif "fastsafetensors" in name and not fst:
            skip[name] = "skipped: fastsafetensors is not installed"
        else:
            rows[name] = where
    return rows, skip


def run_preset(a, label, nbytes, work, deadline, wrote):
    print(f"\n## {label}: {nbytes / 1e9:.3f} GB of tensor data; best of {a.repeat} (files written in {wrote:.1f} s)",
          flush=True)
    hdr = (f"{'':48s} {'lazy':>4s} {'call ms':>9s} {'+copy ms':>9s} {'1st ms':>7s} {'GB/s':>6s} {'%roof':>6s} "
           f"{'x st':>5s} {'RSS MB':>7s} {'res':>5s} ok")
    todo, skip = selected(a)
    dev = a.device
    where_of = {n: m[0] for n, m in methods(dev).items()}
    order = [n for n in where_of if n in todo or n in skip]
    cached, bad = {}, 0  # the roofs that read no file, measured in the first mode; rows failed or wrong
    for mode in a.modes.split(","):
        print(f"### {mode}\n{hdr}", flush=True)
        done, section = {}, None
        for name in order:
            where = where_of[name]
            sec = "roof" if "roof" in where else where
            if sec != section:
                section = sec
                print(section_line(sec, dev, todo), flush=True)
            if name in skip:
                print(f"{name:48s} {skip[name]}", flush=True)
                continue
            if name in cached:
                r = dict(cached[name])
            else:
                r = run_child([__file__, "--child", name, "--mode", mode, "--dir", work, "--repeat", str(a.repeat),
                               "--device", a.device], deadline)
                if name in ("memcpy (roof)", "pinned copy (roof)") and "error" not in r:
                    cached[name] = r
            done[name] = r
            if "error" in r:
                print(f"{name:48s} {r['error'][:140]}", flush=True)
                bad += r["error"].startswith("failed") and (name.startswith("tf.") or "roof" in name)  # not a peer's
                continue
            # counted time: the call, plus the copy-out when lazy
            r["t"], r["t1"] = (r["copy"], r["first"][1]) if r["lazy"] else (r["call"], r["first"][0])
            print_row(name, where, r, nbytes, done, dev)
            bad += r["verified"] == "NO"
    return bad


def section_line(sec, dev, todo):
    if sec == "roof":
        return "-- roofs (the same bytes; no file for memcpy and pinned copy)"
    if sec == "device":
        roof = "the slower of raw read and pinned copy" if "pinned copy (roof)" in todo else "raw read"
        base = f"x st: over {st_device(dev)}" if dev.startswith("cuda") else "x st: none on emulated devices"
        return f"-- onto {dev} (%roof: of {roof}; {base})"
    return f"-- onto the host (%roof: of the slower of raw read and memcpy; x st: over {ST_HOST})"


def counted(done, name):
    r = done.get(name)
    return r["t"] if r and "t" in r else None


def print_row(name, where, r, nbytes, done, dev):
    roofs = {"device": ("raw read (roof)", "pinned copy (roof)"), "host": ("raw read (roof)", "memcpy (roof)")}.get(where)
    ts = [counted(done, n) for n in roofs] if roofs else []
    roof = max((t for t in ts if t), default=None)  # the slower one
    base = counted(done, st_device(dev) if where == "device" else ST_HOST) if roofs else None
    pct = f"{100 * roof / r['t']:5.0f}%" if roof else "     -"
    ratio = f"{base / r['t']:5.2f}" if base else "    -"
    cp = f"{r['copy'] * 1e3:.1f}" if where == "host" else "-"
    print(f"{name:48s} {'yes' if r['lazy'] else 'no':>4s} {r['call'] * 1e3:9.1f} {cp:>9s} {r['t1'] * 1e3:7.0f} "
          f"{nbytes / r['t'] / 1e9:6.2f} {pct} {ratio} {unknown(r['rss'], 7, '.0f')} {unknown(r['res'], 5, '.2f')} "
          f"{r['verified']}", flush=True)


def unknown(x, width, fmt):
    """x formatted, or "?" where it could not be measured (negative)."""
    return f"{'?':>{width}s}" if x < 0 else f"{x:{width}{fmt}}"


def default_device():
    return "cuda:0" if torch.cuda.is_available() else "emu:0"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", default="1", help="comma-separated sizes in GB")
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--small", type=int, default=10_000, help="count of 8 KiB tensors (0: skip)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--only", default="", help="run only the methods whose name holds this (and the roofs, baselines)")
    ap.add_argument("--device", default=None, help="cuda:N, emu:N or cpu (no device rows); default: "
                    "cuda:0 when torch sees a GPU, else emu:0")
    ap.add_argument("--rows", default="all", choices=["all", "device", "host"])
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: no limit)")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    ap.add_argument("--child")
    ap.add_argument("--mode")
    a = ap.parse_args()
    a.device = a.device or default_device()
    if a.device == "cuda":
        a.device = "cuda:0"
    if a.child:
        a.method = a.child
        return child(a)
    deadline = time.monotonic() + (a.budget or 1e6)
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))  # files removed on `timeout` too
    fst = f"fastsafetensors {__import__('fastsafetensors').__version__}" if importlib.util.find_spec(
        "fastsafetensors") else "fastsafetensors: not installed (rows skipped)"
    import safetensors

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "torch sees no GPU"
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, nproc {os.cpu_count()}, "
          f"{mem:.1f} GiB, {gpu}, commit {head.stdout.strip()[:12] or '?'}")
    print(f"$ python bench/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}")
    print(f"# torch {torch.__version__}, safetensors {safetensors.__version__}, {fst}, tensorferry {tf.__version__}; "
          f"device {a.device}, tensorferry devices {tf.devices()}")
    presets = [(f"{float(g):g} GB, {a.tensors} bf16 tensors", float(g) * 1e9, a.tensors, None) for g in a.gb.split(",") if g]
    if a.small:
        presets.append((f"{a.small} bf16 tensors of 8 KiB", a.small * SMALL_ELEMS * 2, a.small, SMALL_ELEMS))
    bad = 0
    for label, size, count, elems in sorted(presets, key=lambda p: p[1]):  # the cheaper first, under --budget
        want = 3 * size + 2**30  # .safetensors + .pt + ref.bin + room
        free = shutil.disk_usage(a.dir or tempfile.gettempdir()).free
        if free < want:
            print(f"\n## {label}: skipped: {free / 1e9:.1f} GB free in {a.dir or tempfile.gettempdir()}, "
                  f"{want / 1e9:.1f} GB needed", flush=True)
            continue
        if deadline - time.monotonic() < 30 + 6 * size / 1e9:  # room to write the files, and some rows
            print(f"\n## {label}: skipped: time budget (--budget) spent", flush=True)
            continue
        work = tempfile.mkdtemp(prefix="tf-ckpt-load-", dir=a.dir)
        try:
            t0 = time.perf_counter()
            nbytes = write_files(work, size / 1e9, count, elems)
            bad += run_preset(a, label, nbytes, work, deadline, time.perf_counter() - t0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if bad:
        print(f"\n{bad} row(s) of tensorferry or the roofs failed, or loaded wrong bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
