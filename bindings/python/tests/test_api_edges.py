"""The edges of the Python API a careless or hostile caller reaches: staging rings beyond
their limits, non-blocking saves nobody awaits, Ctrl-C during a streamed device load, a
broadcast view bound for a device too small for it, and arguments of the wrong kind.
Each answers at once with an error (or a warning) that names what is wrong."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tensorferry as tf


def _run(script, *args, timeout=60, env=None):
    """Runs ``script`` in a fresh interpreter (so pools, emulated devices and exit are its
    own); the completed process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---- staging rings: what was asked, within the limits, or refused --------------------------

_BAD_RINGS = {(4096, 10_000): "depth=10000", (1, 10**9): "chunk_bytes=1"}

_STAGED_CALLS = {
    "to_device": lambda d, on, p, ring: tf.to_device(d, "emu:0", staging=ring, copy=True),
    "to_host": lambda d, on, p, ring: tf.to_host(on, staging=ring),
    "save": lambda d, on, p, ring: tf.save(on, p, staging=ring),
    "save_non_blocking": lambda d, on, p, ring: tf.save(on, p, staging=ring, non_blocking=True),
    "load_direct": lambda d, on, p, ring: tf.load(p + ".src", device="emu:0", direct=True, staging=ring),
    "load_mapped": lambda d, on, p, ring: tf.load(p + ".src", device="emu:0", staging=ring),
}


@pytest.mark.parametrize("ring", _BAD_RINGS)
@pytest.mark.parametrize("call", _STAGED_CALLS)
def test_a_ring_beyond_the_limits_is_a_value_error_naming_staging_and_the_value(call, ring, tmp_path):
    d = {"x": np.ones(1 << 16, np.uint8)}
    p = str(tmp_path / "f.safetensors")
    tf.save(d, p + ".src")
    on = tf.to_device(d, "emu:0")
    with pytest.raises(tf.FormatError) as info:
        _STAGED_CALLS[call](d, on, p, ring)
    assert isinstance(info.value, ValueError)
    text = str(info.value)
    assert "staging" in text and _BAD_RINGS[ring] in text and "depth from 1 to 64" in text, text
    assert not os.path.exists(p)


@pytest.mark.parametrize("bad", [(-1, 2), (0, 2), (2**70, 2), (True, 2), (4096, 2.5), (4096,), "sometimes", "fast", 3])
def test_a_malformed_ring_is_the_same_value_error(bad):
    with pytest.raises(tf.FormatError, match="staging"):
        tf.to_device({"x": np.ones(4)}, "emu:0", staging=bad)


_RING_MEMORY = """
import json, sys, time, numpy as np, tensorferry as tf
from resource import getrusage, RUSAGE_SELF
p = sys.argv[1]
def peak_mib():
    return getrusage(RUSAGE_SELF).ru_maxrss / 1024
d = {"x": np.ones(10 << 20, np.uint8)}
tf.save(d, p + ".src")
on = tf.to_device(d, "emu:0")
calls = {
    "to_device": lambda ring: tf.to_device(d, "emu:0", staging=ring, copy=True),
    "to_host": lambda ring: tf.to_host(on, staging=ring),
    "save": lambda ring: tf.save(on, p, staging=ring),
    "load": lambda ring: tf.load(p + ".src", device="emu:0", direct=True, staging=ring),
}
for call in calls.values():  # every path warmed once: what follows is the ring's own
    call("auto")
out = {}
for ring in [(4096, 10_000), (1, 10**9)]:
    for name, call in calls.items():
        before, start = peak_mib(), time.monotonic()
        try:
            call(ring)
            outcome = "done"
        except tf.FormatError:
            outcome = "refused"
        out[f"{name} {ring}"] = [outcome, peak_mib() - before, time.monotonic() - start]
# A ring within the limits pins what it asks for: 64 chunks of 4 KiB are 256 KiB, not one
# 64 KiB buffer each (emu:1's pool is untouched so far in this process).
tf.to_device(d, "emu:1", staging=(4096, 64), copy=True)
out["pinned (4096, 64)"] = tf.pinned_pool_stats("emu:1")["pinned_bytes"]
print(json.dumps(out))
"""


def test_rings_beyond_the_limits_allocate_nothing_and_one_within_pins_what_it_asks(tmp_path):
    done = _run(_RING_MEMORY, tmp_path / "r.safetensors")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out.pop("pinned (4096, 64)") == 64 * 4096, out
    for what, (outcome, grew_mib, seconds) in out.items():
        assert outcome == "refused", what
        assert grew_mib < 8 and seconds < 1, (what, grew_mib, seconds)


# ---- staging="auto" falls back when pinned memory is refused ---------------------------------

_REFUSED_PIN = """
import sys, numpy as np, tensorferry as tf
p = sys.argv[1]
d = {"x": np.arange(1 << 20, dtype=np.float32)}
on = tf.to_device(d, "emu:1")
for non_blocking in (False, True):
    tf.configure_emulated(1, fail_pin=1)  # the next buffer pinned is refused
    handle = tf.save(on, p, staging="auto", non_blocking=non_blocking)
    if non_blocking:
        handle.result(timeout=60)
    assert (tf.load(p)["x"] == d["x"]).all()
    print("auto fell back", non_blocking)
tf.configure_emulated(1, fail_pin=1)
try:
    tf.save(on, p, staging=(1 << 20, 2))
except tf.OutOfMemoryError as e:
    print("explicit ring refused:", e)
"""


def test_a_save_from_a_device_with_staging_auto_goes_on_without_pinned_memory(tmp_path):
    done = _run(_REFUSED_PIN, tmp_path / "p.safetensors")
    assert done.returncode == 0, done.stderr
    assert "auto fell back False" in done.stdout and "auto fell back True" in done.stdout, done.stdout
    assert "explicit ring refused: out of memory on cpu (pinned" in done.stdout, done.stdout


# ---- a lost save is loud ---------------------------------------------------------------------

_LOST_SAVES = """\
import gc, sys, numpy as np, tensorferry as tf
dropped, kept, awaited = sys.argv[1:4]
tf.save({"x": np.ones(3)}, dropped, non_blocking=True)  # the handle is dropped at once
h = tf.save({"x": np.ones(3)}, kept, non_blocking=True)
seen = tf.save({"x": np.ones(3)}, awaited, non_blocking=True)
try:
    seen.result(timeout=60)
except FileNotFoundError:
    print("awaited failure raised", flush=True)
del h, seen
gc.collect()
alive = tf.save({"x": np.ones(3)}, kept + ".exit", non_blocking=True)  # alive at exit
"""


def test_a_failed_non_blocking_save_nobody_awaits_is_a_warning_on_stderr(tmp_path):
    nowhere = tmp_path / "missing-folder"
    paths = [nowhere / "dropped.safetensors", nowhere / "kept.safetensors", nowhere / "awaited.safetensors"]
    done = _run(_LOST_SAVES, *paths)
    assert done.returncode == 0, done.stderr
    assert "awaited failure raised" in done.stdout, done.stdout
    lost = [line for line in done.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(lost) == 3, done.stderr
    for name, whens, line in [
        ("dropped.safetensors'", ("last handle was collected",), 3),
        ("kept.safetensors'", ("last handle was collected",), 4),
        # Alive at exit: reported at exit, or when the interpreter's teardown collects the
        # handle first (both are the one report of that save).
        ("kept.safetensors.exit'", ("at interpreter exit", "last handle was collected"), 12),
    ]:
        # Each names the path, the error and when, at the line that started the save.
        assert any(
            w.startswith(f"<string>:{line}:") and name in w and any(x in w for x in whens) and "FileNotFoundError" in w
            for w in lost
        ), (name, done.stderr)
    assert "awaited.safetensors" not in done.stderr, "a failure the caller saw is not reported again"


def test_a_non_blocking_save_into_a_file_used_as_a_folder_warns_when_lost(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    done = _run(
        "import sys, numpy as np, tensorferry as tf\n"
        "tf.save({'x': np.ones(3)}, sys.argv[1], non_blocking=True)\n",
        tmp_path / "file" / "x.safetensors",
    )
    assert done.returncode == 0
    assert "RuntimeWarning" in done.stderr and "NotADirectoryError" in done.stderr, done.stderr


_SAVE_THEN_EXIT = """
import sys, numpy as np, tensorferry as tf
tf.save({"x": np.full(16 << 20, 7, np.int32)}, sys.argv[1], non_blocking=True)
"""


def test_an_interpreter_that_exits_during_a_non_blocking_save_finishes_it_whole(tmp_path):
    p = tmp_path / "big.safetensors"
    done = _run(_SAVE_THEN_EXIT, p)
    assert done.returncode == 0, done.stderr
    x = tf.load(p)["x"]
    assert x.shape == (16 << 20,) and (x == 7).all()


# PyTorch tensors saved in the background, the save awaited, then the interpreter exits: the
# save's own tree (native views of PyTorch memory) must be gone before the caller is woken,
# or the writer thread frees it while the exit tears the thread down (PyTorch's deleter
# then aborted the process: "terminate called without an active exception", status 134).
_TORCH_SAVE_AWAITED_THEN_EXIT = """
import sys, torch, tensorferry as tf
tree = {f"p{i}": torch.full((1024,), float(i)) for i in range(100)}
tf.save(tree, sys.argv[1] + ".a", fsync=False)
tf.load(sys.argv[1] + ".a", non_blocking=True).result()
tf.save(tree, sys.argv[1], fsync=False, non_blocking=True).wait()
"""


def test_an_interpreter_exits_cleanly_after_non_blocking_saves_and_loads_of_torch_tensors(tmp_path, torch):
    for _ in range(3):
        done = _run(_TORCH_SAVE_AWAITED_THEN_EXIT, tmp_path / "t.safetensors")
        assert done.returncode == 0, done.stderr


# A disk that takes a minute to write: the writer thread sleeps before the real save.
_SLOW_SAVE_THEN_EXIT = """
import sys, time, types, numpy as np, tensorferry as tf
from tensorferry import _api
native = _api._native
slow = types.ModuleType("slow_native")
slow.__dict__.update({k: getattr(native, k) for k in dir(native) if not k.startswith("__")})
def slow_save(*args):
    time.sleep(60)
    return native.save(*args)
slow.save = slow_save
_api._native = slow
tf.save({"x": np.ones(3)}, sys.argv[1], non_blocking=True)
print("exiting", flush=True)
"""


def test_ctrl_c_while_exit_waits_for_a_save_is_loud_and_exits_130(tmp_path):
    p = tmp_path / "slow.safetensors"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVE_THEN_EXIT, str(p)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "exiting"
        time.sleep(0.5)  # the interpreter is in its exit, waiting for the save
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 3
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted at exit" in err and "slow.safetensors" in err, err
    assert not p.exists()


# ---- Ctrl-C during a streamed device load --------------------------------------------------

_SLOW_DIRECT_LOAD = """
import sys, time, numpy as np, tensorferry as tf
p = sys.argv[1]
tf.save({"x": np.ones(20 << 20, np.uint8)}, p)
tf.configure_emulated(0, bandwidth_gbps=0.002)  # 2 MB/s: the load would take 10 s
print("loading", flush=True)
start = time.monotonic()
try:
    tf.load(p, device="emu:0", direct=True, staging=(1 << 20, 2))
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_interrupts_a_direct_load_onto_a_device_within_a_second(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_DIRECT_LOAD, str(tmp_path / "big.safetensors")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "loading"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert "interrupted" in out, (out, err)
    assert time.monotonic() - sent < 2, "KeyboardInterrupt came only after the load"


_SLOW_SAVE = """
import os, sys, time, numpy as np, tensorferry as tf
p = sys.argv[1]
tf.save({"old": np.zeros(4, np.uint8)}, p)
on_device = tf.to_device({"x": np.ones(20 << 20, np.uint8)}, "emu:0")
tf.configure_emulated(0, bandwidth_gbps=0.002)  # 2 MB/s: the save would take 10 s
print("saving", flush=True)
try:
    tf.save(on_device, p, staging=(1 << 20, 2))
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", sorted(tf.load(p)), flush=True)
"""


def test_ctrl_c_interrupts_a_blocking_save_within_a_second_and_the_file_stays_whole(tmp_path):
    p = tmp_path / "slow.safetensors"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVE, str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        line = proc.stdout.readline()
        answered = time.monotonic() - sent
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert line.startswith("interrupted"), (line, out, err)
    assert answered < 2, f"KeyboardInterrupt came {answered:.1f} s after Ctrl-C"
    # Read while the save went on: the old checkpoint, whole; the exit then waited for the
    # save, so the new one is there once the process has ended.
    assert "['old']" in line, line
    assert proc.returncode == 0, (proc.returncode, err)
    assert sorted(tf.load(p)) == ["x"]


# ---- a broadcast view bound for a device too small ----------------------------------------

_BROADCAST = """
import sys, time, numpy as np, tensorferry as tf
from resource import getrusage, RUSAGE_SELF
if sys.argv[1] == "torch":
    import torch
    view = torch.zeros(1, dtype=torch.float64).expand(1 << 26)  # 512 MiB logical, 8 bytes real
else:
    view = np.broadcast_to(np.zeros(1), (1 << 26,))
tf.configure_emulated(0, capacity_bytes=1 << 20)
before, start = getrusage(RUSAGE_SELF).ru_maxrss, time.monotonic()
try:
    tf.to_device({"x": view}, "emu:0")
except tf.OutOfMemoryError as e:
    print("refused:", e)
print((getrusage(RUSAGE_SELF).ru_maxrss - before) // 1024, time.monotonic() - start)
"""


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_broadcast_view_too_large_for_the_device_fails_before_any_host_copy(framework):
    if framework == "torch":
        pytest.importorskip("torch")
    done = _run(_BROADCAST, framework)
    assert done.returncode == 0, done.stderr
    refused, measured = done.stdout.strip().splitlines()
    assert "asked for 536870912 bytes, 1048576 free" in refused
    grew_mib, seconds = measured.split()
    assert int(grew_mib) < 64 and float(seconds) < 1, measured


# ---- arguments of the wrong kind -------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    p = tmp_path / "s.safetensors"
    tf.save({"a": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}, p)
    return p


@pytest.mark.parametrize("keys", [5, b"a", bytearray(b"a"), [b"a"], ["a", 3], 1.5])
def test_keys_of_the_wrong_kind_are_a_type_error_naming_keys(saved, keys):
    with pytest.raises(TypeError, match="keys") as info:
        tf.load(saved, keys=keys)
    assert isinstance(info.value, tf.TensorferryError)
    assert "str" in str(info.value) and "tuple" in str(info.value)


def test_keys_take_names_tuples_and_any_iterable_of_them(saved):
    assert list(tf.load(saved, keys="a")) == ["a"]
    assert list(tf.load(saved, keys=("b",))) == ["b"]
    assert sorted(tf.load(saved, keys={"a", "b"})) == ["a", "b"]
    assert sorted(tf.load(saved, keys=(k for k in ["a", "b"]))) == ["a", "b"]


@pytest.mark.parametrize("size", ["inf", "-inf", "nan", "1e400GB", 2**70, 2**63, 0, -5, "0.1B", "5XB"])
def test_max_shard_size_out_of_range_is_a_value_error_naming_it(tmp_path, size):
    with pytest.raises(tf.FormatError, match="max_shard_size") as info:
        tf.save({"a": np.ones(3)}, tmp_path / "m.safetensors", max_shard_size=size)
    assert isinstance(info.value, ValueError)
    assert "2**63 - 1" in str(info.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("size", [1.5e9, True, None.__class__])
def test_max_shard_size_of_the_wrong_type_is_a_type_error_naming_it(tmp_path, size):
    with pytest.raises(TypeError, match="max_shard_size") as info:
        tf.save({"a": np.ones(3)}, tmp_path / "m.safetensors", max_shard_size=size)
    assert isinstance(info.value, tf.TensorferryError)


def test_the_largest_shard_size_is_accepted(tmp_path):
    tf.save({"a": np.ones(3)}, tmp_path / "m.safetensors", max_shard_size=2**63 - 1)
    assert tf.load(tmp_path / "m.safetensors")["a"].sum() == 3


def _read_only():
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    return a, "read-only"


def _numpy_expanded():
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (3,), (0,)), "stride 0"


def _torch_inference():
    import torch

    with torch.inference_mode():
        return torch.zeros(3), "inference"


def _torch_expanded():
    import torch

    return torch.zeros(1).expand(3), "stride 0"


def _torch_sparse():
    import torch

    return torch.zeros(3).to_sparse(), "sparse"


def _torch_meta():
    import torch

    return torch.empty(3, device="meta"), "meta"


@pytest.mark.parametrize(
    "target", [_read_only, _numpy_expanded, _torch_inference, _torch_expanded, _torch_sparse, _torch_meta]
)
def test_a_target_of_out_that_cannot_be_written_is_named_and_nothing_is_filled(saved, target):
    if target.__name__.startswith("_torch"):
        pytest.importorskip("torch")
    bad, reason = target()
    fine = np.full(2, 5, np.float32)
    with pytest.raises(tf.FormatError) as info:
        tf.load(saved, out={"a": bad, "b": fine})
    text = str(info.value)
    assert "a: " in text and reason in text, text
    assert (fine == 5).all(), "nothing was written"
