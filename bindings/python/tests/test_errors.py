"""Errors: one base class, each kind also its built-in, with the reason in the message."""

import errno
import os
import re
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorferry as tf


def test_every_error_class_derives_from_the_base_and_its_builtin():
    assert issubclass(tf.FormatError, tf.TensorferryError) and issubclass(tf.FormatError, ValueError)
    assert issubclass(tf.DeviceUnavailableError, RuntimeError)
    assert issubclass(tf.OutOfMemoryError, MemoryError)
    assert issubclass(tf.InvalidDeviceError, ValueError)
    assert issubclass(tf.TensorferryIOError, OSError)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "", "cpu:0:1"])
def test_a_bad_device_string_is_a_value_error_listing_the_forms(bad):
    with pytest.raises(tf.InvalidDeviceError, match=r"cuda:N") as info:
        tf.to_device({"a": np.ones(1)}, bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, tf.TensorferryError)


def test_an_absent_gpu_raises_device_unavailable_with_the_reason():
    if any(d.startswith("cuda") for d in tf.devices()):
        pytest.skip("a CUDA device is present on this machine")
    src = {"a": np.ones(3)}
    with pytest.raises(tf.DeviceUnavailableError, match=r"cuda:0 is unavailable: .+"):
        tf.to_device(src, "cuda:0")
    np.testing.assert_array_equal(src["a"], np.ones(3))


def test_a_missing_file_is_an_os_error_with_errno_and_name(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(tf.TensorferryIOError) as info:
        tf.load(missing)
    assert isinstance(info.value, FileNotFoundError) or info.value.errno == 2
    assert str(missing) in str(info.value)


def test_devices_lists_the_host_first():
    assert tf.devices()[0] == "cpu"


# OSErrors the system did not number: errno None, the message in strerror, the path in
# filename (two-argument OSError construction had put the message in errno and the path
# in strerror). Each case loads or saves for real.


def _fifo(tmp_path):
    path = tmp_path / "pipe.safetensors"
    os.mkfifo(path)
    return path


def _nul_in_name(tmp_path):
    return str(tmp_path / "a\0b.safetensors")


def _existing(path):
    def case(_tmp_path):
        if not os.path.exists(path):
            pytest.skip(f"{path} is absent here")
        return path

    return case


def _with_deadline(fn, path, seconds=10.0):
    """``fn(path)``'s exception, failing the test (rather than hanging it) when it has not
    returned within ``seconds``; a read blocked on a FIFO is let go by opening its writer."""
    outcome = {}

    def run():
        try:
            fn(path)
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        if stat.S_ISFIFO(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"no answer within {seconds} s for {path!r}")
    assert "error" in outcome, f"{path!r} did not fail"
    return outcome["error"]


def _assert_unnumbered_os_error(e, path, reason):
    assert isinstance(e, tf.TensorferryIOError) and isinstance(e, OSError), repr(e)
    assert e.errno is None, repr(e.errno)
    assert isinstance(e.strerror, str) and re.search(reason, e.strerror), repr(e.strerror)
    assert str(path) not in e.strerror, repr(e.strerror)
    assert e.filename == str(path), repr(e.filename)
    assert str(e) == f"{e.strerror}: {str(path)!r}", str(e)
    assert "Errno" not in str(e)


def _load(path):
    tf.load(path)


def _read(path):
    tf.load(path, mmap=False)


def _save(path):
    tf.save({"a": np.ones(2)}, path)


@pytest.mark.parametrize("op", [_load, _read, _save], ids=["load", "load-read", "save"])
@pytest.mark.parametrize(
    "make, reason",
    [
        (_fifo, r"^(open|save to): is a FIFO, not a regular file$"),
        (_existing("/dev/zero"), r"^(open|save to): is a character device, not a regular file$"),
        (_nul_in_name, r"^(open|save to): file name contained an unexpected NUL byte$"),
    ],
    ids=["fifo", "dev-zero", "nul-in-name"],
)
def test_an_unnumbered_os_error_has_errno_none_the_message_and_the_path(tmp_path, make, reason, op):
    path = make(tmp_path)
    _assert_unnumbered_os_error(_with_deadline(op, path), path, reason)


@pytest.mark.parametrize("op", [_load, _read], ids=["load", "load-read"])
def test_a_proc_file_is_an_unnumbered_os_error_with_the_path(op):
    path = _existing("/proc/self/status")(None)
    _assert_unnumbered_os_error(_with_deadline(op, path), path, r"^open: is a file of /proc, not a regular file$")


def test_a_short_read_is_an_unnumbered_os_error_with_the_path(tmp_path):
    # A file cut short while it is read (another process truncating it) ends the read
    # early: no errno. A child flips its length between 4 KiB and full while this process
    # reads it whole (mmap=False), until one read comes up short.
    path = tmp_path / "shrinking.safetensors"
    tf.save({"a": np.ones(64 << 20, dtype=np.uint8)}, path, fsync=False)
    full = os.path.getsize(path)
    flipper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "p, n = sys.argv[1], int(sys.argv[2])\n"
            "while True:\n"
            "    os.truncate(p, 4096); time.sleep(0.0005); os.truncate(p, n); time.sleep(0.002)\n",
            str(path),
            str(full),
        ]
    )
    short = None
    try:
        deadline = time.monotonic() + 30
        while short is None and time.monotonic() < deadline:
            try:
                tf.load(path, mmap=False)
            except tf.TensorferryIOError as e:
                short = e
            except tf.FormatError:
                pass  # cut before the read began: the header check refuses it
    finally:
        flipper.kill()
        flipper.wait()
    assert short is not None, "no read came up short in 30 s"
    _assert_unnumbered_os_error(short, path, r"^read: ")


def test_a_truncated_file_is_a_format_error_not_an_os_error(tmp_path):
    path = tmp_path / "cut.safetensors"
    tf.save({"a": np.ones(1000, dtype=np.float32)}, path)
    os.truncate(path, os.path.getsize(path) - 100)
    for mmap in (True, False):
        with pytest.raises(tf.FormatError, match="past the end"):
            tf.load(path, mmap=mmap)


def test_a_numbered_os_error_keeps_errno_strerror_and_filename(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        tf.load(missing)
    e = info.value
    assert (e.errno, e.strerror, e.filename) == (errno.ENOENT, "open: No such file or directory", str(missing))
    assert str(e) == f"[Errno 2] open: No such file or directory: {str(missing)!r}"


@pytest.mark.parametrize(
    "text",
    [
        b'{"weight_map": {"a": "m-\xff.safetensors"}}',
        b'\xff\xfe{"weight_map": {}}',
        b'{"weight_map": {"a": "m.safetensors"}, "metadata": {"k": "\xc3\x28"}}',
    ],
    ids=["shard-name", "leading-bytes", "metadata-value"],
)
def test_a_non_utf8_index_is_a_format_error_naming_it(tmp_path, text):
    index = tmp_path / "m.safetensors.index.json"
    index.write_bytes(text)
    with pytest.raises(tf.FormatError, match=re.escape(str(index))) as info:
        tf.load(index)
    assert not isinstance(info.value, OSError)


@pytest.mark.parametrize(
    "text",
    [b"", b"{", b"[]", b'{"weight_map": 5}', b'{"weight_map": {"a": 5}}'],
    ids=["empty", "unclosed", "array", "map-not-object", "shard-not-string"],
)
def test_a_malformed_index_is_a_format_error_naming_it(tmp_path, text):
    index = tmp_path / "m.safetensors.index.json"
    index.write_bytes(text)
    with pytest.raises(tf.FormatError, match=re.escape(str(index))) as info:
        tf.load(index)
    assert not isinstance(info.value, OSError)
