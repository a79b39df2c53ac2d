"""torch.distributed.checkpoint with three storage layers, on the same state dict in one run:
tensorferry's (tensorferry.dcp.TensorferryWriter/Reader, TensorferryStager for async_save),
DCP's own FileSystemWriter/Reader (torch.save pieces in one file per rank) and
HuggingFaceStorageWriter/Reader (safetensors, when the installed torch has it).

    python bench/dcp_compare.py [--gb 1] [--tensors 64] [--repeat 5] [--dir /tmp]
                                [--device cpu|cuda[:N]] [--no-reshard]

Rows, each the MEDIAN of --repeat runs (min in brackets), in one process (DCP's no_dist
path: the storage layer, not collectives):
  save     dcp.save, fsync included (every writer syncs its files by default)
  async    the time dcp.async_save blocks the caller (staging: TensorferryStager for
           tensorferry, DCP's default stager for the others); the upload is awaited untimed
  load     dcp.load into preallocated, already touched tensors (page cache warm)
With --device cuda the state dict and the load targets live on that GPU (a training job's
state: the layers copy it to the host themselves), and every timed row ends with
torch.cuda.synchronize(); a layer that fails there prints its error in its row.
Then (unless --no-reshard) resharding, on the host: the checkpoint saved by one process is
loaded by 2 gloo ranks (loopback),
each holding a DTensor row shard (Shard(0)) of every tensor: the slowest rank's load time,
and the bytes each rank read against the bytes it needed (tensorferry: its reader's
read_stats; FileSystem: the rank's read() bytes from /proc/self/io; HuggingFace reads
through mmap, which no counter sees: not measured). Loads are checked for equality.
"""

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from tensorferry.dcp import TensorferryReader, TensorferryStager, TensorferryWriter

COLS = 1024


def state_dict(gb, count):
    rows = max(2, int(gb * 1e9 / count / 4 / COLS)) // 2 * 2
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(count)}


def layers():
    """(name, writer factory, reader factory, stager factory) of every layer present."""
    out = [
        ("tensorferry", TensorferryWriter, TensorferryReader, TensorferryStager),
        ("FileSystem", dcp.FileSystemWriter, dcp.FileSystemReader, None),
    ]
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError:
        pass
    else:
        out.append(("HuggingFace", HuggingFaceStorageWriter, HuggingFaceStorageReader, None))
    return out


def timed(fn, repeat, before=lambda: None):
    times = []
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


# ---- resharding: a rank of a 2-rank gloo group -----------------------------------------

def reshard_worker(name, rank, world, port, folder, gb, count, repeat):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = state_dict(gb, count)
    reader_cls = {n: r for n, _, r, _ in layers()}[name]
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    needed = sum(t.to_local().numel() * 4 for t in target.values())
    times, read = [], []
    for _ in range(repeat):
        for t in target.values():
            t.to_local().zero_()
        reader = reader_cls(folder)
        dist.barrier()
        before = rchar()
        start = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        times.append(time.perf_counter() - start)
        if name == "tensorferry":
            read.append(reader.read_stats.total)
        elif name == "FileSystem":
            read.append(rchar() - before)
    for k, t in target.items():
        rows = full[k].shape[0] // world
        assert torch.equal(t.to_local(), full[k][rank * rows:(rank + 1) * rows]), k
    got = f"{statistics.median(read)}" if read else "-"
    print(f"RESULT {statistics.median(times)} {needed} {got}", flush=True)
    dist.destroy_process_group()


def reshard(name, folder, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--reshard-worker", name, str(r), "2", str(port), folder,
                          str(args.gb), str(args.tensors), str(args.repeat)], stdout=subprocess.PIPE, text=True, env=env)
        for r in range(2)
    ]
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
        line = next(x for x in out.splitlines() if x.startswith("RESULT"))
        rows.append(line.split()[1:])
    slowest = max(float(r[0]) for r in rows)
    per_rank = "; ".join(
        f"rank {i}: read {int(float(r[2])) / 1e6:.1f} MB of {int(r[1]) / 1e6:.1f} MB needed ({float(r[2]) / int(r[1]):.3f}x)"
        if r[2] != "-" else f"rank {i}: needed {int(r[1]) / 1e6:.1f} MB, read not measurable (mmap)"
        for i, r in enumerate(rows)
    )
    return slowest, per_rank


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--device", default="cpu", help="where the state dict lives: cpu or cuda[:N]")
    parser.add_argument("--no-reshard", action="store_true", help="skip the 2-rank resharded loads")
    parser.add_argument("--reshard-worker", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.reshard_worker:
        name, rank, world, port, folder, gb, count, repeat = args.reshard_worker
        reshard_worker(name, int(rank), int(world), int(port), folder, float(gb), int(count), int(repeat))
        return

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sd = {k: v.to(device) for k, v in state_dict(args.gb, args.tensors).items()}
    sync()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = tempfile.mkdtemp(dir=args.dir, prefix="dcp_compare_")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, nproc {os.cpu_count()}, {mem:.0f} GiB, "
          f"commit {commit}, torch {torch.__version__}")
    extra = (f" --device {args.device}" if args.device != "cpu" else "") + (" --no-reshard" if args.no_reshard else "")
    print(f"$ python bench/dcp_compare.py --gb {args.gb} --tensors {args.tensors} --repeat {args.repeat}{extra}")
    print(f"{len(sd)} float32 tensors of {tuple(next(iter(sd.values())).shape)} on {device}, {nbytes / 1e9:.3f} GB; "
          f"median (min) of {args.repeat}; folder {root}")
    print(f"{'storage layer':12} {'save s':>15} {'async blocked s':>16} {'load s':>15} {'load 2 ranks s':>15}")
    results = {}
    try:
        for name, writer, reader, stager in layers():
            folder = os.path.join(root, name)

            def save():
                shutil.rmtree(folder, ignore_errors=True)
                dcp.save(sd, storage_writer=writer(folder), no_dist=True)
                sync()

            blocked = []

            def async_save():
                shutil.rmtree(folder, ignore_errors=True)
                kwargs = {"async_stager": stager()} if stager else {}
                start = time.perf_counter()
                response = dcp.async_save(sd, storage_writer=writer(folder), no_dist=True, **kwargs)
                blocked.append(time.perf_counter() - start)
                getattr(response, "upload_completion", response).result()

            target = {k: torch.zeros_like(v) for k, v in sd.items()}

            def clear():
                for t in target.values():
                    t.zero_()
                sync()

            def load():
                dcp.load(target, storage_reader=reader(folder), no_dist=True)
                sync()

            try:
                save_s = timed(save, args.repeat)
                for _ in range(args.repeat):
                    async_save()
                async_s = (statistics.median(blocked), min(blocked))
                load_s = timed(load, args.repeat, clear)
                assert all(torch.equal(target[k], sd[k]) for k in sd), f"{name}: loaded tensors differ"
            except Exception as e:  # a layer that cannot take this state dict (CUDA tensors, say)
                print(f"{name:12} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
                continue
            reshard_s, per_rank = reshard(name, folder, args) if not args.no_reshard else (float("nan"), "skipped")
            results[name] = (save_s, async_s, load_s, reshard_s)
            print(f"{name:12} {save_s[0]:7.3f} ({save_s[1]:5.3f}) {async_s[0]:8.3f} ({async_s[1]:5.3f}) "
                  f"{load_s[0]:7.3f} ({load_s[1]:5.3f}) {reshard_s:15.3f}", flush=True)
            if not args.no_reshard:
                print(f"{'':12} resharded 1 -> 2 ranks, bytes: {per_rank}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "tensorferry" not in results or len(results) < 2:
        print("no ratios: tensorferry or every peer failed")
        return
    ours = results["tensorferry"]
    for i, what in enumerate(["save", "async blocked", "load", "load 2 ranks"]):
        if i == 3 and args.no_reshard:
            continue
        peers = {n: (r[i][0] if isinstance(r[i], tuple) else r[i]) for n, r in results.items() if n != "tensorferry"}
        best = min(peers, key=peers.get)
        mine = ours[i][0] if isinstance(ours[i], tuple) else ours[i]
        print(f"ratio {what:14}: fastest peer {best} {peers[best]:.3f} s / tensorferry {mine:.3f} s = {peers[best] / mine:.2f}x")


if __name__ == "__main__":
    main()
