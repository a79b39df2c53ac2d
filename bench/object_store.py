"""Loading a checkpoint from object storage into host memory: tensorferry.load("s3://...")
beside boto3 (download_file, then safetensors.torch.load_file; get_object, then
safetensors.torch.load) and s3fs (cat, then safetensors.torch.load), on one object served
by a real S3 server on the loopback interface (s3s-fs, as the tests use), in one run, with
roofs measured in the same run: parallel ranged GETs of the same bytes with no parsing, by
curl (--parallel, into files in /dev/shm) and by Python threads (presigned URLs, one
connection per thread, each answer read straight into one preallocated buffer). "of roof"
compares with the faster roof.

    python bench/object_store.py [--mb 256] [--tensors 300] [--repeat 3]
                                 [--part-mb 8] [--concurrency 16] [--out FILE]

boto3 and s3fs are not dependencies of tensorferry: install them where the bench runs
(e.g. `pip install --target DIR boto3 s3fs` and PYTHONPATH=DIR). The server is the
binary of scripts/s3-server.sh (or TENSORFERRY_S3S_FS). Server and client share this
machine's cores: the figures are for loopback, not for a network.

Every result is checked against the saved tensors once (not timed). Times are the best of
--repeat; the server's file is in the page cache (read once before).
"""

import argparse
import concurrent.futures as cf
import http.client
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

import numpy as np

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
ACCESS_KEY, SECRET_KEY, BUCKET, KEY = "bench", "bench-secret", "bench", "model.safetensors"


def server_binary():
    given = os.environ.get("TENSORFERRY_S3S_FS")
    tools = os.path.join(REPO, "target", "tools", "bin", "s3s-fs")
    found = given or (tools if os.path.isfile(tools) else shutil.which("s3s-fs"))
    if not found or not os.path.isfile(found):
        sys.exit("no s3s-fs binary: bash scripts/s3-server.sh install")
    return found


def start_server(root):
    os.makedirs(os.path.join(root, BUCKET), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [server_binary(), "--host", "127.0.0.1", "--port", str(port), "--access-key", ACCESS_KEY,
         "--secret-key", SECRET_KEY, root],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("s3s-fs did not answer")
            time.sleep(0.02)


def make_tree(torch, mb, tensors):
    """~`tensors` bf16 tensors of ~`mb` MB in all, rows of 4096 elements."""
    rows = max(1, (mb << 20) // (tensors * 4096 * 2))
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.weight": torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
            for i in range(tensors)}


def boto_client(endpoint, boto3):
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                        config=Config(max_pool_connections=64))


def roof(endpoint, boto3, size, part, concurrency):
    """Parallel ranged GETs of the whole object into one buffer: bytes only."""
    client = boto_client(endpoint, boto3)
    url = client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": KEY}, ExpiresIn=3600)
    parsed = urllib.parse.urlsplit(url)
    target = parsed.path + "?" + parsed.query
    buf = bytearray(size)
    view = memoryview(buf)
    ranges = [(a, min(a + part, size)) for a in range(0, size, part)]

    def fetch(r):
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
        try:
            conn.request("GET", target, headers={"Range": f"bytes={r[0]}-{r[1] - 1}"})
            resp = conn.getresponse()
            assert resp.status == 206, resp.status
            got = 0
            while got < r[1] - r[0]:
                n = resp.readinto(view[r[0] + got:r[1]])
                assert n, "short answer"
                got += n
        finally:
            conn.close()

    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(fetch, ranges))
    return buf


def curl_roof(endpoint, boto3, size, part, concurrency, into):
    """The same ranged GETs by curl (C, no parsing, --parallel) into files in memory
    (``into``, a tmpfs folder); returns their bytes, joined (not timed by the caller's
    check)."""
    client = boto_client(endpoint, boto3)
    url = client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": KEY}, ExpiresIn=3600)
    os.makedirs(into, exist_ok=True)
    config = os.path.join(into, "curl.cfg")
    parts = [(a, min(a + part, size)) for a in range(0, size, part)]
    with open(config, "w") as f:
        for i, (a, b) in enumerate(parts):
            # "next": the range is an option of this transfer, not of all of them.
            f.write(("next\n" if i else "") + f'url = "{url}"\nrange = {a}-{b - 1}\noutput = "{into}/part-{i}"\n')
    subprocess.run(["curl", "-sS", "--no-progress-meter", "--fail", "--parallel", "--parallel-max", str(concurrency), "-K", config],
                   check=True)
    return lambda: b"".join(open(f"{into}/part-{i}", "rb").read() for i in range(len(parts)))


def check(torch, got, want):
    assert set(got) == set(want), "names differ"
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()

    import boto3
    import s3fs
    import safetensors.torch as st
    import torch

    import tensorferry as tf

    work = tempfile.mkdtemp(prefix="tf-object-bench-")
    proc, endpoint = start_server(os.path.join(work, "s3"))
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
           "TENSORFERRY_OBJECT_PART_BYTES": str(args.part_mb << 20),
           "TENSORFERRY_OBJECT_CONCURRENCY": str(args.concurrency)}
    os.environ.update(env)
    url = f"s3://{BUCKET}/{KEY}"
    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    try:
        tree = make_tree(torch, args.mb, args.tensors)
        tf.save(tree, url)
        size = os.path.getsize(os.path.join(work, "s3", BUCKET, KEY))
        with open(os.path.join(work, "s3", BUCKET, KEY), "rb") as f:
            while f.read(64 << 20):  # the server's file in the page cache
                pass
        client = boto_client(endpoint, boto3)
        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": endpoint,
                                                                                 "region_name": "us-east-1"})
        local = os.path.join(work, "download.safetensors")

        def boto_download():
            client.download_file(BUCKET, KEY, local)
            return st.load_file(local)

        def boto_get():
            return st.load(client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read())

        part = args.part_mb << 20
        shm = tempfile.mkdtemp(prefix="tf-object-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        methods = [
            ("roof: curl --parallel ranged GETs", lambda: curl_roof(endpoint, boto3, size, part, args.concurrency,
                                                                   shm), "curl"),
            ("roof: python threads ranged GETs", lambda: roof(endpoint, boto3, size, part, args.concurrency), "bytes"),
            ("tensorferry.load(s3://)", lambda: tf.load(url), True),
            ("boto3 download_file + st.load_file", boto_download, True),
            ("boto3 get_object + st.load", boto_get, True),
            ("s3fs cat + st.load", lambda: st.load(fs.cat(f"{BUCKET}/{KEY}")), True),
        ]
        say(f"# bench/object_store.py {' '.join(sys.argv[1:])}")
        say(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cores, python "
            f"{platform.python_version()}, torch {torch.__version__}, boto3 {boto3.__version__}, s3fs "
            f"{s3fs.__version__}, tensorferry {tf.__version__}")
        say(f"# object: {size / 1e6:.1f} MB, {len(tree)} bf16 tensors, s3s-fs on loopback; parts "
            f"{args.part_mb} MiB x {args.concurrency} (roof and tensorferry)")
        say(f"{'method':40} {'best s':>8} {'GB/s':>7} {'of roof':>8}   all repeats (s)")
        best_roof = None
        for name, run, checked in methods:
            if checked == "curl" and not shutil.which("curl"):
                say(f"{name:40} (no curl here)")
                continue
            times = []
            for i in range(args.repeat):
                start = time.perf_counter()
                out = run()
                times.append(time.perf_counter() - start)
                if i == 0:
                    if checked in ("curl", "bytes"):
                        got = out() if checked == "curl" else out
                        with open(os.path.join(work, "s3", BUCKET, KEY), "rb") as f:
                            assert bytes(got) == f.read(), "roof bytes differ"
                        del got
                    else:
                        check(torch, out, tree)
                del out
            best = min(times)
            if checked in ("curl", "bytes"):
                best_roof = min(best_roof or best, best)
            say(f"{name:40} {best:8.3f} {size / best / 1e9:7.2f} {best_roof / best:8.0%}   "
                + " ".join(f"{t:.3f}" for t in times))
        shutil.rmtree(shm, ignore_errors=True)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
