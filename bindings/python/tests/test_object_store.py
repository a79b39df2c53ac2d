"""Checkpoints in object storage, against a real S3 server on the loopback interface:
``s3s-fs`` from crates.io (SigV4, ranged GETs, multipart uploads over a local folder),
started by the fixtures on a free port with fixed credentials (``_servers.py``) and
stopped after them.

Without the server's binary these tests skip with the reason (``bash
scripts/s3-server.sh install`` builds it); ``scripts/test.sh`` installs it and sets
``TENSORFERRY_REQUIRE_S3=1``, which makes its absence a failure.
"""

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from _servers import SECRET_KEY, S3Server, point_at, s3_binary_or_skip
from _trees import assert_same

import tensorferry as tf
from tensorferry import _dcp_io


@pytest.fixture(scope="module")
def server_binary():
    return s3_binary_or_skip()


@pytest.fixture(scope="module")
def shared_server(server_binary, tmp_path_factory):
    server = S3Server(server_binary, str(tmp_path_factory.mktemp("s3")))
    yield server
    server.stop()


@pytest.fixture
def s3(shared_server, monkeypatch):
    """The shared server, the client's environment pointing at it."""
    point_at(monkeypatch, shared_server)
    return shared_server


@pytest.fixture
def own_server(server_binary, tmp_path, monkeypatch):
    """A server of the test's own (it may be stopped; it logs every request to
    ``.log``), the environment pointing at it."""
    server = S3Server(server_binary, str(tmp_path / "s3"), log=str(tmp_path / "s3.log"))
    point_at(monkeypatch, server)
    yield server
    server.stop()


@pytest.fixture
def url(request):
    """A key prefix of the test's own in the bucket."""
    return f"s3://bucket/{request.node.name}/"


def _model(layers=3, salt=0.0, size=4096):
    return {
        "model": {f"layer.{i}.weight": np.arange(size, dtype=np.float32) + salt + i for i in range(layers)},
        "step": 7,
        "betas": (0.9, 0.999),
        "name": "run-1",
    }


def test_a_flat_dict_round_trips(s3, url):
    d = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 4), np.int64)}
    tf.save(d, url + "flat.safetensors")
    assert_same(tf.load(url + "flat.safetensors"), d)


def test_a_nested_tree_with_plain_values_round_trips(s3, url, state):
    tf.save(state, url + "model.safetensors")
    assert_same(tf.load(url + "model.safetensors"), state)
    assert_same(tf.load(url), state)  # the folder: its model.safetensors


def test_a_sharded_save_uploads_shards_then_the_index_and_loads_whole(s3, url):
    tree = _model(layers=4, size=8192)
    assert tf.save(tree, url, max_shard_size=40_000) is None  # as for files
    index = s3.file(f"{url[len('s3://bucket/'):]}model.safetensors.index.json")
    with open(index) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1
    # The folder holds the index and the shards it names, nothing else.
    assert set(os.listdir(os.path.dirname(index))) == shards | {"model.safetensors.index.json"}
    for path in (url, url + "model.safetensors", url + "model.safetensors.index.json"):
        assert_same(tf.load(path), tree)


def test_a_sharded_save_replaces_a_single_object_and_the_other_way_round(s3, url):
    first, second, third = _model(salt=1), _model(salt=2, size=8192), _model(salt=3)
    tf.save(first, url + "model.safetensors")
    tf.save(second, url + "model.safetensors", max_shard_size=40_000)
    folder = s3.file(url[len("s3://bucket/"):])
    assert "model.safetensors" not in os.listdir(folder)
    assert_same(tf.load(url), second)
    tf.save(third, url + "model.safetensors")
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    assert_same(tf.load(url), third)


def test_keys_load_only_the_matching_tensors(s3, url):
    tree = _model(layers=4)
    tf.save(tree, url + "model.safetensors")
    got = tf.load(url + "model.safetensors", keys=["model.layer.2.weight", "step"])
    assert_same(got, {"model": {"layer.2.weight": tree["model"]["layer.2.weight"]}, "step": 7})
    got = tf.load(url + "model.safetensors", keys="model.layer.*.weight")
    assert list(got["model"]) == [f"layer.{i}.weight" for i in range(4)]
    with pytest.raises(KeyError):
        tf.load(url + "model.safetensors", keys="nothing.here")


def test_keys_of_a_sharded_checkpoint(s3, url):
    tree = _model(layers=4, size=8192)
    tf.save(tree, url, max_shard_size=40_000)
    got = tf.load(url, keys=("model", "layer.3.weight"))
    assert_same(got, {"model": {"layer.3.weight": tree["model"]["layer.3.weight"]}})


def _ranges_read(log):
    """``(start, end)`` of every ranged GET in a server's log, in order."""
    with open(log) as f:
        return [(int(a), int(b) + 1) for a, b in re.findall(r'"range": "bytes=(\d+)-(\d+)"', f.read())]


def test_a_subset_fetches_only_its_byte_ranges(own_server):
    tree = {"keep": np.full(300_000, 1.0, np.float32), "skip": np.full(300_000, 2.0, np.float32)}
    tf.save(tree, "s3://bucket/m.safetensors")
    got = tf.load("s3://bucket/m.safetensors", keys="keep")
    assert list(got) == ["keep"]
    np.testing.assert_array_equal(got["keep"], tree["keep"])
    ranges = _ranges_read(own_server.log)
    size = os.path.getsize(own_server.file("m.safetensors"))
    data_start = size - 2_400_000
    assert ranges, "no ranged GET logged"
    # The header once (read for the names, and not asked for again by the load) and
    # "keep"'s bytes, none of "skip"'s (the last 1.2 MB).
    assert [r for r in ranges if r[0] == 0] == ranges[:1], ranges
    assert max(end for _, end in ranges) <= data_start + 1_200_000, ranges
    assert sum(end - start for start, end in ranges) <= (1 << 20) + 1_200_000, ranges  # the first GET's 1 MiB


def test_a_whole_load_asks_for_the_rest_of_the_object_without_waiting_for_the_header(own_server, monkeypatch):
    # A header (~8 KB) far longer than the first GET (64 bytes): the rest of the object is
    # asked for in parts laid from the first GET's end, never by a second GET for the rest
    # of the header followed by the data (a round trip more).
    monkeypatch.setenv("TENSORFERRY_OBJECT_HEADER_BYTES", "64")
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(64 << 10))
    tree = {f"t{i}": np.full(1000, float(i), np.float32) for i in range(100)}
    tf.save(tree, "s3://bucket/m.safetensors")
    got = tf.load("s3://bucket/m.safetensors")
    for k, v in tree.items():
        np.testing.assert_array_equal(got[k], v)
    assert got["t0"].ctypes.data % 64 == 0  # the data section starts 64-byte aligned
    size = os.path.getsize(own_server.file("m.safetensors"))
    data_start = size - 100 * 4000
    ranges = sorted(_ranges_read(own_server.log))
    assert ranges[0] == (0, 64), ranges
    # Parts laid from 64, the one that holds the header's end cut there (so that the
    # header is parsed as soon as it is in): not laid from the data's start.
    cuts = sorted({*range(64, size, 64 << 10), data_start, size})
    assert ranges[1:] == list(zip(cuts, cuts[1:])), ranges


@pytest.mark.parametrize("first_get", [1 << 20, 64], ids=["header-in-the-first-get", "header-past-the-first-get"])
def test_a_broken_header_fails_the_load_before_the_rest_of_the_object_arrives(own_server, proxied, monkeypatch, first_get):
    # 64 MiB of data behind a header of a plausible length that is not JSON (cut before its
    # closing brace): the load fails with the error a local load of the file gives, as soon
    # as the header is in, and the GETs for the rest of the object (asked for at once) are
    # cancelled. Counted by the proxy: the response bytes that reached the client (with one
    # part of 8 MiB in flight beside the first GET and the header's).
    monkeypatch.setenv("TENSORFERRY_OBJECT_HEADER_BYTES", str(first_get))
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "2")
    size = 64 << 20
    entries = {f"t{i}": {"dtype": "F32", "shape": [16], "data_offsets": [64 * i, 64 * i + 64]} for i in range(100)}
    header = json.dumps(entries).encode()[:-1]
    path = own_server.file("broken.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)
    with pytest.raises(tf.FormatError) as local:
        tf.load(path)
    proxy = proxied()
    with pytest.raises(tf.FormatError) as remote:
        tf.load("s3://bucket/broken.safetensors")
    assert str(remote.value) == str(local.value).replace(path, "s3://bucket/broken.safetensors")
    print(f"{proxy.responded} of {size} bytes came down")
    assert proxy.responded < size // 4, f"{proxy.responded} of {size} bytes came down"


def test_bfloat16_round_trips_with_torch(s3, url, torch):
    d = {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.arange(5)}
    tf.save(d, url + "bf16.safetensors")
    got = tf.load(url + "bf16.safetensors")
    assert got["w"].dtype == torch.bfloat16
    assert torch.equal(got["w"], d["w"]) and torch.equal(got["b"], d["b"])


def test_the_stored_object_is_what_a_local_save_writes_and_safetensors_reads(s3, url, tmp_path):
    numpy_st = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed")
    d = {"x": np.arange(1000, dtype=np.float32).reshape(10, 100), "y": np.arange(7, dtype=np.int32)}
    tf.save(d, url + "x.safetensors")
    local = str(tmp_path / "x.safetensors")
    tf.save(d, local)
    stored = s3.file(url[len("s3://bucket/"):] + "x.safetensors")
    with open(stored, "rb") as f, open(local, "rb") as g:
        assert f.read() == g.read()
    for name, array in numpy_st.load_file(stored).items():
        np.testing.assert_array_equal(array, d[name])


def test_metadata_comes_from_the_header_of_an_object_or_the_first_shard(s3, url):
    tf.save({"x": np.zeros(3)}, url + "one.safetensors", metadata={"run": "7"})
    assert tf.metadata(url + "one.safetensors") == {"run": "7"}
    tf.save(_model(size=8192), url + "many/", max_shard_size=40_000, metadata={"run": "8"})
    assert tf.metadata(url + "many/")["run"] == "8"


def test_device_dtype_and_out_work_as_for_files(s3, url, ml_dtypes):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.arange(3)}
    tf.save(tree, url + "m.safetensors")
    got = tf.load(url + "m.safetensors", device="emu:0", dtype="bfloat16")
    assert got["w"].device == "emu:0" and got["w"].dtype == "bfloat16"
    np.testing.assert_array_equal(tf.to_numpy(got)["w"].astype(np.float32), tree["w"])
    out = {"w": np.zeros((2, 3), np.float32), "n": np.zeros(3, np.int64)}
    tf.load(url + "m.safetensors", out=out)
    assert_same(out, tree)


@pytest.mark.parametrize("staging", ["auto", (4096, 2), "off"])
def test_tensors_on_a_device_are_saved_whatever_the_staging(s3, url, staging):
    tree = {"w": np.arange(1000, dtype=np.float32), "host": np.ones(3), "v": np.arange(7.0)}
    moved = tf.to_device({"w": tree["w"], "v": tree["v"]}, "emu:0")
    on_device = {"w": moved["w"], "host": tree["host"], "v": moved["v"]}
    tf.save(on_device, url + "dev.safetensors", staging=staging)
    assert_same(tf.load(url + "dev.safetensors", like="numpy"), tree)


_PEAK_RSS_OF_A_URL_SAVE = """
import sys, numpy as np, tensorferry as tf
url, staging = sys.argv[1], sys.argv[2]
staging = (8 << 20, 2) if staging == "ring" else staging
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) << 10
x = tf.to_device({"w": np.ones(32 << 20, np.float32)}, "emu:0")  # 128 MiB on the device
tf.save(tf.to_device({"w": np.ones(2 << 20, np.float32)}, "emu:0"), url, staging=staging)  # warmed
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                               # the peak resident size starts again from now
before = status("VmRSS")
tf.save(x, url, staging=staging)
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("staging, bounded", [("ring", True), ("off", False)])
def test_host_memory_of_a_device_save_to_s3_is_bounded_by_the_ring(s3, url, monkeypatch, staging, bounded):
    """Uploading 128 MiB from the emulated device grows the peak resident memory by the
    ring (2 x 8 MiB) and the parts in flight (2 x 5 MiB) plus slack, not by the tensors'
    size — and does without the ring, which shows that the measurement can tell."""
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "2")
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(5 << 20))
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_A_URL_SAVE, url + "big.safetensors", staging],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    if bounded:
        assert grown < 64 << 20, f"peak resident memory grew {grown >> 20} MiB"
    else:
        assert grown > 120 << 20, f"peak resident memory grew only {grown >> 20} MiB"
    np.testing.assert_array_equal(tf.load(url + "big.safetensors", like="numpy")["w"][-3:], 1.0)


def test_a_missing_object_is_file_not_found_naming_it(s3, url):
    with pytest.raises(FileNotFoundError) as e:
        tf.load(url + "absent.safetensors")
    assert "absent.safetensors" in str(e.value) and "no such object" in str(e.value)
    assert isinstance(e.value, tf.TensorferryError)


def test_a_missing_bucket_is_named(s3):
    with pytest.raises(FileNotFoundError, match="no such bucket"):
        tf.load("s3://no-such-bucket/model.safetensors")


def test_refused_credentials_are_a_permission_error(s3, url, monkeypatch):
    tf.save({"x": np.zeros(3)}, url + "x.safetensors")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(PermissionError, match="credentials were refused"):
        tf.load(url + "x.safetensors")
    with pytest.raises(PermissionError):
        tf.save({"x": np.ones(3)}, url + "x.safetensors")


_FORK_AFTER_A_LOAD = """
import os, signal, sys, time
import tensorferry as tf
url = sys.argv[1]
assert tf.load(url)["x"].tolist() == [0.0, 1.0, 2.0]  # the parent's client, kept
pid = os.fork()
if pid == 0:
    code = 1
    try:
        code = 0 if tf.load(url)["x"].tolist() == [0.0, 1.0, 2.0] else 2
    finally:
        os._exit(code)
deadline = time.monotonic() + 60
while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
if done[0] == 0:
    os.kill(pid, signal.SIGKILL)
    sys.exit("the forked child's load hung")
assert os.waitstatus_to_exitcode(done[1]) == 0, done
assert tf.load(url)["x"].tolist() == [0.0, 1.0, 2.0]  # the parent's client still serves
"""


def test_a_forked_child_loads_through_a_client_of_its_own(s3, url):
    # The parent's client (kept after its load) holds connections of the parent's runtime,
    # whose threads the child does not have: the child must build its own, not hang. In a
    # fresh interpreter: no other test's threads (JAX's) in the fork.
    tf.save({"x": np.arange(3.0)}, url + "x.safetensors")
    out = subprocess.run([sys.executable, "-c", _FORK_AFTER_A_LOAD, url + "x.safetensors"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_no_credentials_at_all_is_named(s3, url, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(PermissionError, match="no credentials"):
        tf.load(url + "x.safetensors")


def _paused_load(monkeypatch, tmp_path, target, hook="TENSORFERRY_TEST_OBJECT_PAUSE", **options):
    """Starts ``tf.load(target)`` on a thread that stops after the header (the loader's
    test hook; ``TENSORFERRY_TEST_OBJECT_HANDED``: once it handed its tree over, while the
    data arrives); returns ``(go, outcome)``: ``go()`` lets it go on and returns once it
    finished, ``outcome`` then holds ``("ok", tree)`` or ``("error", exc)``."""
    base = str(tmp_path / "pause")
    monkeypatch.setenv(hook, base)
    monkeypatch.setenv("TENSORFERRY_OBJECT_HEADER_BYTES", "64")
    outcome = []

    def run():
        try:
            outcome.append(("ok", tf.load(target, **options)))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            outcome.append(("error", e))

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while not os.path.exists(base + ".ready"):
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.01)

    def go():
        open(base + ".go", "w").close()
        thread.join(60)
        assert not thread.is_alive()

    return go, outcome


@pytest.mark.parametrize("device, dtype", [("cpu", None), ("emu:0", None), ("emu:0", "float16")])
def test_an_object_replaced_during_the_read_is_an_error_never_a_mix(s3, url, monkeypatch, tmp_path, device, dtype):
    target = url + "m.safetensors"
    tf.save({"w": np.full(100_000, 1.0, np.float32)}, target)
    go, outcome = _paused_load(monkeypatch, tmp_path, target, device=device, dtype=dtype)
    tf.save({"w": np.full(100_000, 2.0, np.float32)}, target)  # same size, other bytes
    go()
    kind, value = outcome[0]
    assert kind == "error", value
    assert "replaced while it was read" in str(value) and "m.safetensors" in str(value)
    monkeypatch.delenv("TENSORFERRY_TEST_OBJECT_PAUSE")
    np.testing.assert_array_equal(tf.load(target)["w"], 2.0)


@pytest.mark.parametrize("device, dtype", [("cpu", None), ("emu:0", None), ("emu:0", "float16")])
def test_the_server_stopped_mid_load_is_a_clear_error(own_server, monkeypatch, tmp_path, device, dtype):
    target = "s3://bucket/m.safetensors"
    tf.save({"w": np.ones(200_000, np.float32)}, target)
    go, outcome = _paused_load(monkeypatch, tmp_path, target, device=device, dtype=dtype)
    own_server.stop()
    started = time.monotonic()
    go()
    kind, value = outcome[0]
    assert kind == "error", value
    assert isinstance(value, ConnectionError) and "could not be reached" in str(value)
    assert time.monotonic() - started < 30


def _spy_on_torch_results(monkeypatch):
    """The ``promised`` flag of each call that makes PyTorch tensors of native ones."""
    from tensorferry import _frameworks

    calls = []
    real = _frameworks._torch_from_native_many

    def spy(tensors, order=False, promised=False):
        calls.append(promised)
        return real(tensors, order, promised)

    monkeypatch.setattr(_frameworks, "_torch_from_native_many", spy)
    return calls


def _until(condition, what):
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_torch_load_makes_its_tensors_while_the_bytes_arrive_and_returns_once_all_are_in(
        s3, url, monkeypatch, tmp_path, torch):
    target = url + "m.safetensors"
    want = {"model": {f"w{i}": torch.full((2000,), float(i)) for i in range(40)}, "step": 3}
    tf.save(want, target)
    calls = _spy_on_torch_results(monkeypatch)
    go, outcome = _paused_load(monkeypatch, tmp_path, target, hook="TENSORFERRY_TEST_OBJECT_HANDED")
    # The loader holds its data back: the tensors are made all the same, ahead of it ...
    _until(lambda: calls, "no PyTorch tensors were made while the data was held back")
    assert calls == [True]
    time.sleep(0.3)
    assert outcome == []  # ... and none is handed out before it is in
    go()
    kind, got = outcome[0]
    assert kind == "ok", got
    assert_same(got, want)


def test_bytes_that_stop_arriving_after_the_tensors_were_made_fail_the_load_handing_nothing_out(
        own_server, proxied, monkeypatch, tmp_path, torch):
    target = "s3://bucket/m.safetensors"
    tf.save({"w": torch.ones(2 << 20)}, target)  # 8 MiB
    # One GET for the data at a time, each answer a second late: 8 parts take 8 s, the
    # server is stopped after the first.
    _retrying(monkeypatch, 0)
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(1 << 20))
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "2")
    proxied(delays=100, delay=1.0)
    calls = _spy_on_torch_results(monkeypatch)
    go, outcome = _paused_load(monkeypatch, tmp_path, target, hook="TENSORFERRY_TEST_OBJECT_HANDED")
    _until(lambda: calls, "no PyTorch tensors were made while the data was held back")
    own_server.stop()
    go()
    kind, value = outcome[0]
    assert kind == "error", value
    assert isinstance(value, ConnectionError) and "m.safetensors" in str(value), value
    assert calls == [True]


def test_an_interruption_while_the_tensors_are_made_stops_the_download_at_once(
        own_server, proxied, monkeypatch, torch):
    target = "s3://bucket/m.safetensors"
    tf.save({"w": torch.ones(2 << 20)}, target)  # 8 MiB: 8 s through the proxy (as above)
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(1 << 20))
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "2")
    proxy = proxied(delays=100, delay=1.0)
    from tensorferry import _frameworks

    def interrupted(tensors, order=False, promised=False):
        assert promised
        raise KeyboardInterrupt  # as Ctrl-C would, while the bytes still arrive

    monkeypatch.setattr(_frameworks, "_torch_from_native_many", interrupted)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        tf.load(target)
    assert time.monotonic() - started < 5  # the GETs were stopped, not waited for
    time.sleep(0.3)
    asked = proxy.requested
    time.sleep(2.5)  # a GET of the data goes up every second until the last one
    assert proxy.requested == asked  # nothing more is asked for


def test_a_save_killed_mid_upload_leaves_the_previous_object_whole(s3, url, tmp_path):
    target = url + "big.safetensors"
    previous = {"w": np.full(1_000_000, 3.0, np.float32)}
    tf.save(previous, target)
    before = {os.path.join(d, f) for d, _, fs in os.walk(s3.root) for f in fs}
    # A child process uploads 48 MiB in 5 MiB parts, one at a time; it is killed as soon
    # as the server holds a part of it.
    script = textwrap.dedent(f"""
        import numpy as np, tensorferry as tf
        tf.save({{"w": np.full(12 << 20, 4.0, np.float32)}}, {target!r})
    """)
    env = dict(os.environ, TENSORFERRY_OBJECT_CONCURRENCY="1", TENSORFERRY_OBJECT_PART_BYTES=str(5 << 20))
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    try:
        while True:
            now = {os.path.join(d, f) for d, _, fs in os.walk(s3.root) for f in fs}
            if now - before:
                break
            assert child.poll() is None, "the save finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert_same(tf.load(target), previous)


def _files(root):
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def test_a_save_that_fails_mid_upload_leaves_the_previous_object_whole(own_server, monkeypatch):
    target = "s3://bucket/big.safetensors"
    previous = {"w": np.full(1_000_000, 3.0, np.float32)}
    tf.save(previous, target)
    before = _files(own_server.root)
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "1")
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(5 << 20))
    outcome = []

    def save():
        try:
            tf.save({"w": np.full(24 << 20, 4.0, np.float32)}, target)  # 96 MiB, 20 parts
            outcome.append(("ok", None))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            outcome.append(("error", e))

    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.monotonic() + 60
    while not _files(own_server.root) - before:
        assert thread.is_alive(), "the save finished before the server could be stopped"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    own_server.stop()
    thread.join(60)
    kind, value = outcome[0]
    assert kind == "error" and isinstance(value, ConnectionError), value
    own_server.start()
    assert_same(tf.load(target), previous)


# ---- loads streamed onto a device through the staging ring -----------------------------------


def test_a_checkpoint_streams_onto_a_device_whole_and_sharded(s3, url):
    tree = _model(layers=4, size=8192)
    tf.save(tree, url + "one/model.safetensors")
    tf.save(tree, url + "many/", max_shard_size=40_000)
    for where in (url + "one/", url + "many/"):
        got = tf.load(where, device="emu:0", staging=(4096, 2))
        for name, w in got["model"].items():
            assert type(w) is tf.Tensor and w.device == "emu:0", name
        assert_same(tf.to_numpy(got), tree)


def test_a_subset_streams_onto_a_device_fetching_only_its_byte_ranges(own_server):
    tree = {"keep": np.full(300_000, 1.0, np.float32), "skip": np.full(300_000, 2.0, np.float32)}
    tf.save(tree, "s3://bucket/m.safetensors")
    got = tf.load("s3://bucket/m.safetensors", device="emu:0", keys="keep", staging=(65536, 2))
    assert list(got) == ["keep"] and got["keep"].device == "emu:0"
    np.testing.assert_array_equal(got["keep"].numpy(), tree["keep"])
    size = os.path.getsize(own_server.file("m.safetensors"))
    assert max(end for _, end in _ranges_read(own_server.log)) <= size - 1_200_000  # none of "skip"'s
    sharded = _model(layers=4, size=8192)
    tf.save(sharded, "s3://bucket/many/", max_shard_size=40_000)
    got = tf.load("s3://bucket/many/", device="emu:0", keys=["model.layer.0.weight", "model.layer.3.weight"])
    assert_same(tf.to_numpy(got), {"model": {k: sharded["model"][k] for k in ("layer.0.weight", "layer.3.weight")}})


def test_a_device_load_asks_for_each_byte_once_its_next_chunks_gets_begun_ahead(own_server, monkeypatch):
    """Through a ring of 1 MiB chunks, in GETs of 256 KiB, two at once: the first two GETs
    of each next chunk are asked for while the chunk before arrives, and their answers are
    the ones drained (no range asked for twice, none left out)."""
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(256 << 10))
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "2")
    tree = {"w": np.arange(2 << 20, dtype=np.float32)}  # 8 MiB: 8 chunks
    tf.save(tree, "s3://bucket/m.safetensors")
    got = tf.load("s3://bucket/m.safetensors", device="emu:0", staging=(1 << 20, 2))
    np.testing.assert_array_equal(tf.to_numpy(got)["w"], tree["w"])
    ranges = sorted(_ranges_read(own_server.log))
    size = os.path.getsize(own_server.file("m.safetensors"))
    first = ranges[0][1]
    data = [r for r in ranges if r[0] >= first]
    assert all(a[1] == b[0] for a, b in zip(data, data[1:])), data  # disjoint, no gap
    assert (data[0][0], data[-1][1]) == (first, size), (first, data[0], data[-1], size)


_PEAK_RSS_OF_A_URL_LOAD = """
import sys, tensorferry as tf
url, how = sys.argv[1], sys.argv[2]
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) << 10
tf.load(url, device="emu:0", staging=(1 << 20, 2))  # every path warmed once (pools, runtime)
tf.to_device(tf.load(url), "emu:0")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                               # the peak resident size starts again from now
before = status("VmRSS")
if how == "streamed":
    got = tf.load(url, device="emu:0", staging=(8 << 20, 2))
else:
    got = tf.to_device(tf.load(url), "emu:0")
assert got["w"].device == "emu:0"
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("how", ["streamed", "through the host"])
def test_host_memory_of_a_device_load_from_s3_is_bounded_by_the_ring(s3, url, how):
    """Loading 128 MiB onto the emulated device (whose memory is host memory: 128 MiB of
    the growth) grows the peak resident memory by the device's share plus the ring (2 x 8
    MiB), the first GET and slack — and by a whole second copy through the host, which shows
    that the measurement tells the two apart."""
    size = 128 << 20
    target = url + "big.safetensors"
    tf.save({"w": np.ones(size // 4, np.float32)}, target)
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_A_URL_LOAD, target, how],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    if how == "streamed":
        assert grown < size + (48 << 20), f"peak resident memory grew {grown >> 20} MiB"
    else:
        assert grown > size + (96 << 20), f"peak resident memory grew only {grown >> 20} MiB"


# ---- loads cast onto a device (dtype=), a group of tensors at a time ------------------------


@pytest.mark.parametrize("where", ["one/model.safetensors", "many/"], ids=["whole", "sharded"])
def test_a_cast_load_onto_a_device_comes_in_groups_whole_and_sharded(s3, url, monkeypatch, where):
    tree = _model(layers=8, size=8192)  # 32 KiB a tensor
    tf.save(tree, url + "one/model.safetensors")
    tf.save(tree, url + "many/", max_shard_size=80_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", str(70_000))  # two tensors a group
    got = tf.load(url + where, device="emu:0", dtype="float16")
    assert {w.device for w in got["model"].values()} == {"emu:0"}
    expected = dict(tree, model={k: v.astype(np.float16) for k, v in tree["model"].items()})
    assert_same(tf.to_numpy(got), expected)
    got = tf.load(url + where, device="emu:0", dtype="float16", keys=["model.layer.1.*", "model.layer.6.*"])
    assert_same(tf.to_numpy(got), {"model": {k: expected["model"][k] for k in ("layer.1.weight", "layer.6.weight")}})


def test_a_cast_load_of_tied_tensors_reads_each_once_under_its_stored_name(s3, url, monkeypatch):
    """A tensor under two names (a head tied to the embedding) is stored once, under one
    name; the other is in no header. Loaded whole or alone, sharded, in groups of one
    tensor, it comes back as one tensor under both names."""
    embedding = np.arange(5000, dtype=np.float32)
    tf.save({"embed": embedding, "mid": np.ones(5000, np.float32), "head": embedding}, url, max_shard_size=25_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", "1")
    got = tf.load(url, device="emu:0", dtype="float16")
    assert list(got) == ["embed", "mid", "head"] and got["head"] is got["embed"]
    np.testing.assert_array_equal(tf.to_numpy(got)["head"], embedding.astype(np.float16))
    alone = tf.load(url, device="emu:0", dtype="float16", keys="head")
    assert list(alone) == ["head"]
    np.testing.assert_array_equal(tf.to_numpy(alone)["head"], embedding.astype(np.float16))


@pytest.mark.parametrize("device", ["cpu", "emu:0"])
@pytest.mark.parametrize("where", ["one.safetensors", "many/"], ids=["whole", "sharded"])
def test_a_subset_of_a_tied_name_alone_fetches_the_tensor_it_names(s3, url, device, where):
    """keys= naming only the tied name (no header lists it) fetches the stored tensor's
    bytes: the result is that tensor, never None."""
    embedding = np.arange(5000, dtype=np.float32)
    tf.save({"embed": embedding, "mid": np.ones(5000, np.float32), "head": embedding}, url + where, max_shard_size=25_000)
    got = tf.load(url + where, keys="head", device=device)
    assert list(got) == ["head"] and got["head"] is not None
    np.testing.assert_array_equal(tf.to_numpy(got)["head"], embedding)
    both = tf.load(url + where, keys=["head", "mid"], device=device)
    assert list(both) == ["mid", "head"]
    np.testing.assert_array_equal(tf.to_numpy(both)["mid"], 1.0)


def test_a_shard_replaced_during_a_cast_load_is_an_error_never_a_mix(s3, url, monkeypatch, tmp_path):
    """The first group's load stops after its header; meanwhile the second shard is
    replaced by its counterpart of another save of the same layout (other values): the
    load must fail, not return the first shard's old values beside the second's new ones."""
    tf.save(_model(layers=4, size=8192), url + "a/", max_shard_size=70_000)
    tf.save(_model(layers=4, size=8192, salt=100.0), url + "b/", max_shard_size=70_000)
    shards, others = ([f for f in sorted(os.listdir(s3.file(url[len("s3://bucket/"):] + d))) if f.endswith(".safetensors")]
                      for d in ("a", "b"))
    assert len(shards) == len(others) >= 2, shards
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", str(40_000))
    go, outcome = _paused_load(monkeypatch, tmp_path, url + "a/", device="emu:0", dtype="float16")
    replaced = _native_object_bytes(url + "b/" + others[-1])
    tf._native.put(url + "a/" + shards[-1], replaced)
    go()
    kind, value = outcome[0]
    assert kind == "error", value
    # Its pinned ETag or its save id says the shard is another save's.
    other_save = isinstance(value, tf.FormatError) or "replaced while it was read" in str(value)
    assert other_save and shards[-1] in str(value), value


@pytest.mark.parametrize("shard", ["../secret/m.safetensors", "/abs.safetensors", ".."])
def test_a_cast_load_reads_no_shard_outside_the_index_folder(own_server, shard):
    tf.save({"w": np.ones(4, np.float32)}, "s3://bucket/secret/m.safetensors")
    index = json.dumps({"metadata": {}, "weight_map": {"w": shard}}).encode()
    tf._native.put("s3://bucket/run/model.safetensors.index.json", index)
    time.sleep(0.2)  # the server's log of the save is written
    before = os.path.getsize(own_server.log)
    with pytest.raises(tf.FormatError, match="is not a file name in the index's folder"):
        tf.load("s3://bucket/run/", device="emu:0", dtype="float16")
    time.sleep(0.2)
    with open(own_server.log) as f:
        f.seek(before)
        asked = re.findall(r"uri: (/bucket/\S+),", f.read())
    assert asked and not [u for u in asked if not u.startswith("/bucket/run/")], asked


@pytest.mark.parametrize("how", [{}, {"device": "emu:0", "dtype": "float16"}], ids=["load", "cast_load"])
@pytest.mark.parametrize("metadata, shard, refusal", [
    ({}, "other.safetensors.index.json", "is an index, not a safetensors file"),
    ({"tensorferry.save": 5}, "m.safetensors", "metadata.tensorferry.save must be a string"),
], ids=["an_index_as_its_shard", "a_save_id_not_a_string"])
def test_an_index_the_native_reader_refuses_is_refused_by_a_cast_load_too(s3, url, how, metadata, shard, refusal):
    tf.save({"w": np.ones(4, np.float32)}, url + "m.safetensors")
    other = json.dumps({"metadata": {}, "weight_map": {"w": "m.safetensors"}}).encode()
    tf._native.put(url + "other.safetensors.index.json", other)
    index = json.dumps({"metadata": metadata, "weight_map": {"w": shard}}).encode()
    tf._native.put(url + "model.safetensors.index.json", index)
    with pytest.raises(tf.FormatError, match=refusal):
        tf.load(url + "model.safetensors.index.json", **how)


def test_a_sharded_checkpoint_saved_again_during_a_cast_load_is_an_error_never_a_mix(s3, url, monkeypatch, tmp_path):
    """A whole new save (new shards, then a new index) lands while the first group's load
    waits: the load fails, never returns old and new tensors together."""
    tf.save(_model(layers=4, size=8192), url, max_shard_size=70_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", str(40_000))
    go, outcome = _paused_load(monkeypatch, tmp_path, url, device="emu:0", dtype="float16")
    tf.save(_model(layers=4, size=8192, salt=100.0), url, max_shard_size=70_000)
    go()
    kind, value = outcome[0]
    assert kind == "error", value
    # The save removes the shards it replaced: the error names the one the load still wanted
    # (were it kept, its pinned ETag or the index's would say "replaced").
    assert isinstance(value, (tf.FormatError, FileNotFoundError)) and ".safetensors" in str(value), value


def _native_object_bytes(target):
    return _dcp_io.read_small_file(target, 1 << 40)


def _peak_rss_growth(script, target, group_mib):
    """How much the peak resident memory of ``script``, run on ``target`` in a process of
    its own with groups of ``group_mib`` MiB, grew (the number it prints last)."""
    env = dict(os.environ, TENSORFERRY_CAST_GROUP_BYTES=str(group_mib << 20))
    out = subprocess.run([sys.executable, "-c", script, target], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    print(f"peak resident memory grew {grown >> 20} MiB")
    return grown


_PEAK_RSS_OF_A_CAST_LOAD = """
import sys, tensorferry as tf
url = sys.argv[1]
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) << 10
tf.load(url, device="emu:0", dtype="float16")  # every path warmed once (pools, runtime)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                               # the peak resident size starts again from now
before = status("VmRSS")
got = tf.load(url, device="emu:0", dtype="float16")
assert got["w0"].device == "emu:0" and got["w0"].dtype == "float16"
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("group_mib, bounded", [(16, True), (1024, False)])
def test_host_memory_of_a_cast_device_load_from_s3_is_bounded_by_its_groups(s3, url, group_mib, bounded):
    """128 MiB of float32 (32 tensors) loaded as float16 onto the emulated device (whose
    memory is host memory: 64 MiB of the growth) in groups of 16 MiB grows the peak
    resident memory by the device's share plus two groups and one group's cast, and slack;
    as one group, by the whole object and its cast too, which shows that the measurement
    tells the two apart."""
    size = 128 << 20
    target = url + "big.safetensors"
    tf.save({f"w{i}": np.ones(size // 4 // 32, np.float32) for i in range(32)}, target)
    grown = _peak_rss_growth(_PEAK_RSS_OF_A_CAST_LOAD, target, group_mib)
    if bounded:
        assert grown < size // 2 + (64 << 20), f"peak resident memory grew {grown >> 20} MiB"
    else:
        assert grown > size // 2 + (128 << 20), f"peak resident memory grew only {grown >> 20} MiB"


# ---- out= filled from object storage, a group of tensors at a time -------------------------


def _zeros_like(tree):
    """``tree``'s tensors as zeroed arrays of the same shapes and dtypes, keyed as ``out=``
    takes them (plain values dropped)."""
    return {"model": {k: np.zeros_like(v) for k, v in tree["model"].items()}}


@pytest.mark.parametrize("group", [70_000, 1 << 30], ids=["two_a_group", "one_group"])
@pytest.mark.parametrize("where", ["one/model.safetensors", "many/"], ids=["whole", "sharded"])
def test_out_is_filled_from_objects_whole_sharded_subset_and_cast(s3, url, monkeypatch, where, group):
    tree = _model(layers=8, size=8192)  # 32 KiB a tensor
    tf.save(tree, url + "one/model.safetensors")
    tf.save(tree, url + "many/", max_shard_size=80_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", str(group))
    out = _zeros_like(tree)
    assert tf.load(url + where, out=out) is out
    assert_same(out, {"model": tree["model"]})
    part = {"model": {"layer.6.weight": np.zeros(8192, np.float16)}}
    tf.load(url + where, out=part, keys="model.layer.6.*", dtype="float16")
    np.testing.assert_array_equal(part["model"]["layer.6.weight"], tree["model"]["layer.6.weight"].astype(np.float16))


def test_out_of_torch_tensors_is_filled_from_objects_in_groups(s3, url, monkeypatch, torch):
    tree = _model(layers=4, size=8192)
    tf.save(tree, url, max_shard_size=80_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", "1")  # a tensor a group
    out = {"model": {k: torch.zeros(8192, dtype=torch.bfloat16) for k in tree["model"]}}
    tf.load(url, out=out, dtype=torch.bfloat16)
    for k, v in tree["model"].items():
        assert torch.equal(out["model"][k], torch.from_numpy(v).to(torch.bfloat16)), k


def test_out_from_objects_is_checked_whole_before_any_tensor_is_fetched(own_server, monkeypatch):
    """Two problems (a shape, a dtype) in the last groups are both named, and nothing of
    ``out=`` is written, nor any tensor's bytes asked for."""
    tree = _model(layers=4, size=8192)
    tf.save(tree, "s3://bucket/run/", max_shard_size=80_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", "1")
    out = _zeros_like(tree)
    out["model"]["layer.2.weight"] = np.zeros(8191, np.float32)
    out["model"]["layer.3.weight"] = np.zeros(8192, np.float64)
    monkeypatch.setenv("TENSORFERRY_OBJECT_HEADER_BYTES", "64")  # a GET of the header holds no tensor byte
    with pytest.raises(tf.FormatError) as caught:
        tf.load("s3://bucket/run/", out=out)
    assert "layer.2.weight: shape (8192,) in the file, (8191,) in out=" in str(caught.value)
    assert "layer.3.weight: dtype float32 in the file, float64 in out=" in str(caught.value)
    assert all(not v.any() for v in out["model"].values())
    # Only headers were read (the saves were PUTs): no ranged GET reaches a data section.
    time.sleep(0.2)
    with open(own_server.log) as f:
        asked = re.findall(r'uri: /bucket/(\S+?),[^\n]*?"range": "bytes=(\d+)-(\d+)"', f.read())
    assert asked
    for key, _, last in asked:
        with open(own_server.file(key), "rb") as f:
            data_start = 8 + struct.unpack("<Q", f.read(8))[0]
        assert int(last) < data_start, (key, last, data_start)


@pytest.mark.parametrize("equal", [True, False])
def test_tied_names_in_out_are_compared_before_anything_is_written(s3, url, monkeypatch, torch, equal):
    head = np.arange(5000, dtype=np.float32)
    tf.save({"embed": head, "mid": np.ones(5000, np.float32), "head": head.copy() if equal else head + 1}, url,
            max_shard_size=25_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", "1")
    shared = torch.zeros(5000)
    out = {"embed": shared, "mid": torch.zeros(5000), "head": shared}
    if equal:
        tf.load(url, out=out)
        assert torch.equal(shared, torch.from_numpy(head)) and torch.equal(out["mid"], torch.ones(5000))
    else:
        with pytest.raises(tf.FormatError, match="file holds different values for embed, head"):
            tf.load(url, out=out)
        assert not shared.any() and not out["mid"].any()


def test_a_shard_replaced_during_an_out_fill_is_an_error_saying_what_was_written(s3, url, monkeypatch, tmp_path):
    """The first group's read stops after its header while the last shard is replaced by
    another save's: the load fails naming that shard, and its note says how many tensors
    of ``out=`` were written before (the groups are written as they arrive)."""
    tf.save(_model(layers=4, size=8192), url + "a/", max_shard_size=70_000)
    tf.save(_model(layers=4, size=8192, salt=100.0), url + "b/", max_shard_size=70_000)
    shards, others = ([f for f in sorted(os.listdir(s3.file(url[len("s3://bucket/"):] + d))) if f.endswith(".safetensors")]
                      for d in ("a", "b"))
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", str(40_000))
    out = _zeros_like(_model(layers=4, size=8192))
    go, outcome = _paused_load(monkeypatch, tmp_path, url + "a/", out=out)
    tf._native.put(url + "a/" + shards[-1], _native_object_bytes(url + "b/" + others[-1]))
    go()
    kind, value = outcome[0]
    assert kind == "error", value
    # Its pinned ETag or its save id says the shard is another save's.
    other_save = isinstance(value, tf.FormatError) or "replaced while it was read" in str(value)
    assert other_save and shards[-1] in str(value), value
    written = sum(bool(v.any()) for v in out["model"].values())
    assert 0 < written < 4
    if sys.version_info >= (3, 11):
        assert value.__notes__ == [f"out= is partly filled: {written} of 4 tensors were written before this error"]
    # Nothing of the other save was written.
    assert all(v[0] < 100 for v in out["model"].values())


def test_a_checkpoint_of_one_group_that_fails_mid_read_leaves_out_untouched(s3, url, monkeypatch, tmp_path):
    """One object, one group (the default size): the read stops after the load began and
    the object is replaced; the error comes before anything of ``out=`` is written, and
    carries no note of a partial fill."""
    target = url + "m.safetensors"
    tf.save(_model(layers=4, size=8192), target)
    out = _zeros_like(_model(layers=4, size=8192))
    go, outcome = _paused_load(monkeypatch, tmp_path, target, out=out)
    tf.save(_model(layers=4, size=8192, salt=100.0), target)
    go()
    kind, value = outcome[0]
    assert kind == "error" and "replaced while it was read" in str(value), value
    assert not getattr(value, "__notes__", None)
    assert all(not v.any() for v in out["model"].values())


def test_an_object_replaced_during_an_out_fill_is_an_error_and_none_of_its_bytes_are_written(s3, url, monkeypatch):
    """One object, a tensor a group: after two groups were read, the object is replaced by
    another save of the same layout, and the third group is asked for only then, of the
    version the load pinned: it fails, and nothing of the new object reaches ``out=`` (a
    group read at the version it found would have written it). The replacement is made
    between two groups' reads, never during one: s3s-fs may serve a GET that overlaps a
    PUT with the new bytes under the old ETag, which S3 never does."""
    from tensorferry import _cast_load

    target = url + "m.safetensors"
    tf.save(_model(layers=4, size=8192), target)
    tf.save(_model(layers=4, size=8192, salt=100.0), url + "other.safetensors")
    replacement = _native_object_bytes(url + "other.safetensors")
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", "1")
    fetcher, reads = _cast_load._Objects.fetcher, []

    def replacing(self, like):
        fetch = fetcher(self, like)

        def fetch_after_two(group):
            reads.append(group)
            if len(reads) == 3:
                tf._native.put(target, replacement)
            return fetch(group)

        return fetch_after_two

    monkeypatch.setattr(_cast_load._Objects, "fetcher", replacing)
    out = _zeros_like(_model(layers=4, size=8192))
    with pytest.raises(OSError, match="replaced while it was read") as caught:
        tf.load(target, out=out)
    assert "m.safetensors" in str(caught.value)
    firsts = [v[1] for v in out["model"].values()]
    assert firsts == [1.0, 2.0, 0.0, 0.0], firsts  # the two groups read before, and no other


@pytest.mark.parametrize("only", [None, {"model.layer.1.weight"}], ids=["whole", "subset"])
@pytest.mark.parametrize("device", [None, "emu:0"])
def test_a_load_pinned_to_a_version_refuses_another(s3, url, only, device):
    """A load given what an earlier read found of an object (its ETag, size and header)
    fails when the object was replaced since, whole or a subset, to the host or a device."""
    target = url + "m.safetensors"

    def pinned():
        _, _, etag, size, _, header = tf._native.object_read_header(target)
        return etag, size, header

    tf.save(_model(), target)
    before = pinned()
    tf.save(_model(salt=1.0), target)
    with pytest.raises(OSError, match="replaced while it was read"):
        tf._native.load(target, True, "numpy", False, device=device, only=only, pinned=before)
    got = tf.to_numpy(tf._native.load(target, True, "numpy", False, device=device, only=only, pinned=pinned())[0])
    assert got["model"]["layer.1.weight"][0] == 2.0


@pytest.mark.parametrize("how", [{"out": "zeros"}, {"device": "emu:0", "dtype": "float16"}], ids=["out", "cast"])
def test_a_load_in_groups_asks_for_each_header_once(own_server, monkeypatch, how):
    """A tensor a group, four groups an object: each object's header is asked for once
    (when the load begins), never again by a group."""
    tree = _model(layers=8, size=8192)
    tf.save(tree, "s3://bucket/run/", max_shard_size=140_000)
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", "1")
    time.sleep(0.2)  # the server's log of the save is written
    before = os.path.getsize(own_server.log)
    if how.get("out"):
        how = {"out": _zeros_like(tree)}
    tf.load("s3://bucket/run/", **how)
    time.sleep(0.2)
    with open(own_server.log) as f:
        f.seek(before)
        log = f.read()
    shards = set(re.findall(r"uri: (/bucket/run/model-\S+\.safetensors),", log))
    headers = re.findall(r'uri: (/bucket/run/model-\S+\.safetensors),[^\n]*?"range": "bytes=0-', log)
    assert len(shards) == 2 and sorted(headers) == sorted(shards), (shards, headers)


_WITHOUT_ML_DTYPES = """
import sys
sys.modules["ml_dtypes"] = None                # as if it were not installed
import torch, tensorferry as tf
url = sys.argv[1]
out = {"w": torch.zeros(6, dtype=torch.bfloat16), "n": torch.zeros(3, dtype=torch.int64)}
tf.load(url, out=out)
assert out["w"].tolist() == [0, 1, 2, 3, 4, 5] and out["n"].tolist() == [1, 2, 3], out
out = {"w": torch.zeros(6, dtype=torch.float16), "n": torch.zeros(3, dtype=torch.int64)}
tf.load(url, out=out, dtype=torch.float16)
assert out["w"].tolist() == [0, 1, 2, 3, 4, 5] and out["n"].tolist() == [1, 2, 3], out
print("ok")
"""


def test_bfloat16_fills_torch_tensors_from_objects_without_ml_dtypes(s3, url, torch):
    """ml_dtypes is an optional extra: PyTorch targets take bfloat16 without it, cast or
    not, as from a local file."""
    target = url + "m.safetensors"
    tf.save({"w": torch.arange(6, dtype=torch.bfloat16), "n": torch.tensor([1, 2, 3])}, target)
    done = subprocess.run([sys.executable, "-c", _WITHOUT_ML_DTYPES, target], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TENSORFERRY_CAST_GROUP_BYTES="1"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_tied_name_of_out_missing_from_the_file_is_filled_through_its_other_name(s3, url, tmp_path, torch, where):
    """A file that leaves out a tied name (a head tied to the embedding, stored once, as
    transformers' save_pretrained and safetensors' save_model store it) fills it through the
    name it holds; an untied name missing is named."""
    target = str(tmp_path / "m.safetensors") if where == "local" else url + "m.safetensors"
    tf.save({"embed": torch.arange(4.0)}, target)
    shared = torch.zeros(4)
    tf.load(target, out={"embed": shared, "head": shared})
    assert shared.tolist() == [0, 1, 2, 3]
    alone = torch.zeros(4)
    with pytest.raises(tf.FormatError, match="head: in out= but not in the file"):
        tf.load(target, out={"embed": torch.zeros(4), "head": alone})
    assert not alone.any()


def test_a_folder_is_listed_by_its_own_objects_not_those_of_its_subfolders(s3, url):
    """A folder without model.safetensors (or its index) is listed by the delimiter: its
    one *.safetensors object loads, whatever its subfolders hold; two are named."""
    tree = _model()
    tf.save(tree, url + "weights.safetensors")
    tf.save(_model(salt=1.0), url + "sub/other.safetensors")
    tf.save(_model(salt=2.0), url + "sub/deeper/more.safetensors")
    assert_same(tf.load(url), tree)
    tf.save(_model(salt=3.0), url + "second.safetensors")
    with pytest.raises(tf.FormatError, match=r"holds 2 \*\.safetensors objects and no index"):
        tf.load(url)
    with pytest.raises(FileNotFoundError, match=r"holds neither"):
        tf.load(url + "sub/deeper/nothing/")


def test_a_pinned_load_of_an_index_or_a_folder_is_refused(s3, url):
    """What an earlier read found of one object is never applied to an index's shards."""
    tf.save(_model(), url, max_shard_size=20_000)
    is_index, index = tf._native.resolve(url)
    assert is_index
    for where in (index, url):
        with pytest.raises(OSError, match="belong to one object, not an index or a folder"):
            tf._native.load(where, True, "numpy", False, pinned=(None, 0, b""))


def test_grouped_reads_stop_at_once_on_an_error_leaving_the_next_read_behind():
    """An error while a group is written (Ctrl-C too) returns at once: the read of the
    next group, slow, is left to finish on its own."""
    from tensorferry import _cast_load

    started = threading.Event()

    def read(group):
        if group == "second":
            started.set()
            time.sleep(3)
        return group

    def each(group, host):
        started.wait(5)
        raise KeyboardInterrupt

    begun = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _cast_load._in_groups(["first", "second", "third"], read, each)
    assert time.monotonic() - begun < 2


_PEAK_RSS_OF_AN_OUT_LOAD = """
import sys, numpy as np, tensorferry as tf
url = sys.argv[1]
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) << 10
out = {f"w{i}": np.ones((128 << 20) // 4 // 32, np.float32) for i in range(32)}  # touched
tf.load(url, out={"w0": out["w0"]}, keys="w0")  # every path warmed once (pools, runtime)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                               # the peak resident size starts again from now
before = status("VmRSS")
tf.load(url, out=out)
assert all((v == 2).all() for v in out.values())
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("group_mib, bounded", [(16, True), (1024, False)])
def test_host_memory_of_an_out_load_from_s3_is_bounded_by_its_groups(s3, url, group_mib, bounded):
    """128 MiB of float32 in 32 tensors filled into existing arrays in groups of 16 MiB
    grows the peak resident memory by two groups and slack; as one group, by the whole
    object, which shows that the measurement tells the two apart."""
    size = 128 << 20
    target = url + "big.safetensors"
    tf.save({f"w{i}": np.full(size // 4 // 32, 2, np.float32) for i in range(32)}, target)
    grown = _peak_rss_growth(_PEAK_RSS_OF_AN_OUT_LOAD, target, group_mib)
    if bounded:
        assert grown < 64 << 20, f"peak resident memory grew {grown >> 20} MiB"
    else:
        assert grown > size - (16 << 20), f"peak resident memory grew only {grown >> 20} MiB"


# ---- retries, proven through a proxy that drops connections and delays responses -----------


@pytest.fixture
def proxied(own_server, monkeypatch):
    """``make(**faults)``: a fault-injecting proxy (``_fault_proxy.FaultProxy``) in front
    of the test's own server, the client's environment pointing at it; closed after the
    test."""
    from _fault_proxy import FaultProxy

    made = []

    def make(**faults):
        proxy = FaultProxy(own_server.port, **faults)
        made.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


def _retrying(monkeypatch, retries):
    monkeypatch.setenv("TENSORFERRY_OBJECT_RETRIES", str(retries))
    monkeypatch.setenv("TENSORFERRY_OBJECT_RETRY_TIMEOUT", "60")


def _pending_uploads(server):
    """The multipart uploads the server holds open (``s3s-fs`` keeps each as
    ``.upload-<id>.json`` and its parts as ``.upload_id-<id>.part-<n>`` in its folder)."""
    return [n for n in os.listdir(server.root) if n.startswith(".upload")]


def test_a_load_survives_dropped_connections_and_delays_by_retrying(own_server, proxied, monkeypatch):
    tree = {"w": np.arange(3 << 20, dtype=np.float32)}  # 12 MiB
    tf.save(tree, "s3://bucket/m.safetensors")  # straight to the server
    _retrying(monkeypatch, 4)
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(1 << 20))
    for device in ("cpu", "emu:0"):
        proxy = proxied(cut_responses=3, cut_after=300_000, delays=3, delay=0.3)
        got = tf.load("s3://bucket/m.safetensors", device=device)
        np.testing.assert_array_equal(tf.to_numpy(got)["w"], tree["w"])
        assert (proxy.cut, proxy.delayed) == (3, 3), device  # the faults did happen
        proxy.close()


def test_a_checkpoint_saves_and_loads_over_https_its_bodies_signed_unhashed(own_server, proxied, monkeypatch, tmp_path):
    # s3s-fs speaks plain HTTP: the proxy speaks TLS to the client, with a certificate of a
    # CA the test makes, trusted through SSL_CERT_FILE. Over HTTPS the bodies are signed
    # without hashing them (UNSIGNED-PAYLOAD, as AWS's SDKs do), which the server checks.
    from test_object_stores import Certificates

    tls = Certificates(str(tmp_path))
    proxy = proxied(tls=(tls.server, tls.key))
    assert proxy.endpoint.startswith("https://")
    monkeypatch.setenv("SSL_CERT_FILE", tls.ca)
    monkeypatch.delenv("AWS_UNSIGNED_PAYLOAD", raising=False)
    tree = {"w": np.arange(3 << 20, dtype=np.float32), "b": np.arange(10)}  # 12 MiB: a multipart upload
    tf.save(tree, "s3://bucket/tls.safetensors")
    assert_same(tf.load("s3://bucket/tls.safetensors"), tree)
    assert_same(tf.load("s3://bucket/tls.safetensors", keys="b"), {"b": tree["b"]})
    with open(own_server.log) as f:
        log = f.read()
    parts = re.findall(r'method: PUT, uri: \S*partNumber=[^\n]*"x-amz-content-sha256": "([^"]*)"', log)
    assert len(parts) == 2 and set(parts) == {"UNSIGNED-PAYLOAD"}, parts  # parts of 8 MiB
    monkeypatch.delenv("SSL_CERT_FILE")
    with pytest.raises(OSError, match="TLS certificate is not trusted"):
        tf.load("s3://bucket/tls.safetensors")


def test_a_multipart_save_survives_dropped_connections_by_retrying(own_server, proxied, monkeypatch):
    tree = {"w": np.arange(6 << 20, dtype=np.float32)}  # 24 MiB: 5 parts of 5 MiB
    _retrying(monkeypatch, 4)
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(5 << 20))
    proxy = proxied(cut_requests=3, cut_after=1 << 20, delays=2, delay=0.3)
    tf.save(tree, "s3://bucket/m.safetensors")
    assert (proxy.cut, proxy.delayed) == (3, 2)
    proxy.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", own_server.endpoint)
    np.testing.assert_array_equal(tf.load("s3://bucket/m.safetensors")["w"], tree["w"])
    assert _pending_uploads(own_server) == []


def test_retries_exhausted_are_a_clean_error_naming_the_object_and_leave_nothing(own_server, proxied, monkeypatch):
    previous = {"w": np.full(3 << 20, 1.0, np.float32)}
    target = "s3://bucket/m.safetensors"
    tf.save(previous, target)
    before = _files(own_server.root)
    _retrying(monkeypatch, 0)
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(5 << 20))
    for device in ("cpu", "emu:0"):
        proxied(cut_responses=1, cut_after=300_000)
        with pytest.raises(tf.TensorferryError) as e:
            tf.load(target, device=device)
        assert isinstance(e.value, ConnectionResetError) and target in str(e.value), e.value
        assert "the connection dropped" in str(e.value)
    proxied(cut_requests=1, cut_after=1 << 20)
    with pytest.raises(tf.TensorferryError) as e:
        tf.save({"w": np.full(6 << 20, 2.0, np.float32)}, target)
    assert isinstance(e.value, ConnectionError) and target in str(e.value), e.value
    # The failed upload was aborted: no part of it stays on the server, and the previous
    # object is whole.
    assert _pending_uploads(own_server) == []
    # (s3s-fs may leave the temporary file of the part whose body was cut: its own.)
    assert {f for f in _files(own_server.root) if not os.path.basename(f).startswith(".tmp.")} == before
    monkeypatch.setenv("AWS_ENDPOINT_URL", own_server.endpoint)
    assert_same(tf.load(target), previous)


# ---- interrupted sharded saves, non-blocking saves, plain HTTP servers ---------------------

_SHARDED_SAVE = """
import sys, time, numpy as np, tensorferry as tf
url, salt = sys.argv[1], float(sys.argv[2])
tree = {"model": {f"layer.{i}.weight": np.full(1 << 20, salt + i, np.float32) for i in range(8)}}
print("ready", flush=True)
start = time.monotonic()
tf.save(tree, url, max_shard_size=8 << 20)  # 4 shards of 8 MiB, one 5 MiB part at a time
print("saved", time.monotonic() - start, flush=True)
"""


def _sharded(salt):
    return {"model": {f"layer.{i}.weight": np.full(1 << 20, salt + i, np.float32) for i in range(8)}}


def _start_sharded_save(url, salt):
    env = dict(os.environ, TENSORFERRY_OBJECT_CONCURRENCY="1", TENSORFERRY_OBJECT_PART_BYTES=str(5 << 20))
    child = subprocess.Popen([sys.executable, "-c", _SHARDED_SAVE, url, str(salt)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_sharded_save_killed_at_random_points_leaves_a_whole_checkpoint(s3, url):
    """Each run kills a sharded save over the checkpoint at a random point of its upload:
    what loads afterwards is always one whole checkpoint, the previous one or (killed after
    its index was committed) the new one — never a mix and never an error."""
    import random

    current = 0.0
    tf.save(_sharded(current), url, max_shard_size=8 << 20)
    child = _start_sharded_save(url, 100.0)  # an uninterrupted save: how long one takes
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    current, duration = 100.0, float(out.split()[-1])
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    outcomes = []
    for run in range(6):
        salt = 200.0 + run
        child = _start_sharded_save(url, salt)
        time.sleep(rng.uniform(0, 1.3 * duration))  # now and then after the commit
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        got = tf.load(url)["model"]
        first = float(got["layer.0.weight"][0])
        assert first in (current, salt), (seed, run, first)
        assert_same(got, _sharded(first)["model"])  # whole: every tensor from that save
        outcomes.append("new" if first == salt else "previous")
        current = first
    print("seed", seed, "duration", duration, outcomes)


def test_a_non_blocking_save_to_s3_completes_and_its_failure_is_raised_by_result(s3, url, monkeypatch):
    tree = {"w": np.arange(1 << 20, dtype=np.float32), "step": 3}
    handle = tf.save(tree, url + "bg.safetensors", non_blocking=True)
    assert isinstance(handle, tf.Transfer)
    handle.result(timeout=60)
    assert_same(tf.load(url + "bg.safetensors"), tree)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    handle = tf.save({"w": np.zeros(3)}, url + "bg.safetensors", non_blocking=True)
    with pytest.raises(PermissionError, match="credentials were refused"):
        handle.result(timeout=60)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    assert_same(tf.load(url + "bg.safetensors"), tree)  # the failed save left it as it was


def _http_server(root):
    """An ``http.server`` on 127.0.0.1 serving the files of ``root``: GET (whole, or one
    ``Range: bytes=a-b``) and HEAD, with ``ETag`` and ``Last-Modified`` — what
    ``object_store``'s HTTP store asks of a server to read from it. Returns the server and
    the list of ranges it served."""
    import email.utils
    import http.server

    ranges = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _object(self):
            path = os.path.join(root, self.path.lstrip("/"))
            if not os.path.isfile(path):
                self.send_error(404)
                return None
            st = os.stat(path)
            return path, st.st_size, f'"{st.st_mtime_ns:x}-{st.st_size:x}"', email.utils.formatdate(
                st.st_mtime, usegmt=True)

        def do_HEAD(self):
            found = self._object()
            if found:
                _, size, etag, modified = found
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.send_header("ETag", etag)
                self.send_header("Last-Modified", modified)
                self.end_headers()

        def do_GET(self):
            found = self._object()
            if not found:
                return
            path, size, etag, modified = found
            start, end = 0, size
            asked = self.headers.get("Range")
            if asked:
                a, _, b = asked.removeprefix("bytes=").partition("-")
                start, end = int(a), min(int(b) + 1 if b else size, size)
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                ranges.append((start, end))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(end - start))
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", modified)
            self.end_headers()
            with open(path, "rb") as f:
                f.seek(start)
                self.wfile.write(f.read(end - start))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, ranges


def test_a_checkpoint_loads_from_a_plain_http_server_with_ranged_gets(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(1 << 20))
    tree = _model(layers=3, size=300_000)  # 3.6 MB: several ranged GETs
    tf.save(tree, tmp_path / "model.safetensors")
    server, ranges = _http_server(str(tmp_path))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/model.safetensors"
        assert_same(tf.load(url), tree)
        assert len(ranges) > 3, ranges
        got = tf.load(url, device="emu:0", staging=(1 << 20, 2))
        assert_same(tf.to_numpy(got), tree)
        got = tf.load(url, keys="model.layer.1.weight")
        assert_same(got, {"model": {"layer.1.weight": tree["model"]["layer.1.weight"]}})
        with pytest.raises(FileNotFoundError, match="absent.safetensors"):
            tf.load(url.replace("model.safetensors", "absent.safetensors"))
    finally:
        server.shutdown()
        server.server_close()


# ---- tensorferry.dcp's reader and writer on s3:// folders -------------------------------------


def _dcp_state(torch, salt=0.0):
    g = torch.Generator().manual_seed(int(salt))
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g) + salt,
            "t": (torch.arange(12.0).reshape(3, 4) + salt).t(),  # not contiguous
            "half": torch.full((8, 8), salt, dtype=torch.bfloat16),
        },
        "optim": {"step": int(salt), "lr": 0.1},
    }


def _dcp_zeros(torch, state):
    return {k: _dcp_zeros(torch, v) if isinstance(v, dict) else
            (torch.zeros_like(v.contiguous()) if torch.is_tensor(v) else type(v)()) for k, v in state.items()}


@pytest.fixture
def dcp(torch):
    if not torch.distributed.is_available():
        pytest.skip("this PyTorch build has no torch.distributed")
    return pytest.importorskip("torch.distributed.checkpoint", reason="this PyTorch has no distributed checkpoint")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_saves_to_and_loads_from_an_s3_folder_replacing_the_previous_save(s3, url, torch, dcp):
    from tensorferry.dcp import TensorferryReader, TensorferryWriter

    folder = url + "ckpt"
    for salt in (1.0, 2.0):
        state = _dcp_state(torch, salt)
        dcp.save(state, storage_writer=TensorferryWriter(folder))
        back = _dcp_zeros(torch, state)
        reader = TensorferryReader(folder)
        dcp.load(back, storage_reader=reader)
        assert_same(back, state)
        assert reader.read_stats.data == reader.read_stats.needed > 0
    # The second save's commit removed the first one's rank file: one rank file, and the
    # metadata.
    names = os.listdir(s3.file(folder[len("s3://bucket/"):]))
    assert sorted(n for n in names if n.endswith(".safetensors")) == [n for n in names if n.startswith("__0_")]
    assert len([n for n in names if n.endswith(".safetensors")]) == 1 and ".metadata" in names
    with pytest.raises(dcp.api.CheckpointException) as e:
        dcp.save(_dcp_state(torch, 3.0), storage_writer=TensorferryWriter(folder, overwrite=False))
    assert "FileExistsError" in repr(e.value.failures) or "FileExistsError" in str(e.value), e.value


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_loads_of_an_s3_checkpoint_read_only_the_bytes_asked_for(s3, url, torch, dcp, tmp_path):
    from tensorferry.dcp import TensorferryReader, TensorferryWriter

    state = _dcp_state(torch, 4.0)
    dcp.save(state, storage_writer=TensorferryWriter(str(tmp_path / "local")))
    shutil.copytree(tmp_path / "local", s3.file(url[len("s3://bucket/"):] + "copied"))  # uploaded as it is
    back = {"model": {"w": torch.zeros(64, 32)}}
    reader = TensorferryReader(url + "copied")
    dcp.load(back, storage_reader=reader)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert reader.read_stats.data == 64 * 32 * 4  # w's bytes, none of the others'


def test_a_streamed_load_asks_for_the_next_chunk_while_this_one_arrives(own_server, proxied, monkeypatch):
    """Every answer comes 0.25 s late (the proxy), and each of the 12 chunks of 1 MiB is one
    GET: one after another they would take 12 x 0.25 s. The GETs of the next chunk begin
    while this chunk's body arrives, so the waits overlap two by two."""
    tree = {"w": np.arange(3 << 20, dtype=np.float32)}  # 12 MiB
    tf.save(tree, "s3://bucket/m.safetensors")
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "1")
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(1 << 20))
    monkeypatch.setenv("TENSORFERRY_OBJECT_HEADER_BYTES", "4096")
    proxy = proxied(delays=10**6, delay=0.25)
    started = time.monotonic()
    got = tf.load("s3://bucket/m.safetensors", device="emu:0", staging=(1 << 20, 2))
    took = time.monotonic() - started
    np.testing.assert_array_equal(got["w"].numpy(), tree["w"])
    assert proxy.delayed >= 13
    assert took < 0.25 * 12 * 0.8, f"{took:.2f} s: the chunks' waits did not overlap"


def test_byte_ranges_of_one_object_version_are_read_into_buffers(s3, url):
    tree = {"a": np.arange(1000, dtype=np.float32), "b": np.arange(10, dtype=np.int64)}
    target = url + "r.safetensors"
    tf.save(tree, target)
    start, entries, etag, size, _, _ = tf._native.object_read_header(target)
    assert etag and size == max(e[4] for e in entries) and start == min(e[3] for e in entries)
    found = {name: (begin, end) for name, _, _, begin, end in entries}
    fd = _dcp_io.open_read(target)
    fd.etag = etag
    a = np.zeros(1000, np.float32)
    b = bytearray(80)
    _dcp_io.read_pieces(fd, target, [(found["a"][0], a), (found["b"][0], b)], 1)
    np.testing.assert_array_equal(a, tree["a"])
    np.testing.assert_array_equal(np.frombuffer(b, np.int64), tree["b"])
    assert _dcp_io.read_small_file(target, size)[slice(*found["b"])] == bytes(b)
    with pytest.raises(TypeError, match="read-only"):
        _dcp_io.read_pieces(_dcp_io.open_read(target), target, [(0, b"12345678")], 1)
    with pytest.raises(BufferError, match="overlap"):  # checked before any address is used
        tf._native.object_read_into(target, [(0, 1 << 40, 8), (0, (1 << 40) + 4, 8)])
    tf.save({"a": np.ones(3)}, target)  # replaced: the old ETag no longer reads
    with pytest.raises(OSError, match="replaced"):
        _dcp_io.read_pieces(fd, target, [(0, bytearray(8))], 1)


def test_a_checkpoint_without_tensor_bytes_streams_onto_a_device(s3, url):
    tf.save({"step": 3, "empty": np.zeros((0, 4), np.float32)}, url + "e.safetensors")
    got = tf.load(url + "e.safetensors", device="emu:0")
    assert got["step"] == 3 and got["empty"].shape == (0, 4) and got["empty"].device == "emu:0"
    got = tf.load(url + "e.safetensors", device="emu:0", keys="empty")
    assert got["empty"].shape == (0, 4)


def test_a_sharded_save_failing_midway_removes_its_shards_and_leaves_the_previous_checkpoint(
        own_server, proxied, monkeypatch):
    previous = _sharded(1.0)
    tf.save(previous, "s3://bucket/ckpt/", max_shard_size=8 << 20)
    objects = os.path.join(own_server.root, "bucket")
    before = _files(objects)
    _retrying(monkeypatch, 0)
    monkeypatch.setenv("TENSORFERRY_OBJECT_CONCURRENCY", "1")
    monkeypatch.setenv("TENSORFERRY_OBJECT_PART_BYTES", str(5 << 20))
    # The first shard (8 MiB, two parts) goes up whole; the upload's 10th MiB, in the
    # second, is cut.
    proxy = proxied(cut_requests=1, spare=10 << 20)
    with pytest.raises(ConnectionError) as e:
        tf.save(_sharded(2.0), "s3://bucket/ckpt/", max_shard_size=8 << 20)
    assert re.search(r"model-00002-of-00004\.", str(e.value)) and proxy.cut == 1, e.value
    assert _pending_uploads(own_server) == []
    # The shard uploaded whole was deleted again: the objects are the previous checkpoint's.
    assert _files(objects) == before
    monkeypatch.setenv("AWS_ENDPOINT_URL", own_server.endpoint)
    assert_same(tf.load("s3://bucket/ckpt/")["model"], previous["model"])


def test_a_process_group_plan_reads_each_object_header_once(own_server):
    # The plan of a load on many ranks builds the structure from the objects' headers and
    # checks each shard against them: one GET from byte 0 per object and for the index,
    # none of the data.
    from tensorferry import _dcp_io, _fanout

    tree = {f"layer{i}": np.full(100_000, float(i), np.float32) for i in range(4)}
    tf.save(tree, "s3://bucket/ts/", max_shard_size=500_000)
    shards = sorted(f for f in os.listdir(own_server.file("ts")) if f.endswith(".safetensors"))
    assert len(shards) == 4
    with open(own_server.log) as f:
        before = len(f.read())
    plan = _fanout._plan("s3://bucket/ts/", 0, 1, None, None, None, None, None, tf.load)
    for fd in plan.fds.values():
        _dcp_io.close(fd)
    with open(own_server.log) as f:
        log = f.read()[before:]
    gets = re.findall(r'method: GET, uri: /bucket/ts/(\S+?)[,? ][^\n]*?"range": "bytes=(\d+)-(\d+)"', log)
    # The index once too (the stand-in is written from the bytes the plan checked).
    assert sorted(key for key, start, _ in gets if start == "0") == shards + ["model.safetensors.index.json"], gets
    assert all(start == "0" for _, start, _ in gets), gets  # no data read by the plan


def _lying_s3(answer_get):
    """An ``http.server`` on 127.0.0.1 that speaks S3's path-style protocol as a hostile
    or broken server might: every HEAD is a 404, PUTs succeed, and each GET is answered by
    ``answer_get(handler, range_header)``. Returns the server (a real S3 server cannot
    be made to lie, so this one stands in for the hostile side of the tests below)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_PUT(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("ETag", '"put"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            try:
                answer_get(self, self.headers.get("Range"))
            except OSError:
                pass  # the client hung up

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _no_such_key(handler):
    """S3's answer for a missing object."""
    body = b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>"
    handler.send_response(404)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _run_against(server, script, timeout=120):
    """``script`` run in a child process whose S3 endpoint is ``server``, its address space
    capped at 4 GB (an allocation of what a server claims would abort it): its output."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1",
               AWS_ALLOW_HTTP="true", AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.server_address[1]}")
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return done.stdout


_RAISES = """
import sys, tensorferry as tf
try:
    {call}
    print("returned")
except tf.TensorferryError as e:
    print("typed", type(e).__name__, e)
"""


@pytest.mark.parametrize("call", [
    "tf.load('s3://bucket/model.safetensors.index.json')",
    "tf.metadata('s3://bucket/model.safetensors.index.json')",
    "tf.save({'w': [1.0]}, 's3://bucket/model.safetensors')",
])
def test_an_index_whose_store_announces_a_terabyte_is_refused_before_it_is_held(call):
    """The first GET of an index gets 1 MiB of a 2 MiB object; the second claims 1 TiB
    (Content-Range and Content-Length) and sends a few bytes: its size is checked against the
    first answer's before any memory is taken for it (object_store collects a body into one
    allocation of the announced size: the process used to abort)."""
    huge, size = 1 << 40, 2 << 20

    def answer(handler, asked):
        if not handler.path.split("?")[0].endswith(".index.json"):
            return _no_such_key(handler)
        if asked and asked != "bytes=0-":
            a, b = map(int, asked.removeprefix("bytes=").split("-"))
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {a}-{b}/{size}")
            handler.send_header("Content-Length", str(b - a + 1))
            handler.send_header("ETag", '"v1"')
            handler.end_headers()
            handler.wfile.write(b" " * (b - a + 1))
            return
        handler.send_response(206 if asked else 200)
        if asked:
            handler.send_header("Content-Range", f"bytes 0-{huge - 1}/{huge}")
        handler.send_header("Content-Length", str(huge))
        handler.send_header("ETag", '"v1"')
        handler.end_headers()
        handler.wfile.write(b" " * 4096)
        time.sleep(5)

    server = _lying_s3(answer)
    try:
        out = _run_against(server, _RAISES.format(call=call))
    finally:
        server.shutdown()
    if call.startswith("tf.save"):
        assert out.startswith("returned"), out  # an index it cannot read names no shard to delete
    else:
        assert out.startswith("typed"), out
        assert "object changed" in out or "announced" in out, out


def test_a_listing_that_never_ends_is_an_error_after_a_bounded_number_of_objects():
    """A folder with no model.safetensors nor model.safetensors.index.json is listed; a
    server whose listing pages never end (truncated, a new token each time) gets an error
    naming the folder once 10,000 entries were seen, not a hang that fills memory."""
    pages = [0]

    def answer(handler, asked):
        if "list-type=2" not in handler.path:
            return _no_such_key(handler)
        pages[0] += 1
        page = pages[0]
        items = "".join(f"<Contents><Key>ckpt/f{page}_{i}.bin</Key><LastModified>2024-01-01T00:00:00.000Z"
                        f"</LastModified><ETag>\"e\"</ETag><Size>1</Size></Contents>" for i in range(1000))
        body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bucket</Name><Prefix>ckpt/</Prefix>'
                "<KeyCount>1000</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
                f"<NextContinuationToken>t{page}</NextContinuationToken>{items}</ListBucketResult>").encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    server = _lying_s3(answer)
    try:
        out = _run_against(server, _RAISES.format(call="tf.load('s3://bucket/ckpt/')"), timeout=60)
    finally:
        server.shutdown()
    assert out.startswith("typed"), out
    assert "over 10000 entries" in out and "s3://bucket/ckpt" in out, out
    assert pages[0] <= 12, pages  # the pages of 10,000 objects, and one more
