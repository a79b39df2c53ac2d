"""Saving a state dict: how long the caller is blocked, how long until the file is complete,
and how much host memory it takes, for tensorferry (streamed, staging='off', non_blocking)
beside torch.save, safetensors.torch.save_file and torch.distributed.checkpoint (save and
async_save), on the same tensors in one run, with a raw write of the same bytes and (CUDA)
one device-to-host copy of them into pinned memory as the roofs.

    python bench/checkpoint_save.py [--gb 0.5] [--tensors 300] [--repeat 3]
                                    [--device cpu|cuda[:N]|emu:N] [--budget SECONDS] [--dir DIR]

State dict: `--tensors` bf16 tensors totalling `--gb` GB on `--device`: PyTorch tensors on
the host or on a CUDA device torch can use (generated there); on an emulated device (or a
CUDA device only tensorferry sees: the fake driver), tensorferry tensors made by
tf.to_device of NumPy arrays, and the rows of the other tools say n/a. For a CUDA device
the other tools are called as users call them, on the CUDA dict (torch.save and
safetensors.torch.save_file move each tensor to the host themselves).

Every row runs in its own subprocess (the state dict made there), so that its host memory
is its own. Each repeat writes a fresh file (the previous one removed, untimed). Columns:
blocked ms (the call's own time), total ms (until the data is on disk, fsync included where
the tool does it; torch.save and safetensors are followed by an fsync of the file so that
every row pays for durability), both the best of `--repeat`; "1st" (the first repeat's
total, in the fresh process); GB/s of the total; "%roof" (the raw write's total over the
row's: the target is >= 85 %); "blk/cp" (blocked time over one pinned device-to-host copy of
the same bytes: the target for a non-blocking save is <= 1); "host MB" (largest over the
repeats of the peak RSS growth during the call and its wait: VmHWM, reset through
/proc/self/clear_refs just before, minus VmRSS just before); "ok" (each tensorferry save
loaded back once, untimed, and compared byte for byte, with dtypes, shapes and names).
`--budget` bounds the whole run: a row that would start after it, or runs past it, is
reported as skipped. Exit status 1 when a tensorferry or roof row fails or a tensorferry
save's file is wrong (a peer that fails is only reported).
"""

import argparse
import ctypes
import gc
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np
import torch

import tensorferry as tf
from child_rows import reset_peak, run_child, status_kib  # bench/ is on sys.path when run
from compare import fsync_file

RAW, PINNED = "raw write + fsync (roof)", "pinned copy (roof)"
TF_ROWS = ("tf.save(sd, p)", "tf.save(sd, p, staging='off')", "tf.save(sd, p, non_blocking=True)")
PEERS = ("torch.save + fsync", "safetensors.torch.save_file + fsync",
         "torch.distributed.checkpoint.save", "torch.distributed.checkpoint.async_save")
ROWS = (RAW, PINNED) + TF_ROWS + PEERS


def torch_holds(device):
    """Whether the state dict is made of PyTorch tensors (host, or CUDA that torch can use)."""
    return device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available())


def state_dict(gb, count, device):
    per = int(gb * 1e9 / count / 2)
    names = [f"layers.{i}.weight" for i in range(count)]
    if device.startswith("cuda") and torch.cuda.is_available():
        g = torch.Generator(device=device).manual_seed(0)
        sd = {k: torch.randn(per, generator=g, device=device).to(torch.bfloat16) for k in names}
        torch.cuda.synchronize()
        return sd
    g = torch.Generator().manual_seed(0)
    if device == "cpu":
        return {k: torch.randn(per, generator=g).to(torch.bfloat16) for k in names}
    import ml_dtypes

    host = {k: torch.randn(per, generator=g).to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            for k in names}
    return tf.to_device(host, device)


def host_bytes(t):
    """A tensor's bytes on the host, flat uint8 (a copy for device tensors)."""
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().reshape(-1).view(torch.uint8).numpy()
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    return tf.to_numpy(t).reshape(-1).view(np.uint8)


def sync(device):
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def row_save(name, sd, p, folder, device, nbytes):
    """The save of row `name`: a function that starts it and returns its wait."""
    done = lambda: None  # noqa: E731
    if name == RAW:
        host = [host_bytes(t) for t in sd.values()]  # made before the baseline

        def raw():
            with open(p, "wb") as f:
                for b in host:
                    f.write(b.data)
                f.flush()
                os.fsync(f.fileno())
            return done

        return raw
    if name == PINNED:
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        pin = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)  # resident before the baseline
        torch.cuda.synchronize()

        def copy():
            pin.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return done

        return copy
    if name == "tf.save(sd, p)":
        return lambda: (tf.save(sd, p), done)[1]
    if name == "tf.save(sd, p, staging='off')":
        return lambda: (tf.save(sd, p, staging="off"), done)[1]
    if name == "tf.save(sd, p, non_blocking=True)":
        return lambda: tf.save(sd, p, non_blocking=True).result
    if name == "torch.save + fsync":
        return lambda: (torch.save(sd, p), fsync_file(p), done)[2]
    if name == "safetensors.torch.save_file + fsync":
        import safetensors.torch as st

        return lambda: (st.save_file(sd, p), fsync_file(p), done)[2]
    import torch.distributed.checkpoint as dcp

    kw = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
    if name == "torch.distributed.checkpoint.save":
        return lambda: (dcp.save(sd, checkpoint_id=folder, **kw), done)[1]
    if name == "torch.distributed.checkpoint.async_save":
        def start():
            response = dcp.async_save(sd, checkpoint_id=folder, **kw)
            return getattr(response, "upload_completion", response).result  # a Future, or AsyncSaveResponse

        return start
    raise ValueError(name)


def child(a):
    sd = state_dict(a.gb, a.tensors, a.device)
    nbytes = int(a.gb * 1e9 / a.tensors / 2) * 2 * a.tensors
    p, folder = os.path.join(a.dir, "ckpt"), os.path.join(a.dir, "dcp")
    save = row_save(a.child, sd, p, folder, a.device, nbytes)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # the freed temporaries of the setup go back: growth is not hidden in them
    blocked, total, host = [], [], 0.0
    for _ in range(a.repeat):
        if os.path.exists(p):
            os.remove(p)
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()
        sync(a.device)
        if not reset_peak():  # not everywhere (gVisor, say): "?" in the table
            host = -1.0
        rss = status_kib("VmRSS")
        start = time.perf_counter()
        finish = save()
        blocked.append(time.perf_counter() - start)
        finish()
        total.append(time.perf_counter() - start)
        host = max(host, (status_kib("VmHWM") - rss) / 1024) if host >= 0 else -1.0
    verified = "n/a"
    if a.child in TF_ROWS:  # once, untimed: the file against the state dict, byte for byte
        back = tf.load(p, like="numpy")
        ok = sorted(back) == sorted(sd)
        for k, t in sd.items():
            if not ok:
                break
            b = back[k]
            ok = str(b.dtype).endswith("bfloat16") and tuple(b.shape) == tuple(t.shape)
            ok = ok and np.array_equal(b.reshape(-1).view(np.uint8), host_bytes(t))
        verified = "yes" if ok else "NO"
    print(json.dumps(dict(blocked=min(blocked), total=min(total), first=total[0], host=host, verified=verified)))


def skipped(name, device):
    """Why row `name` does not run on `device`, or None."""
    if name == PINNED:
        if not device.startswith("cuda"):
            return f"n/a on {device}"
        if not torch.cuda.is_available():
            return f"skipped: torch {torch.__version__} has no CUDA here (torch.cuda.is_available() is False)"
    if name == "tf.save(sd, p, staging='off')" and device == "cpu":
        return "n/a on the host (staging is for device tensors)"
    if name in PEERS and not torch_holds(device):
        if device.startswith("emu"):
            return f"n/a on emu ({device}: tensorferry tensors)"
        return f"skipped: torch {torch.__version__} has no CUDA here (torch.cuda.is_available() is False)"
    if name == "safetensors.torch.save_file + fsync":
        try:
            import safetensors.torch as _st  # noqa: F401
        except ImportError:
            return "skipped: safetensors is not installed"
    if name.startswith("torch.distributed.checkpoint"):
        try:
            import torch.distributed.checkpoint as _dcp  # noqa: F401
        except Exception as e:  # DCP needs what this PyTorch build may lack
            return f"skipped: DCP: {type(e).__name__}: {e}"[:100]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or emu:N")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: no limit)")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.device == "cuda":
        a.device = "cuda:0"
    if a.child:
        return child(a)
    deadline = time.monotonic() + (a.budget or 1e6)
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))  # the folder removed on `timeout` too
    per = int(a.gb * 1e9 / a.tensors / 2)
    nbytes = per * 2 * a.tensors
    try:
        import safetensors

        st = f"safetensors {safetensors.__version__}"
    except ImportError:
        st = "safetensors: not installed"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "torch sees no GPU"
    print(f"$ python bench/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}")
    print(f"# {a.tensors} bf16 tensors, {nbytes / 1e9:.2f} GB on {a.device}; best of {a.repeat}; nproc {os.cpu_count()}, "
          f"{gpu}; torch {torch.__version__}, {st}, tensorferry {tf.__version__}", flush=True)
    free = shutil.disk_usage(a.dir or tempfile.gettempdir()).free
    if free < 2 * nbytes + 2**30:
        print(f"skipped: {free / 1e9:.1f} GB free in {a.dir or tempfile.gettempdir()}, {(2 * nbytes + 2**30) / 1e9:.1f} GB needed")
        return 0
    print(f"{'':40s} {'blocked ms':>11s} {'total ms':>10s} {'1st ms':>8s} {'GB/s':>6s} {'%roof':>6s} {'blk/cp':>6s} "
          f"{'host MB':>8s} ok", flush=True)
    work = tempfile.mkdtemp(prefix="tf-ckpt-save-", dir=a.dir)
    done, bad = {}, 0  # rows failed or saved wrong bytes
    try:
        for name in ROWS:
            why = skipped(name, a.device)
            if why:
                print(f"{name:40s} {why}", flush=True)
                continue
            r = run_child([__file__, "--child", name, "--dir", work, "--repeat", str(a.repeat), "--device", a.device,
                           "--gb", str(a.gb), "--tensors", str(a.tensors)], deadline)
            if "error" in r:
                print(f"{name:40s} {r['error'][:140]}", flush=True)
                bad += r["error"].startswith("failed") and name not in PEERS  # a peer's failure is only shown
                continue
            bad += r["verified"] == "NO"
            done[name] = r
            roof, copy = done.get(RAW), done.get(PINNED)
            is_roof = name in (RAW, PINNED)
            pct = f"{100 * roof['total'] / r['total']:5.0f}%" if roof and not is_roof else "     -"
            ratio = f"{r['blocked'] / copy['total']:6.2f}" if copy and not is_roof else "     -"
            host = f"{r['host']:8.0f} " if r["host"] >= 0 else f"{'?':>8s} "  # ?: no /proc/self/clear_refs
            print(f"{name:40s} {r['blocked'] * 1e3:11.1f} {r['total'] * 1e3:10.1f} {r['first'] * 1e3:8.0f} "
                  f"{nbytes / r['total'] / 1e9:6.2f} {pct} {ratio} {host}{r['verified']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if bad:
        print(f"{bad} row(s) of tensorferry or the roofs failed, or saved wrong bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
