"""torch.distributed.checkpoint with three storage layers, on the same state dict in one run:
tensorferry's (tensorferry.dcp.TensorferryWriter/Reader), DCP's own FileSystemWriter/Reader
(torch.save pieces in one file per rank) and HuggingFaceStorageWriter/Reader (safetensors,
when the installed torch has it).

    python bench/dcp_compare.py [--gb 0.25] [--tensors 64] [--repeat 3] [--dir /tmp]

One process, no process group (DCP's no_dist path): this measures the storage layer, not
collectives. Each row: best save seconds (fsync included: every writer syncs its files by
default), best load seconds into preallocated tensors (page cache warm: the file was just
written; targets already touched), GB/s of each. Loads are checked for equality against the saved tensors once.
"""

import argparse
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from tensorferry.dcp import TensorferryReader, TensorferryWriter


def state_dict(gb, count):
    per = max(1, int(gb * 1e9 / count / 4))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(count)}


def layers():
    """(name, writer factory, reader factory) of every storage layer present."""
    out = [
        ("tensorferry", TensorferryWriter, TensorferryReader),
        ("FileSystem (torch.save)", dcp.FileSystemWriter, dcp.FileSystemReader),
    ]
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError:
        pass
    else:
        out.append(("HuggingFace (safetensors)", HuggingFaceStorageWriter, HuggingFaceStorageReader))
    return out


def best(fn, repeat, before=lambda: None):
    times = []
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.25)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    sd = state_dict(args.gb, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = tempfile.mkdtemp(dir=args.dir, prefix="dcp_compare_")
    print(f"torch {torch.__version__}, {len(sd)} float32 tensors, {nbytes / 1e9:.3f} GB, best of {args.repeat}, folder {root}")
    print(f"{'storage layer':28} {'save s':>8} {'save GB/s':>10} {'load s':>8} {'load GB/s':>10}")
    try:
        for name, writer, reader in layers():
            folder = os.path.join(root, name.split()[0])

            def save():
                shutil.rmtree(folder, ignore_errors=True)
                dcp.save(sd, storage_writer=writer(folder), no_dist=True)

            # Zeroed (so touched: no first-touch page faults in the timing) and zeroed again
            # before every load, so a reader that skipped an item fails the check below.
            target = {k: torch.zeros_like(v) for k, v in sd.items()}

            def clear():
                for t in target.values():
                    t.zero_()

            def load():
                dcp.load(target, storage_reader=reader(folder), no_dist=True)

            save_s = best(save, args.repeat)
            load_s = best(load, args.repeat, clear)
            assert all(torch.equal(target[k], sd[k]) for k in sd), f"{name}: loaded tensors differ"
            print(f"{name:28} {save_s:8.3f} {nbytes / save_s / 1e9:10.2f} {load_s:8.3f} {nbytes / load_s / 1e9:10.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
