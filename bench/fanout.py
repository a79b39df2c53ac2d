"""Read once, fan out: one checkpoint loaded on 1, 2 and 4 gloo ranks (loopback) with
``tf.load(path, process_group=pg)`` against N independent loads.

    python bench/fanout.py [--gb 1] [--tensors 300] [--ranks 1 2 4] [--mbps 200] [--dir /tmp]
    python bench/fanout.py --device cuda --backend nccl --shards 8 --peers --mbps 0 --ranks 1 2 4 8   (GPUs)

One safetensors file of ``--tensors`` bf16 tensors, ``--gb`` GB in all, written once (it
stays in the page cache). For each number of ranks, every rank runs, in turn (each a
barrier, then the rank's own wall time; a row shows the slowest rank's):
  independent            tf.load(path, mmap=False) on every rank: each reads the whole file
  fanout                 tf.load(path, process_group=pg): each reads its part, then broadcasts
  independent, O_DIRECT  tf.load(path, direct=True): each reads the whole file from the drive
  fanout, O_DIRECT       tf.load(path, process_group=pg, direct=True): each its part, from the
                         drive (one virtual disk shared by all ranks: a real shared bottleneck)
Then with storage made the bottleneck by the library's read throttle (each batch of 8 MB
takes a turn on a link of --mbps MB/s), in two shapes:
  ..., link per rank     TENSORFERRY_FANOUT_READ_MBPS: every process has a link of its own
                         (a node per rank, each with its own path to storage): the read phase
                         of fanout scales as 1/N
  ..., shared link       and TENSORFERRY_FANOUT_READ_LINK=<one file>: one link for all
                         processes (one drive, one filesystem server, one bucket's quota):
                         N independent loads queue for it and take N times as long; fanout
                         reads the file once whatever N
  the independent loads there go through a process group of their own (new_group([r])), so
  that each reads the whole file through the same throttled reader.
Columns: bytes each rank read (the library's read_stats; min-max over ranks), their total,
the bytes read() returned to the rank (/proc/self/io rchar, counted by the kernel: a check
on the library's counter, headers included), the slowest rank's wall time, and the read
phase (the slowest rank's time in the reading step, timed by wrapping it; the rest is the
plan and the exchange). Every rank checks its result against a mapped tf.load. Each rank
makes one untimed tf.load(mmap=False) first: on a VM the first touch of fresh memory in a
process is slow (the host backs guest pages on demand), and no row should pay it.

On GPUs (--device cuda --backend nccl) the parts travel over NCCL, rank r loading onto GPU r,
and --peers adds the process-group loaders of InstantTensor (safe_open(files,
process_group=pg)) and fastsafetensors (SafeTensorsFileLoader(pg), files assigned to ranks
round-robin, get_tensor broadcasting each from its reader: it splits the reading by files,
hence --shards). Rows of a peer that is not installed say so.
"""

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time


def rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def make_file(folder, gb, count, shards):
    """Writes the checkpoint (one file, or ``shards`` files with an index); returns
    ``(path to load, [its .safetensors files], data bytes)``."""
    import torch

    import tensorferry as tf

    cols = 1024
    rows = max(1, int(gb * 1e9 / count / 2 / cols))
    g = torch.Generator().manual_seed(0)
    tree = {f"layers.{i}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16) for i in range(count)}
    data = sum(t.nbytes for t in tree.values())
    path = os.path.join(folder, "ckpt.safetensors")
    if shards > 1:
        written = tf.save(tree, path, max_shard_size=-(-data // shards))
        files = sorted(str(f) for f in written or [] if str(f).endswith(".safetensors"))
        files = files or sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        return folder, files, data
    tf.save(tree, path)
    return path, [path], data


def _synchronize(device):
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _peer_loaders(opts, rank, world_pg, device):
    """``{label: (load() -> {name: tensor}) or a reason it is skipped}``: the process-group
    loaders of peers, on the GPU (NCCL) only."""
    peers = {}
    if not opts["peers"]:
        return peers
    files = opts["files"]
    if not device.startswith("cuda"):
        return {"instanttensor (pg)": "skipped: GPU only", "fastsafetensors (pg, nogds)": "skipped: GPU only here"}
    try:
        import instanttensor

        def instant():
            import torch

            out = {}
            with instanttensor.safe_open(files, framework="pt", device=torch.cuda.current_device(),
                                         process_group=world_pg) as f:
                for name, tensor in f.tensors():
                    out[name] = tensor
            return out

        peers[f"instanttensor {getattr(instanttensor, '__version__', '')} (pg)".replace("  ", " ")] = instant
    except ImportError as e:
        peers["instanttensor (pg)"] = f"skipped: {e}"
    try:
        import fastsafetensors
        from fastsafetensors import SafeTensorsFileLoader

        def fst():
            world = opts["world"]
            loader = SafeTensorsFileLoader(world_pg, device, nogds=True)
            # fastsafetensors splits the reading by files: round-robin over the ranks.
            loader.add_filenames({r: files[r::world] for r in range(world)})
            fb = loader.copy_files_to_device()
            try:
                return {k: fb.get_tensor(k) for k in loader.get_keys()}
            finally:
                fb.close()
                loader.close()

        peers[f"fastsafetensors {fastsafetensors.__version__} (pg, nogds)"] = fst
    except ImportError as e:
        peers["fastsafetensors (pg, nogds)"] = f"skipped: {e}"
    return peers


def rank_main(rank, opts):
    import torch
    import torch.distributed as dist

    import tensorferry as tf
    from tensorferry import _fanout
    from tensorferry.dcp import ReadStats

    world, path, mbps, link = opts["world"], opts["path"], opts["mbps"], opts["link"]
    device = opts["device"]
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(opts["backend"], init_method=f"tcp://127.0.0.1:{opts['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    phases = []
    read = _fanout._read

    def timed_read(*args):
        start = time.perf_counter()
        try:
            return read(*args)
        finally:
            phases.append(time.perf_counter() - start)

    _fanout._read = timed_read
    reference = tf.load(path)
    # Untimed: the first touch of fresh memory in a new process is slow on a VM (the host
    # backs guest pages on demand: 2-4 s a GB here), and a GPU's context starts on first
    # use; one load first, so that no row pays either.
    warm = tf.load(path, mmap=False) if device == "cpu" else tf.load(path, device=device)
    del warm
    rows = {}

    def measure(label, fn, throttle=None):
        os.environ.pop(_fanout.READ_MBPS_ENV, None)
        os.environ.pop(_fanout.READ_LINK_ENV, None)
        if throttle:
            os.environ[_fanout.READ_MBPS_ENV] = str(mbps)
        if throttle == "shared":
            os.environ[_fanout.READ_LINK_ENV] = link
        stats = ReadStats()
        phases.clear()
        dist.barrier()
        before, start = rchar(), time.perf_counter()
        result = fn(stats)
        _synchronize(device)
        wall = time.perf_counter() - start
        after = rchar()
        for name in (next(iter(reference)), next(reversed(reference))):
            got = result[name]
            assert torch.equal(got.cpu() if torch.is_tensor(got) else torch.from_dlpack(tf.to_host(got)),
                               reference[name]), (label, name)
        del result
        rows[label] = {"data": stats.data if stats.files else None, "rchar": after - before, "wall": wall,
                       "read": phases[0] if phases else None}

    world_pg = dist.group.WORLD
    on = {} if device == "cpu" else {"device": device}
    if device == "cpu":
        measure("independent", lambda s: tf.load(path, mmap=False))
    else:
        measure("independent", lambda s: tf.load(path, **on))
    measure("fanout", lambda s: tf.load(path, process_group=world_pg, read_stats=s, **on))
    measure("independent, O_DIRECT", lambda s: tf.load(path, direct=True, **on))
    measure("fanout, O_DIRECT", lambda s: tf.load(path, process_group=world_pg, direct=True, read_stats=s, **on))
    for label, load in _peer_loaders(opts, rank, world_pg, device).items():
        if isinstance(load, str):
            rows[label] = {"skipped": load}
        else:
            measure(label, lambda s: load())
    if mbps:
        for shape in ("link per rank", "shared link"):
            throttle = "shared" if shape == "shared link" else "own"
            measure(f"independent, {shape}", lambda s: tf.load(path, process_group=own, read_stats=s, **on), throttle)
            measure(f"fanout, {shape}", lambda s: tf.load(path, process_group=world_pg, read_stats=s, **on), throttle)
    print(json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world, opts):
    opts = {**opts, "world": world, "port": free_port()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), json.dumps(opts)],
                              stdout=subprocess.PIPE, env=env, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode:
            raise SystemExit(f"rank {r} of {world} failed ({p.returncode})")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def mb(n):
    return f"{n / 1e6:9.1f}"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), json.loads(sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mbps", type=float, default=200.0, help="the throttled links' rate; 0: no throttled rows")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: rank r on GPU r")
    ap.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
    ap.add_argument("--shards", type=int, default=1, help="write the checkpoint as this many files with an index")
    ap.add_argument("--peers", action="store_true", help="add InstantTensor's and fastsafetensors' process-group "
                    "loaders (GPU only)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    folder = tempfile.mkdtemp(dir=args.dir, prefix="fanout-bench-")
    try:
        path, files, data = make_file(folder, args.gb, args.tensors, args.shards)
        size = sum(os.path.getsize(f) for f in files)
        opts = {"path": path, "files": files, "mbps": args.mbps, "link": os.path.join(folder, "storage-link"),
                "device": args.device, "backend": args.backend, "peers": args.peers}
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:  # no git (the GPU kit's machine): its header names the commit
            commit = "?"
        print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  commit {commit}  "
              f"{platform.node()}  {os.cpu_count()} cpus  python {platform.python_version()}")
        print(f"# {args.tensors} bf16 tensors, {data / 1e9:.3f} GB of data, {len(files)} file(s) of "
              f"{size / 1e9:.3f} GB (page cache warm); onto {args.device} over {args.backend}"
              + (f"; throttled rows: links of {args.mbps:g} MB/s, one per rank or one shared" if args.mbps else ""))
        print(f"# {'ranks':>5}  {'load':<38} {'MB read/rank (min-max)':>22} {'MB total':>9} {'rchar MB':>9} "
              f"{'wall s':>7} {'read s':>7}")
        for world in args.ranks:
            rows = run(world, opts)
            for label in rows[0]:
                per = [r[label] for r in rows]
                if "skipped" in per[0]:
                    print(f"  {world:>5}  {label:<38} {per[0]['skipped']}")
                    continue
                counted = [p["data"] if p["data"] is not None else p["rchar"] for p in per]
                read = max((p["read"] for p in per if p["read"] is not None), default=None)
                print(f"  {world:>5}  {label:<38} {mb(min(counted))}-{mb(max(counted)).strip():<10} "
                      f"{mb(sum(counted))} {mb(sum(p['rchar'] for p in per))} "
                      f"{max(p['wall'] for p in per):7.2f} {'' if read is None else f'{read:7.2f}':>7}")
        print("# MB read: the library's read_stats.data (O_DIRECT: whole 4096-byte blocks); loads without a "
              "process group and peers: rchar (reads that bypass read(), such as io_uring's, are not in it)")
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
