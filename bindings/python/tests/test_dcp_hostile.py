"""Hostile DCP checkpoints: a ``.metadata`` crafted to run code, crash, or make a loader's
work explode, and files that are not regular files, through every way in —
``TensorferryReader.read_metadata``, ``dcp.load(..., storage_reader=TensorferryReader(d))``
and ``tensorferry.dcp.consolidate``. Nothing may run, hang or crash: each is a
``tensorferry.FormatError`` (or an ``OSError`` naming the file) at once.

The hostile pickles are ``fuzz/python/corpus-dcp-metadata/hostile-*`` (made by
``fuzz/python/dcp_metadata_corpus.py``); each would create the file ``PWNED`` in the
current folder if anything ran it. They run in a child process (a C-stack overflow in an
unpickler kills its process: here that is a failed test, not a dead suite), with deadlines.
"""

import glob
import json
import os
import re
import stat
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="DCP needs PyTorch")
if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint", reason="this PyTorch has no distributed checkpoint")

import tensorferry as tf  # noqa: E402
from tensorferry.dcp import TensorferryReader, TensorferryWriter, consolidate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
CORPUS = os.path.join(ROOT, "fuzz", "python", "corpus-dcp-metadata")
HOSTILE = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CORPUS, "hostile-*")))
REAL = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CORPUS, "real-*")))
REFUSED = "not a DCP metadata file tensorferry reads"
CASE_DEADLINE_S = 30

# The child: for each hostile file, a real checkpoint whose .metadata (and rank-local
# __0.metadata, DCP's fallback) is that file, loaded the three ways from inside the
# checkpoint's folder; one JSON line per file, written as soon as it is known.
_CHILD = r"""
import copyreg, json, os, shutil, signal, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
import tensorferry
from tensorferry.dcp import TensorferryReader, TensorferryWriter, consolidate

# A loader that followed EXT1/EXT2 240 would reach os.system.
copyreg.add_extension("os", "system", 240)
work, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
base = os.path.join(work, "base")
if not os.path.exists(base):
    dcp.save({"x": torch.arange(3)}, storage_writer=TensorferryWriter(base), no_dist=True)

def timeout(*_):
    raise TimeoutError("deadline passed")

signal.signal(signal.SIGALRM, timeout)

def attempt(fn):
    signal.alarm(%(deadline)d)
    try:
        fn()
        return {"raised": None}
    except BaseException as e:
        if isinstance(e, dcp.api.CheckpointException):
            return {"raised": "CheckpointException", "message": str(e) + " " + " ".join(map(str, e.failures.values()))}
        return {"raised": type(e).__name__, "message": str(e), "is_format_error": isinstance(e, tensorferry.FormatError)}
    finally:
        signal.alarm(0)

for name in names:
    case = os.path.join(work, name)
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(base, case)
    with open(os.path.join(%(corpus)r, name), "rb") as f:
        hostile = f.read()
    for md in (".metadata", "__0.metadata"):
        with open(os.path.join(case, md), "wb") as f:
            f.write(hostile)
    os.chdir(case)
    result = {"name": name}
    for how, fn in (
        ("read_metadata", lambda: TensorferryReader(case).read_metadata()),
        ("dcp_load", lambda: dcp.load({"x": torch.zeros(3, dtype=torch.int64)}, storage_reader=TensorferryReader(case), no_dist=True)),
        ("consolidate", lambda: consolidate(case, os.path.join(case, "hf"))),
    ):
        result[how] = attempt(fn)
        result[how]["ran_code"] = os.path.exists(os.path.join(case, "PWNED"))
        if result[how]["ran_code"]:
            os.remove(os.path.join(case, "PWNED"))
    with open(out, "a") as f:
        f.write(json.dumps(result) + "\n")
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``{file name: what each way in did}``; a file that killed its child process is
    recorded as ``{"crashed": returncode}`` and the rest run in a new child."""
    work = tmp_path_factory.mktemp("hostile_dcp")
    out = work / "results.jsonl"
    child = _CHILD % {"deadline": CASE_DEADLINE_S, "corpus": os.path.abspath(CORPUS)}
    results, remaining = {}, list(HOSTILE)
    while remaining:
        try:
            done = subprocess.run([sys.executable, "-c", child, str(work), str(out), *remaining],
                                  capture_output=True, text=True, timeout=CASE_DEADLINE_S * 3 * len(remaining) + 60)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if out.exists():
            for line in out.read_text().splitlines():
                entry = json.loads(line)
                results[entry["name"]] = entry
        remaining = [n for n in remaining if n not in results]
        if remaining:
            results[remaining[0]] = {"name": remaining[0], "crashed": code}
            remaining = remaining[1:]
    return results


def test_the_hostile_corpus_is_there():
    assert len(HOSTILE) >= 25, HOSTILE
    assert {"real-1rank-model-adamw", "real-2ranks-fsdp2"} <= set(REAL)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_metadata_runs_nothing_and_is_a_format_error_every_way_in(outcomes, name):
    got = outcomes[name]
    assert "crashed" not in got, f"{name} killed the loading process: {got}"
    for how in ("read_metadata", "dcp_load", "consolidate"):
        assert not got[how]["ran_code"], f"{name} ran code through {how}"
    for how in ("read_metadata", "consolidate"):
        assert got[how]["raised"] and got[how]["is_format_error"], (how, got[how])
        assert REFUSED in got[how]["message"] and ".metadata" in got[how]["message"], (how, got[how])
    # DCP turns a reader's error into its own (an AssertionError inside a
    # CheckpointException) and tries the rank-local __0.metadata: both refusals are named.
    load = got["dcp_load"]
    assert load["raised"] == "CheckpointException", load
    assert load["message"].count(REFUSED) >= 2 and "__0.metadata" in load["message"], load


def _checkpoint(tmp_path, state=None):
    state = state or {"w": torch.arange(12.0).reshape(3, 4), "step": 5}
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path / "ckpt"), no_dist=True)
    return tmp_path / "ckpt"


@pytest.mark.parametrize("name", REAL)
def test_real_metadata_reads_as_pickle_reads_it(name):
    import pickle

    from tensorferry import _dcp_metadata

    with open(os.path.join(CORPUS, name), "rb") as f:
        data = f.read()
    assert _dcp_metadata.parse(data, name) == pickle.loads(data)  # our own trusted seeds


def test_metadata_larger_than_the_limit_is_refused_before_it_is_read(tmp_path):
    from tensorferry import _dcp_metadata

    ckpt = _checkpoint(tmp_path)
    path = ckpt / ".metadata"
    with open(path, "r+b") as f:  # the real metadata, then a sparse tail past the limit
        f.truncate(_dcp_metadata.MAX_BYTES + 1)
    with pytest.raises(tf.FormatError, match=r"more than the 268435456 bytes") as info:
        TensorferryReader(ckpt).read_metadata()
    assert str(path) in str(info.value)
    with pytest.raises(tf.FormatError, match=r"more than the 268435456 bytes"):
        consolidate(ckpt, tmp_path / "hf")


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path):
    # A rank file elsewhere (a path with a folder in it) would be read by the loader.
    import pickle

    ckpt = _checkpoint(tmp_path)
    md = TensorferryReader(ckpt).read_metadata()
    outside = tmp_path / "outside"
    outside.mkdir()
    for key, info in md.storage_data.items():
        os.replace(ckpt / info.file, outside / info.file) if (ckpt / info.file).exists() else None
        md.storage_data[key] = type(info)(file=f"../outside/{info.file}", name=info.name)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=5))
    with pytest.raises(tf.FormatError, match="not in a rank file of this folder"):
        TensorferryReader(ckpt).read_metadata()
    with pytest.raises(tf.FormatError, match="not in a rank file of this folder"):
        consolidate(ckpt, tmp_path / "hf")


def test_metadata_with_a_chunk_beyond_its_tensor_is_refused(tmp_path):
    import pickle

    ckpt = _checkpoint(tmp_path)
    md = TensorferryReader(ckpt).read_metadata()
    chunk = md.state_dict_metadata["w"].chunks[0]
    chunk.offsets = torch.Size([2, 0])  # rows 2..4 of a 3-row tensor
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=5))
    with pytest.raises(tf.FormatError, match="reaches beyond the tensor"):
        consolidate(ckpt, tmp_path / "hf")


# ---- fuzzing ----------------------------------------------------------------------------

def _mutants():
    from hypothesis import strategies as st

    seeds = []
    for name in REAL + [n for n in HOSTILE if os.path.getsize(os.path.join(CORPUS, n)) < 4096]:
        with open(os.path.join(CORPUS, name), "rb") as f:
            seeds.append(f.read())
    edit = st.tuples(st.sampled_from(["flip", "insert", "delete", "splice", "truncate"]),
                     st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=8))

    def apply(seed_and_edits):
        i, edits = seed_and_edits
        data = bytearray(seeds[i % len(seeds)])
        for kind, at, other, blob in edits:
            if not data:
                break
            at %= len(data)
            if kind == "flip":
                data[at] ^= blob[0] or 1
            elif kind == "insert":
                data[at:at] = blob
            elif kind == "delete":
                del data[at:at + 1 + other % 16]
            elif kind == "splice":  # a run of another seed, as real-looking opcodes
                donor = seeds[other % len(seeds)]
                start = (other >> 4) % len(donor)
                data[at:at] = donor[start:start + 1 + blob[0] % 64]
            else:
                del data[at:]
        return bytes(data)

    return st.tuples(st.integers(0, 1000), st.lists(edit, min_size=1, max_size=6)).map(apply)


def test_mutated_metadata_reads_exactly_or_is_a_format_error(tmp_path, monkeypatch):
    """Mutations of real metadata and of the hostile corpus (hypothesis, a few seconds):
    each reads as a valid Metadata or is a FormatError — never another exception, never
    code run, never a hang. The long runs: fuzz/python/fuzz_dcp_metadata.py."""
    pytest.importorskip("hypothesis")
    import torch.distributed.checkpoint.metadata as dcp_md
    from hypothesis import HealthCheck, given, settings

    from tensorferry import _dcp_metadata

    monkeypatch.chdir(tmp_path)

    @settings(max_examples=400, deadline=2000, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_mutants())
    def check(data):
        try:
            md = _dcp_metadata.parse(data, "mutant")
        except tf.FormatError as e:
            assert str(e).startswith("mutant: "), e
        else:
            assert type(md) is dcp_md.Metadata
        assert not os.path.exists("PWNED")

    check()


# ---- files that are not regular files ----------------------------------------------------

def _run_with_deadline(fn, fifo_paths, deadline_s=10):
    """Runs ``fn`` on a thread; past the deadline, opens each FIFO for writing (which
    frees a reader blocked on it) and fails: a regression fails here instead of hanging."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        for fifo in fifo_paths:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"blocked for more than {deadline_s} s on a FIFO")
    return box


def _cause(error):
    if isinstance(error, dcp.api.CheckpointException):
        (first,) = error.failures.values()
        return first[0] if isinstance(first, tuple) else first
    return error


def _assert_not_regular(error, path):
    assert isinstance(error, OSError), repr(error)
    assert error.filename == str(path), (error.filename, path)
    assert error.errno is None or isinstance(error.errno, int), error.errno
    assert "not a regular file" in str(error) and "FIFO" in str(error), str(error)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_as_metadata_is_refused_at_once_every_way_in(tmp_path):
    ckpt = _checkpoint(tmp_path)
    path = ckpt / ".metadata"
    os.remove(path)
    os.mkfifo(path)
    got = _run_with_deadline(lambda: TensorferryReader(ckpt).read_metadata(), [path])
    _assert_not_regular(got.get("error"), path)
    got = _run_with_deadline(lambda: consolidate(ckpt, tmp_path / "hf"), [path])
    _assert_not_regular(got.get("error"), path)
    target = {"w": torch.zeros(3, 4), "step": 0}
    got = _run_with_deadline(lambda: dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True), [path])
    assert isinstance(got.get("error"), dcp.api.CheckpointException), got
    assert "not a regular file" in str(got["error"].failures), got["error"].failures
    assert stat.S_ISFIFO(os.stat(path).st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_as_a_rank_file_is_refused_at_once_every_way_in(tmp_path):
    ckpt = _checkpoint(tmp_path)
    (info,) = {i.file for i in TensorferryReader(ckpt).read_metadata().storage_data.values()}
    path = ckpt / info
    os.remove(path)
    os.mkfifo(path)
    target = {"w": torch.zeros(3, 4), "step": 0}
    got = _run_with_deadline(lambda: dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True), [path])
    _assert_not_regular(_cause(got.get("error")), path)
    got = _run_with_deadline(lambda: consolidate(ckpt, tmp_path / "hf"), [path])
    _assert_not_regular(got.get("error"), path)


class _RunsCode:
    """A value whose pickle calls ``os.system`` when unpickled in full."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_byte_item_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    # DCP pickles non-tensor values into byte items, and its planner unpickles them in
    # full (torch.load(weights_only=False)): a crafted rank file would run code there.
    marker = tmp_path / "PWNED"
    ckpt = _checkpoint(tmp_path, {"w": torch.arange(12.0).reshape(3, 4), "extra": _RunsCode(marker)})
    assert not marker.exists()  # saving pickles the value; nothing ran
    (info,) = {i.file for i in TensorferryReader(ckpt).read_metadata().storage_data.values()}
    target = {"w": torch.zeros(3, 4), "extra": None}
    with pytest.raises(dcp.api.CheckpointException) as raised:
        dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True)
    (cause,) = raised.value.failures.values()
    text = str(cause)
    assert "FormatError" in repr(cause) or isinstance(cause, tf.FormatError) or "weights_only=True" in text, text
    assert "'extra'" in text and info in text, text
    assert not marker.exists(), "the byte item's pickle ran"


def test_plain_byte_items_still_load(tmp_path):
    state = {"w": torch.arange(6.0), "step": 7, "betas": (0.9, 0.999), "note": "run-1", "cfg": {"lr": 0.1}}
    ckpt = _checkpoint(tmp_path, state)
    target = {"w": torch.zeros(6), "step": 0, "betas": (0.0, 0.0), "note": "", "cfg": {"lr": 0.0}}
    dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True)
    assert torch.equal(target["w"], state["w"])
    assert {k: v for k, v in target.items() if k != "w"} == {k: v for k, v in state.items() if k != "w"}


def test_a_rank_file_cut_after_its_header_was_read_is_a_format_error_naming_it(tmp_path):
    """The native run reader keeps the file open from its header to its last run; a file
    cut in between (another program truncating it) fails the read by the file's name,
    never fills the tensor with what the file no longer holds."""
    import numpy as np

    from tensorferry import _dcp_io

    path = str(tmp_path / "rank.safetensors")
    tf.save({"w": np.arange(1000, dtype=np.float32)}, path)
    fd = _dcp_io.open_read(path)
    try:
        entry = _dcp_io.header(fd, path)[0]["w"]
        os.truncate(path, entry.begin + 10)
        dest = bytearray(entry.end - entry.begin)
        with pytest.raises(tf.FormatError, match=re.escape(path)):
            _dcp_io.read_runs(fd, path, entry, [(0, len(dest))], memoryview(dest))
    finally:
        _dcp_io.close(fd)
