"""Read once, fan out: one checkpoint loaded on 1, 2 and 4 gloo ranks (loopback) with
``tf.load(path, process_group=pg)`` against N independent loads.

    python bench/fanout.py [--gb 1] [--tensors 300] [--ranks 1 2 4] [--mbps 200] [--dir /tmp]

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


def make_file(path, gb, count):
    import torch

    import tensorferry as tf

    cols = 1024
    rows = max(1, int(gb * 1e9 / count / 2 / cols))
    g = torch.Generator().manual_seed(0)
    tree = {f"layers.{i}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16) for i in range(count)}
    tf.save(tree, path)
    return sum(t.nbytes for t in tree.values())


def rank_main(rank, world, port, path, mbps, link):
    import torch
    import torch.distributed as dist

    import tensorferry as tf
    from tensorferry import _fanout
    from tensorferry.dcp import ReadStats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
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
    # backs guest pages on demand: 2-4 s a GB here); one load first, so that no row pays it.
    warm = tf.load(path, mmap=False)
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
        wall = time.perf_counter() - start
        after = rchar()
        for name in (next(iter(reference)), next(reversed(reference))):
            assert torch.equal(result[name], reference[name]), (label, name)
        del result
        rows[label] = {"data": stats.data if stats.files else None, "rchar": after - before, "wall": wall,
                       "read": phases[0] if phases else None}

    world_pg = dist.group.WORLD
    measure("independent", lambda s: tf.load(path, mmap=False))
    measure("fanout", lambda s: tf.load(path, process_group=world_pg, read_stats=s))
    measure("independent, O_DIRECT", lambda s: tf.load(path, direct=True))
    measure("fanout, O_DIRECT", lambda s: tf.load(path, process_group=world_pg, direct=True, read_stats=s))
    for shape in ("link per rank", "shared link"):
        throttle = "shared" if shape == "shared link" else "own"
        measure(f"independent, {shape}", lambda s: tf.load(path, process_group=own, read_stats=s), throttle)
        measure(f"fanout, {shape}", lambda s: tf.load(path, process_group=world_pg, read_stats=s), throttle)
    print(json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world, path, mbps):
    port = free_port()
    link = os.path.join(os.path.dirname(path), "storage-link")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(world), str(port), path, str(mbps), link],
                              stdout=subprocess.PIPE, env=env, text=True) for r in range(world)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode:
            raise SystemExit(f"rank {r} of {world} failed ({p.returncode})")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def mb(n):
    return f"{n / 1e6:9.1f}"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6]), sys.argv[7])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mbps", type=float, default=200.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    folder = tempfile.mkdtemp(dir=args.dir, prefix="fanout-bench-")
    path = os.path.join(folder, "ckpt.safetensors")
    try:
        data = make_file(path, args.gb, args.tensors)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  commit {commit}  "
              f"{platform.node()}  {os.cpu_count()} cpus  python {platform.python_version()}")
        print(f"# {args.tensors} bf16 tensors, {data / 1e9:.3f} GB of data, file {os.path.getsize(path) / 1e9:.3f} GB "
              f"(page cache warm); throttled rows: links of {args.mbps:g} MB/s, one per rank or one shared")
        print(f"# {'ranks':>5}  {'load':<30} {'MB read/rank (min-max)':>22} {'MB total':>9} {'rchar MB':>9} "
              f"{'wall s':>7} {'read s':>7}")
        for world in args.ranks:
            rows = run(world, path, args.mbps)
            for label in rows[0]:
                per = [r[label] for r in rows]
                counted = [p["data"] if p["data"] is not None else p["rchar"] for p in per]
                read = max((p["read"] for p in per if p["read"] is not None), default=None)
                print(f"  {world:>5}  {label:<30} {mb(min(counted))}-{mb(max(counted)).strip():<10} "
                      f"{mb(sum(counted))} {mb(sum(p['rchar'] for p in per))} "
                      f"{max(p['wall'] for p in per):7.2f} {'' if read is None else f'{read:7.2f}':>7}")
        print("# MB read: the library's read_stats.data (O_DIRECT: whole 4096-byte blocks); independent "
              "tf.load without a process group: rchar, it has no counter")
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
