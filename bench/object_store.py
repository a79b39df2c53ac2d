"""Checkpoints in object storage, on one machine: loads, saves and host memory of
tensorferry beside its peers, against a real S3 server on the loopback interface (s3s-fs,
as the tests use), in one run, with every roof measured in the same run.

    PEERS=$(bash scripts/bench-peers.sh)
    PYTHONPATH=bindings/python/python:$PEERS python bench/object_store.py \\
        [--mb 1024] [--tensors 300] [--small 10000] [--small-kb 8] [--repeat 3] \\
        [--part-mb 8] [--concurrency 16] [--jobs a,b,save,memory] [--link-gbit G] [--out FILE]

where $PEERS holds the peers, which are not dependencies of tensorferry:
scripts/bench-peers.sh installs them into target/bench-peers (s3fs 2026.9.0 and boto3;
runai-model-streamer and runai-model-streamer-s3 without their dependencies, and humanize),
and prints that folder. torch, numpy and safetensors come from the environment. The
server is the binary of scripts/s3-server.sh (or TENSORFERRY_S3S_FS). --mb 64 runs the
whole bench in about a minute; the 1 GB run with --repeat 3 takes ~5 min on a quiet
machine. --jobs runs only some of the jobs below (a: load A, b: load B, save, memory).
The published s3s-fs streams each GET in 4 KiB reads and caps near 0.3-0.4 GB/s here, below
every client; TENSORFERRY_S3S_FS=$(bash scripts/s3-server.sh fast) runs the same server
built with 1 MiB reads, so that the clients, not the server, set the pace.

Jobs, each on one object stored once (by tensorferry, untimed) in the server's folder:

- load A: --mb MB in --tensors bf16 tensors; load B: --small tensors of --small-kb KiB.
  Rows: tensorferry.load("s3://...") to host; the Run:ai Model Streamer
  (SafetensorsStreamer.stream_file + get_tensors, to the host, its defaults); s3fs cat +
  safetensors.torch.load; boto3 download_file + safetensors.torch.load_file. Roofs: the
  same bytes in parallel ranged GETs into memory, no parsing: presigned URLs, one
  keep-alive socket per thread, each answer's body received straight into its place in
  one buffer; --part-mb parts, --concurrency in flight, by the threads of one process (one
  GIL) and by 4 worker processes of --concurrency/4 threads (forked once, when the bench
  starts, before any tree is built, so that the pages they share with this process are
  not copied on the next rows' writes; into shared memory mapped before the fork). A
  load's result is new memory, whose pages the kernel faults in as
  they are first written (about 20,000 faults for 83 MB), so the roofs receive into new
  memory too: the threads' into a new buffer, the processes' each into new private
  memory of its own (freed after the run, untimed). "of roof" compares with the
  faster of those two; a row above 100 % says the roof was mismeasured. One more roof
  row, the processes' buffer reused by every run (faulted in once, never again), errs
  high, and tensorferry's share of it is printed beside.
- save: tensorferry.save(d, "s3://...") of load A's tensors; roof: a multipart upload of
  the same bytes (the file tensorferry wrote, already in memory), parts PUT in parallel
  through presigned URLs (no serialisation, no payload hashing), by threads and by forked
  processes as for the load roofs; peer: safetensors.torch.save_file + boto3 upload_file
  (its threaded multipart upload).
  tensorferry's save runs twice: as configured by default (over plain HTTP its client
  signs each part's SHA-256, as boto3 does over HTTP), and with AWS_UNSIGNED_PAYLOAD=true
  (no body hashing, as the roof, and as tensorferry does by default over HTTPS).
- memory: in fresh child processes, the peak resident memory (VmHWM) added by
  tensorferry.load("s3://...") of load A's and load B's objects, onto the emulated device (device=
  "emu:0": the GETs land in the staging ring, 3 x 32 MiB by default; and with dtype="float16",
  cast a group of tensors at a time) and to the host.
  The emulated device's memory is ordinary memory of the process, so the device load's
  host overhead is its peak minus the checkpoint's size.

Times: --repeat rounds; in each round every row of a job runs once, the rows' order
rotated by one place per round (never all of one row first). The table gives the median
and best of the rounds and computes GB/s, "of roof" and the ratio to the fastest peer
from the medians (median row / median of the faster roof); "faults" is the median of the
minor page faults this process took in a round of the row (the process roofs' workers
take theirs in their own processes), and each load's table ends with tensorferry's per
round. Every result is checked against the saved tensors once, outside the timing. The
server's files are in the page cache (read once before). Server and client share this
machine's cores, so every figure is for loopback on this machine, not for a network: on
two cores the clients' CPU, not the transport, sets the pace. --link-gbit G (root,
iproute2) puts the server behind a link of G Gbit/s instead: a veth pair to a network
namespace of its own, each direction shaped by a token bucket (tc tbf). The roofs run over
the same link, so "of roof" then says how much of a link that is the bottleneck, as a NIC
is, each client fills.
"""

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
ACCESS_KEY, SECRET_KEY, BUCKET = "bench", "bench-secret", "bench"
LARGE, SMALL, SAVED = "large.safetensors", "small.safetensors", "saved.safetensors"
ROOF_THREADS = "roof: ranged GETs, {} MiB, {} threads"
ROOF_PROCESSES = "roof: ranged GETs, {} MiB, {} procs x {} thr"
ROOF_FRESH = "roof: ranged GETs, {} MiB, {} procs x {} thr, fresh pages"
SAVE_THREADS = "roof: multipart, {} MiB, {} threads"
SAVE_PROCESSES = "roof: multipart, {} MiB, {} procs x {} thr"
PROCESSES = 4  # worker processes of the process roofs
FAULTS = {}  # {row: [minor page faults of this process in each round]}, by timed_rounds


def server_binary():
    given = os.environ.get("TENSORFERRY_S3S_FS")
    tools = os.path.join(REPO, "target", "tools", "bin", "s3s-fs")
    found = given or (tools if os.path.isfile(tools) else shutil.which("s3s-fs"))
    if not found or not os.path.isfile(found):
        sys.exit("no s3s-fs binary: bash scripts/s3-server.sh install")
    return found


class Link:
    """A network link of ``gbit`` Gbit/s each way between this process and the server: a
    veth pair whose far end is in a network namespace of its own (where the server runs),
    each end's egress shaped by a token bucket (``tc tbf``). Needs root and iproute2.
    Without ``gbit``, the loopback interface, unshaped."""

    CLIENT, SERVER = "10.77.0.1", "10.77.0.2"

    def __init__(self, gbit):
        self.gbit, self.netns = gbit, None
        if not gbit:
            self.host, self.run = "127.0.0.1", []
            return
        self.netns = f"tf-bench-{os.getpid()}"
        self.host, self.run = self.SERVER, ["ip", "netns", "exec", self.netns]
        near, far = f"tfb{os.getpid() % 100000}a", f"tfb{os.getpid() % 100000}b"
        # A bucket of 2 ms at the rate (at least 1 MiB): veth hands over 64 KiB segments.
        burst = max(1 << 20, int(gbit * 1e9 / 8 * 0.002))
        shape = ["root", "tbf", "rate", f"{gbit}gbit", "burst", str(burst), "latency", "20ms"]
        for cmd in (["ip", "netns", "add", self.netns],
                    ["ip", "link", "add", near, "type", "veth", "peer", "name", far],
                    ["ip", "link", "set", far, "netns", self.netns],
                    ["ip", "addr", "add", f"{self.CLIENT}/30", "dev", near],
                    ["ip", "link", "set", near, "up"],
                    self.run + ["ip", "addr", "add", f"{self.SERVER}/30", "dev", far],
                    self.run + ["ip", "link", "set", far, "up"],
                    ["tc", "qdisc", "add", "dev", near] + shape,
                    self.run + ["tc", "qdisc", "add", "dev", far] + shape):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                self.close()
                sys.exit(f"--link-gbit: {' '.join(cmd)} failed (root and iproute2 needed): {done.stderr.strip()}")

    def describe(self, cores):
        if not self.gbit:
            return f"on loopback, sharing the {cores} cores with the client"
        return (f"in a network namespace of its own behind a veth pair shaped to {self.gbit:g} Gbit/s each way "
                f"(tc tbf), sharing the {cores} cores with the client")

    def close(self):
        if self.netns:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)  # the veth pair goes with it
            self.netns = None


def start_server(root, link):
    os.makedirs(os.path.join(root, BUCKET), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        link.run + [server_binary(), "--host", link.host, "--port", str(port), "--access-key", ACCESS_KEY,
                    "--secret-key", SECRET_KEY, root],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection((link.host, port), timeout=1).close()
            return proc, f"http://{link.host}:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("s3s-fs did not answer")
            time.sleep(0.02)


def make_tree(torch, count, elements, seed):
    """`count` bf16 tensors of `elements` elements each (rows of at most 4096)."""
    cols = min(elements, 4096)
    rows = max(1, elements // cols)
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16)
            for i in range(count)}


def boto_client(endpoint, boto3):
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                        config=Config(max_pool_connections=64))


class Connections:
    """One keep-alive HTTP connection per thread, to the server of a presigned URL."""

    def __init__(self, url):
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.local = threading.local()

    def get(self):
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return conn


def get_ranges(url, view, ranges, threads):
    """GETs each ``(start, end)`` of ``ranges`` of the presigned ``url`` into ``view`` (at
    the same offsets), ``threads`` at a time: each thread keeps one connection, writes the
    request, reads the answer's head and receives its body straight into its place
    (``recv_into``, GIL released). Bytes only: no parsing."""
    parsed = urllib.parse.urlsplit(url)
    request = f"GET {parsed.path}?{parsed.query} HTTP/1.1\r\nHost: {parsed.hostname}:{parsed.port}\r\n"
    local, opened = threading.local(), []

    def fetch(r):
        a, b = r
        sock = getattr(local, "sock", None)
        if sock is None:
            sock = local.sock = socket.create_connection((parsed.hostname, parsed.port), timeout=60)
            opened.append(sock)
        sock.sendall((request + f"Range: bytes={a}-{b - 1}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            got = sock.recv(65536)
            assert got, "connection closed"
            head += got
        head, body = head.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 206") and f"content-length: {b - a}\r".encode() in head.lower() + b"\r", head
        view[a:a + len(body)] = body
        got = len(body)
        while got < b - a:
            n = sock.recv_into(view[a + got:b])
            assert n, "short answer"
            got += n

    try:
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(fetch, ranges))
    finally:
        for sock in opened:
            sock.close()


def ranged_get_roof(client, key, size, part, concurrency):
    """Parallel ranged GETs of the whole object into one new buffer (mapped, faulted in as
    the answers land, as a load's result is), by threads of this process (one GIL)."""
    import mmap

    url = client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=3600)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    get_ranges(url, memoryview(buf), [(a, min(a + part, size)) for a in range(0, size, part)], concurrency)
    return buf


_SHARED = None  # the process roofs' buffer: shared memory mapped before their workers fork
_KEPT = []  # a worker's fresh buffers, kept until the next (untimed) release


def _get_share(url, ranges, threads):
    get_ranges(url, memoryview(_SHARED), ranges, threads)


def _get_fresh(url, size, ranges, threads, verify):
    """The worker's ranges received into new private memory (mapped, faulted in as the
    answers land, as a load's result is); with ``verify``, their CRC-32s."""
    import mmap

    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # only these ranges' pages are touched
    get_ranges(url, memoryview(buf), ranges, threads)
    _KEPT.append(buf)  # freed by the next release, untimed
    return [(a, zlib.crc32(buf[a:b])) for a, b in ranges] if verify else None


def _release(_):
    _KEPT.clear()
    time.sleep(0.02)  # so that every worker takes one of the release tasks


class Kept:
    """A fresh-pages roof's answer: ``release`` (called by :func:`timed_rounds`, untimed)
    frees the workers' buffers."""

    def __init__(self, roof):
        self.roof = roof

    def release(self):
        self.roof.pool.map(_release, range(4 * self.roof.processes), chunksize=1)


class Workers:
    """The process roofs' worker processes, forked once, when the bench starts: before any
    tree is built and any row has run, so that they share almost none of this process's
    memory. (A pool forked later, after load A's rows, shares the heap those rows left:
    every page of it the next rows write is then copied on that first write, which slows
    the loads and the peers' rows of the next job, and not the roofs, whose bytes land in
    the workers or in mapped memory.) ``capacity`` bytes of shared memory, mapped before
    the fork (:data:`_SHARED`), hold a reused roof's answers or an upload roof's bytes."""

    def __init__(self, capacity, processes):
        import mmap
        import multiprocessing

        global _SHARED
        _SHARED = mmap.mmap(-1, capacity)  # MAP_SHARED | MAP_ANONYMOUS: the workers write the parent's pages
        self.capacity, self.processes = capacity, processes
        self.pool = multiprocessing.get_context("fork").Pool(processes)

    def close(self):
        global _SHARED
        self.pool.terminate()
        self.pool.join()
        _SHARED.close()
        _SHARED = None


class ProcessRoof:
    """The same ranged GETs of an object of ``size`` bytes by the worker processes of
    ``workers`` (:class:`Workers`), of ``threads`` threads each (no GIL shared between
    them). ``run`` receives into the shared buffer mapped before the fork and reused by
    every run (so its pages are never faulted in again: a roof that errs high, as no load's
    result is memory faulted in before); ``run_fresh`` into new private memory in each
    worker, faulted in as the answers land, as a load's new result is (freed after the
    run, untimed)."""

    def __init__(self, workers, size, threads):
        assert size <= workers.capacity, "object larger than the workers' shared memory"
        self.pool, self.processes = workers.pool, workers.processes
        self.size, self.threads = size, threads

    def _jobs(self, client, key, part):
        url = client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=3600)
        ranges = [(a, min(a + part, self.size)) for a in range(0, self.size, part)]
        return url, [ranges[i::self.processes] for i in range(self.processes)]

    def run(self, client, key, part):
        url, shares = self._jobs(client, key, part)
        self.pool.starmap(_get_share, [(url, share, self.threads) for share in shares])
        return memoryview(_SHARED)[:self.size]

    def run_fresh(self, client, key, part, verify=False):
        url, shares = self._jobs(client, key, part)
        crcs = self.pool.starmap(_get_fresh, [(url, self.size, share, self.threads, verify) for share in shares])
        return [c for share in crcs for c in share] if verify else Kept(self)

    def verify_fresh(self, client, key, part, want):
        """One more (untimed) ``run_fresh``, its ranges' CRC-32s checked against ``want``."""
        crcs = self.run_fresh(client, key, part, verify=True)
        Kept(self).release()
        assert len(crcs) == -(-self.size // part), "roof ranges missing"
        for a, crc in crcs:
            assert crc == zlib.crc32(want[a:a + part]), f"roof bytes differ at {a}"


def put_parts(view, parts, threads):
    """PUTs each ``(number, presigned url, start, end)`` of ``parts``, the bytes
    ``view[start:end]``, ``threads`` at a time, one keep-alive connection per thread;
    returns their ``{"PartNumber", "ETag"}``."""
    conns = Connections(parts[0][1]) if parts else None

    def put(job):
        number, url, a, b = job
        parsed = urllib.parse.urlsplit(url)
        conn = conns.get()
        conn.request("PUT", parsed.path + "?" + parsed.query, body=view[a:b], headers={"Content-Length": str(b - a)})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, resp.status
        return {"PartNumber": number, "ETag": resp.getheader("ETag")}

    with cf.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(put, parts))


def multipart_roof(client, key, size, part, send):
    """A multipart upload of ``size`` bytes in memory: created, its parts (presigned URLs)
    handed to ``send`` (which PUTs them and returns their ETags), then completed."""
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    parts = [(i + 1, client.generate_presigned_url("upload_part", ExpiresIn=3600, Params={
        "Bucket": BUCKET, "Key": key, "UploadId": upload, "PartNumber": i + 1}), a, min(a + part, size))
        for i, a in enumerate(range(0, size, part))]
    done = sorted(send(parts), key=lambda p: p["PartNumber"])
    client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload, MultipartUpload={"Parts": done})


def _put_share(parts, threads):
    return put_parts(memoryview(_SHARED), parts, threads)


class ProcessUpload(ProcessRoof):
    """The multipart roof's PUTs by the worker processes of ``workers`` (no GIL shared
    between them), from ``data`` copied once into their shared memory."""

    def __init__(self, workers, data, threads):
        super().__init__(workers, len(data), threads)
        _SHARED[:len(data)] = data

    def send(self, parts):
        shares = self.pool.starmap(_put_share, [(parts[i::self.processes], self.threads) for i in range(self.processes)])
        return [p for share in shares for p in share]


def runai_load(url):
    """The Run:ai Model Streamer's load of one file to the host, as its docs show."""
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(url, device="cpu")
        for name, tensor in streamer.get_tensors():
            out[name] = tensor
    return out


def check_tree(torch, got, want):
    assert set(got) == set(want), "names differ"
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def timed_rounds(rows, repeat):
    """Runs each ``(name, run, check)`` of ``rows`` once per round, ``repeat`` rounds, the
    order rotated by one place per round; ``check(result)`` runs once, untimed, and so
    do ``result.release()`` (where it has one) and a ``sync`` after each run. Returns {name: [seconds, ...]}; each
    run's minor page faults in this process go to :data:`FAULTS`."""
    times = {name: [] for name, _, _ in rows}
    checked = set()
    for r in range(repeat):
        k = r % len(rows)
        for name, run, check in rows[k:] + rows[:k]:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            out = run()
            times[name].append(time.perf_counter() - start)
            FAULTS.setdefault(name, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            if name not in checked:
                check(out)
                checked.add(name)
            release = getattr(out, "release", None)
            if release is not None:
                release()  # untimed: a fresh-pages roof's pages given back
            del out
            os.sync()  # untimed: a row's written files (boto3's download) flushed before the next row
    return times


def table(say, title, size, times, roofs, tensorferry, peers, high=None):
    """One job's table: median, best, GB/s, of roof, vs the fastest peer (from medians).
    ``high`` names a roof row that errs high (not counted in "of roof", reported beside it)."""
    med = {name: statistics.median(t) for name, t in times.items()}
    roof = min(med[n] for n in roofs)
    fastest = min((med[n] for n in peers if n in med), default=None)
    say(f"## {title}: {size / 1e6:.1f} MB")
    say(f"{'row':54} {'median s':>9} {'best s':>8} {'GB/s':>6} {'of roof':>8} {'tf speed-up':>11} {'faults':>7}"
        "   rounds (s)")
    faults_of = {name: FAULTS.pop(name, [0]) for name in times}
    for name, t in times.items():
        faults = statistics.median(faults_of[name])
        note = ""
        if name not in roofs and name != high and med[name] < roof:
            note = "  (above the roof: roof mismeasured)"
        ratio = f"{med[name] / med[tensorferry]:10.2f}x" if name in peers else f"{'':11}"
        say(f"{name:54} {med[name]:9.3f} {min(t):8.3f} {size / med[name] / 1e9:6.2f} {roof / med[name]:8.0%} {ratio}"
            f" {faults:7.0f}   "
            + " ".join(f"{x:.3f}" for x in t) + note)
    if fastest is not None:
        say(f"tensorferry: {roof / med[tensorferry]:.0%} of roof, {fastest / med[tensorferry]:.2f}x the fastest peer")
    else:
        say(f"tensorferry: {roof / med[tensorferry]:.0%} of roof")
    if high in med:
        say(f"tensorferry: {med[high] / med[tensorferry]:.0%} of the roof that errs high ({high})")
    say(f"{tensorferry}, minor page faults of this process in each round: "
        + " ".join(str(n) for n in faults_of[tensorferry]))
    say()


def load_job(args, workers, client, fs, st, torch, tf, key, tree, work):
    size = os.path.getsize(os.path.join(work, "s3", BUCKET, key))
    with open(os.path.join(work, "s3", BUCKET, key), "rb") as f:
        want = f.read()  # and the server's file is in the page cache
    url = f"s3://{BUCKET}/{key}"
    part = args.part_mb << 20
    local = os.path.join(work, "download.safetensors")
    processes = ProcessRoof(workers, size, max(1, args.concurrency // PROCESSES))

    def boto_download():
        client.download_file(BUCKET, key, local)
        return st.load_file(local)

    def same_bytes(got):
        assert bytes(got) == want, "roof bytes differ"

    def same_tree(got):
        check_tree(torch, got, tree)

    rows = [
        (ROOF_THREADS.format(args.part_mb, args.concurrency),
         lambda: ranged_get_roof(client, key, size, part, args.concurrency), same_bytes),
        (ROOF_PROCESSES.format(args.part_mb, PROCESSES, args.concurrency // PROCESSES),
         lambda: processes.run(client, key, part), same_bytes),
        (ROOF_FRESH.format(args.part_mb, PROCESSES, args.concurrency // PROCESSES),
         lambda: processes.run_fresh(client, key, part), lambda _: processes.verify_fresh(client, key, part, want)),
        ("tensorferry.load(s3://)", lambda: tf.load(url), same_tree),
        ("runai SafetensorsStreamer (host)", lambda: runai_load(url), same_tree),
        ("s3fs cat + st.load", lambda: st.load(fs.cat(f"{BUCKET}/{key}")), same_tree),
        ("boto3 download_file + st.load_file", boto_download, same_tree),
    ]
    if args.skip_peers:
        rows = [row for row in rows if row[0].startswith("roof") or row[0].startswith("tensorferry")]
    times = timed_rounds(rows, args.repeat)
    if os.path.exists(local):
        os.remove(local)
    return size, times


def save_job(args, workers, client, st, torch, tf, tree, work):
    with open(os.path.join(work, "s3", BUCKET, LARGE), "rb") as f:
        data = f.read()  # the bytes tensorferry.save writes for `tree`
    saved = os.path.join(work, "s3", BUCKET, SAVED)
    view = memoryview(data)
    threads = max(1, args.concurrency // PROCESSES)
    processes = ProcessUpload(workers, data, threads)
    local = os.path.join(work, "upload.safetensors")
    part = args.part_mb << 20

    def peer():
        st.save_file(tree, local)
        client.upload_file(local, BUCKET, SAVED)

    def same_bytes(_):
        with open(saved, "rb") as f:
            assert f.read() == data, "saved bytes differ"

    def same_tree(_):
        check_tree(torch, st.load_file(saved), tree)

    rows = [
        (SAVE_THREADS.format(args.part_mb, args.concurrency),
         lambda: multipart_roof(client, SAVED, len(data), part, lambda p: put_parts(view, p, args.concurrency)),
         same_bytes),
        (SAVE_PROCESSES.format(args.part_mb, PROCESSES, threads),
         lambda: multipart_roof(client, SAVED, len(data), part, processes.send), same_bytes),
        ("tensorferry.save(s3://)", lambda: tf.save(tree, f"s3://{BUCKET}/{SAVED}"), same_bytes),
        ("tensorferry.save(s3://), unsigned payload", lambda: unsigned(lambda: tf.save(tree, f"s3://{BUCKET}/{SAVED}")),
         same_bytes),
        ("st.save_file + boto3 upload_file", peer, same_tree),
    ]
    times = timed_rounds(rows, args.repeat)
    os.remove(local)
    return len(data), times


def unsigned(run):
    """``run()`` with AWS_UNSIGNED_PAYLOAD=true: requests signed without hashing their body,
    as AWS's SDKs send them over HTTPS (and as the roof's presigned URLs do)."""
    os.environ["AWS_UNSIGNED_PAYLOAD"] = "true"
    try:
        return run()
    finally:
        del os.environ["AWS_UNSIGNED_PAYLOAD"]


def hwm_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_memory(device, dtype, url):
    """In a child process: the peak resident memory a load of ``url`` onto ``device`` adds
    (cast to ``dtype`` unless it is "-")."""
    import tensorferry as tf

    before = hwm_kib()
    start = time.perf_counter()
    out = tf.load(url, device=device, like="tensorferry", dtype=None if dtype == "-" else dtype)
    seconds = time.perf_counter() - start
    print(json.dumps({"before_kib": before, "after_kib": hwm_kib(), "seconds": seconds, "leaves": len(out)}))


def memory_job(say, objects, env):
    """Peak resident memory added by one load of each ``(url, size)`` of ``objects``, onto
    the emulated device and to the host, each in a fresh process."""
    say("## memory: peak resident memory (VmHWM) added by one load, each in a fresh process")
    say(f"{'load':52} {'object MB':>9} {'peak added MB':>13} {'minus object MB':>15} {'s':>6}")
    for url, size in objects:
        for device, dtype in (("emu:0", "-"), ("emu:0", "float16"), ("cpu", "-")):
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-memory", device, dtype, url],
                                 env=env, check=True, capture_output=True, text=True)
            got = json.loads(run.stdout.strip().splitlines()[-1])
            added = (got["after_kib"] - got["before_kib"]) * 1024
            cast = "" if dtype == "-" else f", dtype={dtype!r}"
            name = f"tensorferry.load({url.rsplit('/', 1)[-1]}, device={device!r}{cast})"
            say(f"{name:52} {size / 1e6:9.1f} {added / 1e6:13.1f} {(added - size) / 1e6:15.1f} {got['seconds']:6.2f}")
    say("(the emulated device's memory is ordinary memory of the process: for emu:0, peak minus the object is the")
    say(" host memory of the load itself; the staging ring is 3 x 32 MiB = 100.7 MB by default; a cast goes")
    say(" a group of tensors at a time, host memory two groups of 256 MiB and one group's cast)")
    say()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="load A's size (MiB of tensor data)")
    ap.add_argument("--tensors", type=int, default=300, help="load A's tensor count")
    ap.add_argument("--small", type=int, default=10000, help="load B's tensor count")
    ap.add_argument("--small-kb", type=int, default=8, help="load B's bytes per tensor (KiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=8, help="part size of the roofs (and of tensorferry, set alike)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (roofs and tensorferry)")
    ap.add_argument("--jobs", default="a,b,save,memory",
                    help="the jobs to run, comma-separated: a (load A), b (load B), save, memory")
    ap.add_argument("--skip-peers", action="store_true",
                    help="loads: only the roofs and tensorferry, alternated (steadier ratios on a noisy machine)")
    ap.add_argument("--link-gbit", type=float, default=0,
                    help="the server behind a link of this many Gbit/s each way (a shaped veth pair; root)")
    ap.add_argument("--child-memory", nargs=3, metavar=("DEVICE", "DTYPE", "URL"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child_memory:
        return child_memory(*args.child_memory)
    jobs = set(args.jobs.split(","))
    if not jobs or not jobs <= {"a", "b", "save", "memory"}:
        ap.error(f"--jobs takes a, b, save and memory, comma-separated: not {args.jobs!r}")

    import boto3
    import runai_model_streamer
    import s3fs
    import safetensors
    import safetensors.torch as st
    import torch

    import tensorferry as tf

    # Forked first, while this process holds little: see Workers. Room for load A's or load
    # B's object (tensor bytes and a header).
    workers = Workers(max(args.mb << 20, args.small * (args.small_kb << 10)) + (64 << 20), PROCESSES)
    work = tempfile.mkdtemp(prefix="tf-object-bench-")
    link = Link(args.link_gbit)
    try:
        proc, endpoint = start_server(os.path.join(work, "s3"), link)
    except BaseException:
        link.close()
        workers.close()
        raise
    os.environ.update({
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint, "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true",
        "TENSORFERRY_OBJECT_PART_BYTES": str(args.part_mb << 20),
        "TENSORFERRY_OBJECT_CONCURRENCY": str(args.concurrency),
        # The Run:ai streamer's documented settings for an S3-compatible server (path-style
        # addressing), its logs kept quiet; its concurrency and chunk size are its defaults.
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "RUNAI_STREAMER_LOG_LEVEL": "WARNING",
    })
    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    try:
        say(f"# bench/object_store.py {' '.join(sys.argv[1:])}")
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        say(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cores, python "
            f"{platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, boto3 "
            f"{boto3.__version__}, s3fs {s3fs.__version__}, runai-model-streamer "
            f"{_version('runai-model-streamer')}, tensorferry {tf.__version__} ({commit.stdout.strip()})")
        server = "s3s-fs with 1 MiB reads (scripts/s3-server.sh fast)" if "s3s-fs-1m" in server_binary() else "s3s-fs"
        say(f"# {server} {link.describe(os.cpu_count())}; roofs and tensorferry: parts "
            f"{args.part_mb} MiB x {args.concurrency} in flight; {args.repeat} rounds, rows rotated per round")
        say("# load average at the start (1, 5, 15 min): " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
        say()
        client = boto_client(endpoint, boto3)
        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY,
                               client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
        elements = (args.mb << 20) // (args.tensors * 2)
        large = make_tree(torch, args.tensors, elements, 0)
        tf.save(large, f"s3://{BUCKET}/{LARGE}")
        small = make_tree(torch, args.small, (args.small_kb << 10) // 2, 1)
        tf.save(small, f"s3://{BUCKET}/{SMALL}")
        peers = ["runai SafetensorsStreamer (host)", "s3fs cat + st.load", "boto3 download_file + st.load_file"]
        roofs = [ROOF_THREADS.format(args.part_mb, args.concurrency),
                 ROOF_FRESH.format(args.part_mb, PROCESSES, args.concurrency // PROCESSES)]
        reused = ROOF_PROCESSES.format(args.part_mb, PROCESSES, args.concurrency // PROCESSES)

        size = os.path.getsize(os.path.join(work, "s3", BUCKET, LARGE))
        size_b = os.path.getsize(os.path.join(work, "s3", BUCKET, SMALL))
        if "a" in jobs:
            _, times = load_job(args, workers, client, fs, st, torch, tf, LARGE, large, work)
            table(say, f"load A, {len(large)} bf16 tensors", size, times, roofs, "tensorferry.load(s3://)", peers,
                  reused)
        if "b" in jobs:
            _, times = load_job(args, workers, client, fs, st, torch, tf, SMALL, small, work)
            table(say, f"load B, {args.small} bf16 tensors of {args.small_kb} KiB", size_b, times, roofs,
                  "tensorferry.load(s3://)", peers, reused)
        del small
        if "save" in jobs:
            saved, times = save_job(args, workers, client, st, torch, tf, large, work)
            save_roofs = [SAVE_THREADS.format(args.part_mb, args.concurrency),
                          SAVE_PROCESSES.format(args.part_mb, PROCESSES, max(1, args.concurrency // PROCESSES))]
            table(say, f"save, load A's {len(large)} tensors", saved, times, save_roofs,
                  "tensorferry.save(s3://)", ["st.save_file + boto3 upload_file"])
        del large
        if "memory" in jobs:
            memory_job(say, [(f"s3://{BUCKET}/{LARGE}", size), (f"s3://{BUCKET}/{SMALL}", size_b)],
                       dict(os.environ))
        say("# load average at the end (1, 5, 15 min): " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    finally:
        proc.kill()
        proc.wait()
        link.close()
        workers.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def _version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
