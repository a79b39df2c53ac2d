"""Saving a state dict: how long the caller is blocked, and how long until the file is
complete, for tensorferry (blocking and non_blocking) beside torch.save,
safetensors.torch.save_file and torch.distributed.checkpoint (save and async_save), on the
same tensors in one run, with a raw write of the same bytes as the roof.

    python bench/checkpoint_save.py [--gb 0.5] [--tensors 300] [--repeat 3] [--device cpu]

Each row: blocked ms (the call's own time), total ms (until the data is on disk, fsync
included where the tool does it; torch.save and safetensors are followed by an fsync of the
file so that every row pays for durability), GB/s of the total.
"""

import argparse
import os
import shutil
import tempfile
import time

import torch

import tensorferry as tf
from compare import fsync_file as fsync_path  # noqa: E402 (bench/ is on sys.path when run)


def state_dict(gb, count, device):
    per = int(gb * 1e9 / count / 2)
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16).to(device) for i in range(count)}


def timed(save, repeat):
    """(best blocked seconds, best total seconds) over repeats; `save` returns a wait callable."""
    blocked, total = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        finish = save()
        blocked.append(time.perf_counter() - start)
        finish()
        total.append(time.perf_counter() - start)
    return min(blocked), min(total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    sd = state_dict(args.gb, args.tensors, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    work = tempfile.mkdtemp(prefix="tf-ckpt-", dir=os.environ.get("BENCH_DIR"))
    p = os.path.join(work, "ckpt")
    rows = []

    def raw():
        with open(p, "wb") as f:
            for t in sd.values():
                f.write(t.cpu().view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        return lambda: None

    rows.append(("raw write + fsync (roof)", timed(raw, args.repeat)))
    rows.append(("tensorferry save", timed(lambda: (tf.save(sd, p), lambda: None)[1], args.repeat)))
    rows.append(("tensorferry save non_blocking", timed(lambda: tf.save(sd, p, non_blocking=True).result, args.repeat)))

    def torch_save():
        torch.save(sd, p)
        fsync_path(p)
        return lambda: None

    rows.append(("torch.save + fsync", timed(torch_save, args.repeat)))
    try:
        import safetensors.torch as st

        def st_save():
            st.save_file({k: v.contiguous() for k, v in sd.items()}, p)
            fsync_path(p)
            return lambda: None

        rows.append(("safetensors.torch.save_file + fsync", timed(st_save, args.repeat)))
    except ImportError:
        rows.append(("safetensors: not installed", None))
    try:
        import torch.distributed.checkpoint as dcp

        folder = os.path.join(work, "dcp")

        def dcp_save():
            shutil.rmtree(folder, ignore_errors=True)
            dcp.save(sd, checkpoint_id=folder)
            return lambda: None

        def dcp_async():
            shutil.rmtree(folder, ignore_errors=True)
            fut = dcp.async_save(sd, checkpoint_id=folder)
            return fut.result

        rows.append(("torch.distributed.checkpoint.save", timed(dcp_save, args.repeat)))
        rows.append(("torch.distributed.checkpoint.async_save", timed(dcp_async, args.repeat)))
    except Exception as e:  # DCP needs what this PyTorch build may lack
        rows.append((f"DCP: {type(e).__name__}: {e}"[:80], None))
    shutil.rmtree(work, ignore_errors=True)

    print(f"# {args.tensors} bf16 tensors, {nbytes / 1e9:.2f} GB on {args.device}; best of {args.repeat}; "
          f"torch {torch.__version__}, tensorferry {tf.__version__}")
    print(f"{'':44s} {'blocked ms':>11s} {'total ms':>10s} {'GB/s':>7s}")
    for name, r in rows:
        if r is None:
            print(name)
            continue
        b, t = r
        print(f"{name:44s} {b * 1e3:11.1f} {t * 1e3:10.1f} {nbytes / t / 1e9:7.2f}")


if __name__ == "__main__":
    main()
