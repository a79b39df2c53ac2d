"""The emulated device emu:N runs the transfer engine without a GPU: moves, waits, faults."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorferry as tf


@pytest.fixture
def emu1():
    """emu:1 with clean settings before and after the test."""
    tf.configure_emulated(1)
    yield "emu:1"
    tf.configure_emulated(1)


def test_emulated_devices_are_listed():
    assert "emu:0" in tf.devices() and "emu:1" in tf.devices()


def test_a_dictionary_goes_to_the_device_and_back(state):
    there = tf.to_device(state, "emu:0")
    w = there["model"]["layer.0.weight"]
    assert isinstance(w, tf.Tensor) and w.device == "emu:0"
    assert there["tag"] is state["tag"] and there["optimizer"]["lr"] is state["optimizer"]["lr"]
    back = tf.to_numpy(there)
    np.testing.assert_array_equal(back["model"]["layer.0.weight"], state["model"]["layer.0.weight"])
    np.testing.assert_array_equal(back["ids"], state["ids"])


def test_data_lists_go_straight_to_the_device():
    out = tf.to_device({"ids": [[1, 2], [3, 4]]}, "emu:0")
    assert out["ids"].device == "emu:0" and out["ids"].dtype == "int64"
    np.testing.assert_array_equal(out["ids"].numpy(), [[1, 2], [3, 4]])


def test_numpy_of_a_device_tensor_copies_to_the_host():
    t = tf.to_device({"x": np.arange(5.0)}, "emu:0")["x"]
    arr = np.asarray(t)
    np.testing.assert_array_equal(arr, np.arange(5.0))
    with pytest.raises(BufferError):
        t.__dlpack__()


def test_tensordict_moves_and_waits(state):
    # Its non-blocking moves (a Transfer of a TensorDict) are test_tensordict.py's.
    td = tf.TensorDict(state).to("emu:0")
    assert td.device == "emu:0"
    assert td.wait() is td and td.is_ready()
    np.testing.assert_array_equal(td.cpu().numpy()["ids"], state["ids"])


def test_non_blocking_returns_early_and_the_result_waits(emu1, state):
    tf.configure_emulated(1, latency_us=300_000)
    pending = tf.to_device(state, emu1, non_blocking=True)
    assert not pending.done()
    back = tf.to_numpy(pending.result())
    assert pending.done()
    np.testing.assert_array_equal(back["model"]["layer.0.weight"], state["model"]["layer.0.weight"])


def test_a_source_dropped_at_once_is_still_copied(emu1):
    tf.configure_emulated(1, latency_us=100_000)
    src = {"x": np.arange(1000, dtype=np.int32)}
    pending = tf.to_device(src, emu1, non_blocking=True)
    del src
    gc.collect()
    np.testing.assert_array_equal(pending.result()["x"].numpy(), np.arange(1000, dtype=np.int32))


def test_a_failing_allocation_is_out_of_memory_and_the_source_is_intact(emu1, state):
    tf.configure_emulated(1, fail_alloc=1)
    before = state["model"]["layer.0.weight"].copy()
    with pytest.raises(tf.OutOfMemoryError, match=r"emu:1.*asked for \d+ bytes") as info:
        tf.to_device(state, emu1)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, RuntimeError)
    np.testing.assert_array_equal(state["model"]["layer.0.weight"], before)


def test_a_failing_copy_raises_and_returns_nothing(emu1, state):
    tf.configure_emulated(1, fail_copy=1)
    with pytest.raises(tf.CopyError, match=r"a copy on emu:1 failed \(filling .model/layer.0.weight.\): injected fault"):
        tf.to_device(state, emu1)
    assert tf.to_device(state, emu1)["ids"].device == emu1  # the next copy works


def test_bad_settings_are_a_value_error():
    with pytest.raises(ValueError, match="unknown key"):
        tf.configure_emulated(0, speed=3)


def test_the_environment_variable_configures_the_device():
    code = (
        "import numpy as np, tensorferry as tf\n"
        "try:\n"
        "    tf.to_device({'x': np.ones(100)}, 'emu:0')\n"
        "except tf.OutOfMemoryError as e:\n"
        "    print('OOM', e)\n"
    )
    env = dict(os.environ, TENSORFERRY_EMU="capacity_bytes=64")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("OOM") and "64" in out.stdout


def test_torch_tensors_go_to_the_device_and_back(torch):
    src = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}
    there = tf.to_device(src, "emu:0")
    np.testing.assert_array_equal(tf.to_numpy(there)["w"], src["w"].numpy())


def test_pinned_results_reuse_the_pool(emu1, state):
    there = tf.to_device(state, emu1)
    first = tf.to_host(there, pinned=True)
    np.testing.assert_array_equal(tf.to_numpy(first)["ids"], state["ids"])
    stats = tf.pinned_pool_stats(emu1)
    del first
    gc.collect()
    second = tf.to_numpy(tf.to_host(there, pinned=True))
    np.testing.assert_array_equal(second["model"]["layer.0.weight"], state["model"]["layer.0.weight"])
    again = tf.pinned_pool_stats(emu1)
    assert again["misses"] == stats["misses"] and again["hits"] == stats["hits"] + 1
    assert again["pinned_bytes"] == stats["pinned_bytes"]


def test_a_raw_stream_handle_without_a_driver_says_why(state):
    if any(d.startswith("cuda") for d in tf.devices()):
        pytest.skip("a CUDA device is present")
    with pytest.raises(tf.DeviceUnavailableError, match="driver"):
        tf.to_host(state, stream=12345)


def test_a_mixed_device_dictionary_comes_home_in_one_call(state):
    mixed = {"a": tf.to_device(state, "emu:0")["ids"], "b": tf.to_device(state, "emu:1")["ids"], "c": state["ids"]}
    out = tf.to_numpy(tf.to_host(mixed))
    for k in "abc":
        np.testing.assert_array_equal(out[k], state["ids"])


@pytest.mark.parametrize("staging", ["on", "off", "auto", (4096, 2)])
def test_every_staging_choice_keeps_the_values(state, staging):
    there = tf.to_device(state, "emu:0", staging=staging, copy=True)
    back = tf.to_host(there, staging=staging)
    np.testing.assert_array_equal(back["model"]["layer.0.weight"].numpy(), state["model"]["layer.0.weight"])
    np.testing.assert_array_equal(back["ids"].numpy(), state["ids"])


def test_a_staged_non_blocking_chain_reads_correctly(emu1):
    tf.configure_emulated(1, latency_us=2000)
    src = {f"t{i}": np.full((1000,), i, np.float32) for i in range(50)}
    there = tf.to_device(src, emu1, non_blocking=True, staging=(8192, 2)).result()
    back = tf.to_numpy(tf.to_host(there, non_blocking=True, staging=(8192, 3)).result())
    for i in range(50):
        np.testing.assert_array_equal(back[f"t{i}"], src[f"t{i}"])


def _queued(tensor, device):
    """``tensor`` moved to ``device`` by the engine without waiting: a ``tensorferry.Tensor``
    whose copy may still run (the public calls hand such tensors only to a Transfer, which
    waits for them; the tensor itself must make every early read wait too)."""
    return tf._native.move_tensors([tensor], device, False, True)[0]


def _failed_non_blocking_result(direction):
    """A result whose non-blocking copy failed: device to host, or host to device."""
    src = np.arange(1000, dtype=np.float32)
    if direction == "to_host":
        on_device = tf.to_device({"x": src}, "emu:1")["x"]
        tf.configure_emulated(1, fail_copy=1, latency_us=20_000)
        return _queued(on_device, "cpu")
    tf.configure_emulated(1, fail_copy=1, latency_us=20_000)
    return _queued(tf.Tensor.from_numpy(src), "emu:1")


READS = {
    "numpy()": lambda t, p: t.numpy(),
    "np.asarray": lambda t, p: np.asarray(t),
    "to_numpy": lambda t, p: tf.to_numpy({"x": t}),
    "dlpack": lambda t, p: np.from_dlpack(t),
    "save": lambda t, p: tf.save({"x": t}, p),
    "wait": lambda t, p: t.wait(),
    "to_host": lambda t, p: tf.to_host({"x": t}, copy=True),
    "copy": lambda t, p: t.copy(),
}


@pytest.mark.parametrize("when", ["still running", "already failed"])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
@pytest.mark.parametrize("read", READS)
def test_every_read_of_a_failed_non_blocking_copy_raises_its_error(emu1, direction, read, when, tmp_path):
    import time

    if direction == "to_device" and read in ("dlpack",):
        pytest.skip("emulated memory has no DLPack device")
    result = _failed_non_blocking_result(direction)
    if when == "already failed":
        deadline = time.monotonic() + 10
        while not result.is_ready and time.monotonic() < deadline:
            time.sleep(0.005)
        assert result.is_ready
    else:
        assert not result.is_ready
    p = tmp_path / "f.safetensors"
    with pytest.raises(tf.CopyError, match="emu:1") as info:
        READS[read](result, p)
    assert "fail" in str(info.value)
    assert not p.exists()


def _interrupt_soon(seconds=0.2):
    """Ctrl-C in ``seconds``, as a user would press it: with Python's own SIGINT handler in
    place (another test or library may have left another one, which ``interrupt_main``
    would then silently skip)."""
    import _thread
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


@pytest.mark.parametrize("wait", ["wait", "numpy", "blocking to_host", "blocking to_device"])
def test_ctrl_c_interrupts_a_wait_and_reaches_the_user_as_itself(emu1, wait):
    import time

    tf.configure_emulated(1, latency_us=1_500_000)
    src = {"x": np.arange(4.0)}
    pending = _queued(tf.Tensor.from_numpy(src["x"]), "emu:1")
    calls = {
        "wait": lambda: pending.wait(),
        "numpy": lambda: pending.numpy(),
        "blocking to_host": lambda: tf.to_host({"x": pending}),
        "blocking to_device": lambda: tf.to_device(src, "emu:1"),
    }
    assert not pending.is_ready, "the emulated latency did not hold the copy"
    timer = _interrupt_soon()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            calls[wait]()
        assert not isinstance(info.value, tf.TensorferryError)
        assert time.monotonic() - start < 1.2, "interrupted well before the copy ended"
    finally:
        timer.cancel()
    # The copy went on in the background and completes correctly.
    np.testing.assert_array_equal(pending.numpy(), src["x"])


# -- non-blocking calls: the Transfer handle ---------------------------------------------


def _slow_device_dict(emu1, latency_us=300_000):
    src = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(3), "step": 7, "tag": "x"}
    on_device = tf.to_device(src, emu1)
    tf.configure_emulated(1, latency_us=latency_us)
    return src, on_device


def test_non_blocking_to_numpy_returns_a_transfer_at_once_and_its_result_after(emu1):
    import time

    src, on_device = _slow_device_dict(emu1)
    start = time.monotonic()
    pending = tf.to_numpy(on_device, non_blocking=True)
    assert time.monotonic() - start < 0.15, "returned before the 300 ms copy"
    assert isinstance(pending, tf.Transfer) and not pending.done()
    out = pending.result()
    assert pending.done()
    np.testing.assert_array_equal(out["w"], src["w"])
    np.testing.assert_array_equal(out["b"], src["b"])
    assert out["step"] == 7 and out["tag"] is src["tag"]
    assert pending.result() is out, "the result is made once"


def test_a_transfer_can_be_awaited(emu1):
    import asyncio

    src, on_device = _slow_device_dict(emu1, latency_us=100_000)

    async def main():
        pending = tf.to_numpy(on_device, non_blocking=True)
        ticks = 0
        task = asyncio.ensure_future(_await(pending))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return task.result(), ticks

    async def _await(p):
        return await p

    out, ticks = asyncio.run(main())
    np.testing.assert_array_equal(out["w"], src["w"])
    assert ticks > 3, "the event loop ran while the copy was in flight"


def test_ctrl_c_interrupts_a_transfers_wait(emu1):
    src, on_device = _slow_device_dict(emu1, latency_us=1_500_000)
    pending = tf.to_numpy(on_device, non_blocking=True)
    timer = _interrupt_soon()
    try:
        with pytest.raises(KeyboardInterrupt):
            pending.result()
    finally:
        timer.cancel()
    np.testing.assert_array_equal(pending.result()["w"], src["w"])


def test_non_blocking_moves_to_tensorferry_tensors_come_through_a_transfer_too(emu1):
    src, on_device = _slow_device_dict(emu1)
    pending = tf.to_host(on_device, non_blocking=True)
    assert isinstance(pending, tf.Transfer), "one handle, whatever the leaves"
    assert not pending.done()
    out = pending.result()
    assert isinstance(out["w"], tf.Tensor) and out["w"].is_ready
    np.testing.assert_array_equal(out["w"].numpy(), src["w"])


def test_non_blocking_to_host_of_numpy_sources_is_a_transfer_of_numpy(emu1):
    # Host to host copies of NumPy leaves give NumPy arrays: a handle, whatever the speed.
    src = {"w": np.arange(5.0)}
    pending = tf.to_host(src, copy=True, non_blocking=True)
    assert isinstance(pending, tf.Transfer)
    out = pending.result()
    np.testing.assert_array_equal(out["w"], src["w"])
    assert not np.shares_memory(out["w"], src["w"])


def _values(t):
    """The values of a NumPy array or PyTorch tensor as NumPy (bfloat16 as float32)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float32) if t.dtype.name == "bfloat16" else t
    import torch

    t = t.detach().resolve_conj()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _small_torch_state(torch):
    """Many small PyTorch tensors in groups of one dtype and shape (rows of 64-byte
    multiples, which are stacked), with a transposed one, a gradient-tracking parameter, a
    conjugate view and booleans among them, and odd ones out: 10-byte rows, a lone shape."""
    g = torch.Generator().manual_seed(0)
    src = {f"w{i}": torch.randn(8, 4, generator=g) for i in range(40)}
    src.update({f"b{i}": torch.arange(i, i + 16, dtype=torch.int32) for i in range(12)})
    src["t0"] = torch.randn(4, 8, generator=g).t()  # shape (8, 4) too, not contiguous
    src["p"] = torch.nn.Parameter(torch.randn(8, 4, generator=g))
    src["c0"] = torch.randn(8, dtype=torch.complex64, generator=g).conj()
    src["c1"] = torch.randn(8, dtype=torch.complex64, generator=g)
    src["m0"] = torch.rand(64, generator=g) > 0.5
    src["m1"] = torch.rand(64, generator=g) > 0.5
    src["h0"] = torch.randn(5, generator=g).to(torch.bfloat16)  # rows of 10 bytes: one by one
    src["h1"] = torch.randn(5, generator=g).to(torch.bfloat16)
    src["lone"] = torch.randn(7, generator=g)
    src["tag"] = "run-1"
    return src


def test_many_small_torch_tensors_reach_the_device_with_their_values(torch):
    src = _small_torch_state(torch)
    before = {k: v.detach().clone() for k, v in src.items() if isinstance(v, torch.Tensor)}
    there = tf.to_device(src, "emu:0")
    assert there["tag"] is src["tag"]
    for k, want in before.items():
        got = there[k]
        assert isinstance(got, tf.Tensor) and got.device == "emu:0", k
        assert tuple(got.shape) == tuple(want.shape) and got.dtype == str(want.dtype).removeprefix("torch."), k
        np.testing.assert_array_equal(_values(got.numpy()), _values(want), err_msg=k)
        assert torch.equal(src[k].detach(), want), k  # the source is untouched
    # The groups were stacked: rows of one buffer, each 64-byte aligned as the engine
    # places tensors; rows of 10 bytes were moved one by one.
    assert there["w2"].data_ptr - there["w1"].data_ptr == 8 * 4 * 4
    assert there["m1"].data_ptr - there["m0"].data_ptr == 64
    assert all(there[k].data_ptr % 64 == 0 for k in before)
    # Rows of one stack are tensors of their own: dropping the others keeps each alive.
    keep = there["w7"]
    del there
    gc.collect()
    np.testing.assert_array_equal(keep.numpy(), before["w7"].numpy())


def test_many_small_torch_tensors_moved_without_blocking_are_read_after_their_copy(emu1, torch):
    import time

    tf.configure_emulated(1, latency_us=300_000)
    src = _small_torch_state(torch)
    start = time.monotonic()
    pending = tf.to_device(src, emu1, non_blocking=True)
    assert time.monotonic() - start < 0.15, "returned before the 300 ms copy"
    assert not pending.done()
    back = tf.to_numpy(pending.result())
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            np.testing.assert_array_equal(_values(back[k]), _values(v), err_msg=k)


def _use_emu_in_forked_child(conn):
    try:
        tf.to_device({"a": np.ones(3, np.float32)}, "emu:0")
        conn.send("moved")
    except tf.DeviceUnavailableError as e:
        conn.send(str(e))
    except BaseException as e:  # anything else is the test's failure, said by name
        conn.send(f"{type(e).__name__}: {e}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_after_devices_were_used_gets_a_clear_error_not_a_hang(state):
    import multiprocessing
    import warnings

    tf.to_device(state, "emu:0")  # the device's stream thread runs in this process
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        child = ctx.Process(target=_use_emu_in_forked_child, args=(there,))
        child.start()
    try:
        assert here.poll(60), "the forked child hung"
        message = here.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert "forked" in message and "spawn" in message, message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_parent_that_only_failed_to_get_a_device_forks_children_that_can_use_one():
    script = """
import multiprocessing, warnings
import numpy as np
import tensorferry as tf

try:
    tf.to_device({"a": np.ones(2)}, "emu:99")
except tf.DeviceUnavailableError:
    pass

def child(conn):
    conn.send(float(tf.to_numpy(tf.to_device({"a": np.ones(2)}, "emu:0"))["a"].sum()))

ctx = multiprocessing.get_context("fork")
here, there = ctx.Pipe()
p = ctx.Process(target=child, args=(there,))
p.start()
assert here.poll(60), "the child hung"
print(here.recv())
p.join(10)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr
