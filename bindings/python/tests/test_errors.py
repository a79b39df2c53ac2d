"""Errors: one base class, each kind also its built-in, with the reason in the message."""

import ast
import builtins
import errno
import os
import pathlib
import pickle
import re
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorferry as tf


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (tf.FormatError, ValueError),
        (tf.InvalidDeviceError, ValueError),
        (tf.DeviceUnavailableError, RuntimeError),
        (tf.CopyError, RuntimeError),
        (tf.ProcessGroupError, RuntimeError),
        (tf.TensorferryRuntimeError, RuntimeError),
        (tf.OutOfMemoryError, MemoryError),
        (tf.OutOfMemoryError, RuntimeError),  # as torch.OutOfMemoryError is
        (tf.TensorferryIOError, OSError),
        (tf.TensorferryKeyError, KeyError),
        (tf.TensorferryTypeError, TypeError),
        (tf.TensorferryOverflowError, OverflowError),
        (tf.TensorferryBufferError, BufferError),
    ],
)
def test_every_error_class_derives_from_the_base_and_its_builtin(cls, builtin):
    assert issubclass(cls, tf.TensorferryError) and issubclass(cls, builtin)


def test_every_exported_error_class_is_in_the_hierarchy():
    exported = [getattr(tf, n) for n in tf.__all__ if n.endswith("Error")]
    assert tf.CopyError in exported
    assert all(issubclass(c, tf.TensorferryError) for c in exported)


# ---- no bare built-in raise: every error the package raises is a TensorferryError

PACKAGE = pathlib.Path(tf.__file__).parent
BINDING_SRC = pathlib.Path(__file__).parent.parent / "src"
_BUILTIN_ERRORS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
# Raises that are protocol, not failure: what Python itself requires them to be.
_PROTOCOL = {"StopIteration", "StopAsyncIteration", "KeyboardInterrupt", "SystemExit", "GeneratorExit"}
# A branch that cannot run: a bug of tensorferry's, not an error of the caller's.
_UNREACHABLE = {"AssertionError"}
# By the function that raises: `__getattr__` must raise AttributeError (hasattr, module
# attributes made on first use); a Future's `result(timeout=)` raises TimeoutError, as
# concurrent.futures does.
_BY_FUNCTION = {"__getattr__": {"AttributeError"}, "result": {"TimeoutError"}}


def _bare_raises(path):
    """``(line, class name)`` of every ``raise`` of a built-in exception class in the
    file, outside the exemptions above."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Attribute) and isinstance(exc.value, ast.Name) and exc.value.id == "builtins":
                name = exc.attr
            else:
                name = exc.id if isinstance(exc, ast.Name) else None
            allowed = _PROTOCOL | _UNREACHABLE | _BY_FUNCTION.get(function, set())
            if name in _BUILTIN_ERRORS and name not in allowed:
                found.append((node.lineno, name))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_the_package_raises_no_bare_builtin_exception():
    files = sorted(PACKAGE.glob("*.py"))
    assert files, PACKAGE
    bare = [f"{p.name}:{line}: raise {name}" for p in files for line, name in _bare_raises(p)]
    assert not bare, "raise a class of tensorferry._errors instead (each is also its built-in):\n" + "\n".join(bare)


def test_the_binding_creates_no_bare_builtin_exception():
    if not BINDING_SRC.is_dir():
        pytest.skip("the binding's Rust source is not beside the tests")
    # `AttributeError` alone: `__cuda_array_interface__` on a tensor that has none (so
    # that `hasattr` says no).
    bare = [
        f"{p.name}:{i}: {m.group(0)}"
        for p in sorted(BINDING_SRC.glob("*.rs"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for m in re.finditer(r"Py(\w+)::new_err", line)
        if m.group(1) != "AttributeError"
    ]
    assert not bare, "use the constructors of errors.rs instead:\n" + "\n".join(bare)


def test_the_scan_finds_a_bare_raise(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('bare')\n"
        "    raise builtins.TypeError\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(name)\n"
    )
    assert _bare_raises(src) == [(3, "ValueError"), (4, "TypeError")]


# ---- a failed copy is a CopyError, not an unavailable device


def test_a_failed_copy_is_a_copy_error_naming_the_device_and_the_cause(failing_emu0):
    src = {"x": np.arange(100, dtype=np.float32)}
    with pytest.raises(tf.CopyError, match=r"a copy on emu:0 failed \(filling 'x'\): injected fault") as info:
        tf.to_device(src, failing_emu0)
    e = info.value
    assert (e.device, e.key) == ("emu:0", "x") and "fail_copy=1" in e.cause
    assert not isinstance(e, tf.DeviceUnavailableError)
    np.testing.assert_array_equal(src["x"], np.arange(100, dtype=np.float32))


@pytest.mark.parametrize("catch", [RuntimeError, tf.TensorferryError], ids=["RuntimeError", "TensorferryError"])
def test_a_failed_copy_is_caught_as_runtime_error_and_as_the_base(failing_emu0, catch):
    try:
        tf.to_device({"x": np.ones(10)}, failing_emu0)
    except catch as e:
        assert isinstance(e, tf.CopyError) and "emu:0" in str(e)
    else:
        pytest.fail("the injected fault raised nothing")


def test_a_failed_copy_says_which_of_the_waited_tensors_met_it(failing_emu0):
    # The native wait gives the position of the tensor; a caller that knows the key paths
    # names the key with naming_key.
    from tensorferry._errors import naming_key

    with pytest.raises(tf.CopyError) as info:
        tf.to_device({"x": np.ones(10)}, failing_emu0)
    assert info.value.index == 0
    assert naming_key(info.value, ["x"]).key == "x"


def test_a_copy_error_survives_pickling():
    e = pickle.loads(pickle.dumps(tf.CopyError("cuda:1", "an illegal address", key="w")))
    assert (type(e), e.device, e.cause, e.key) == (tf.CopyError, "cuda:1", "an illegal address", "w")
    assert str(e) == "a copy on cuda:1 failed (filling 'w'): an illegal address"


def test_an_os_error_subclass_survives_pickling():
    # Errors cross processes so (DCP gathers every rank's failure).
    from tensorferry._errors import io_error

    e = pickle.loads(pickle.dumps(io_error(errno.EEXIST, "a checkpoint exists there", "/ckpt/.metadata")))
    assert isinstance(e, FileExistsError) and isinstance(e, tf.TensorferryIOError)
    assert (e.errno, e.filename) == (errno.EEXIST, "/ckpt/.metadata")


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


@pytest.mark.parametrize("move", ["to_device", "to_host"])
def test_a_failed_non_blocking_copy_names_its_key_when_the_handle_is_awaited(move):
    src = {"model": {"w": np.arange(100, dtype=np.float32)}, "step": 3}
    if move == "to_host":
        src = tf.to_device(src, "emu:0")
    tf.configure_emulated(0, fail_copy=1)
    try:
        pending = getattr(tf, move)(src, *(("emu:0",) if move == "to_device" else ()), non_blocking=True)
        with pytest.raises(tf.CopyError) as info:
            pending.result()
    finally:
        tf.configure_emulated(0)
    assert (info.value.device, info.value.key) == ("emu:0", "model/w"), str(info.value)


def test_the_host_is_also_cpu_0_as_pytorch_and_jax_name_it(torch):
    src = {"a": np.ones(3)}
    for device in ("cpu:0", torch.device("cpu", 0), torch.device("cpu:0")):
        got = tf.to_device(src, device, copy=True)
        np.testing.assert_array_equal(got["a"], src["a"])
    with pytest.raises(tf.InvalidDeviceError, match=r"cpu:0"):
        tf.to_device(src, "cpu:1")


@pytest.mark.parametrize("call", ["to_host", "to_device", "load", "load_non_blocking"])
def test_like_naming_a_framework_that_cannot_be_imported_is_an_error_everywhere(call, tmp_path, monkeypatch):
    """Never a quiet fallback to NumPy: the same typed error from every function."""
    import builtins

    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "jax" or name.startswith("jax."):
            raise ImportError("no jax here")
        return real(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "jax", raising=False)
    monkeypatch.setattr(builtins, "__import__", refuse)
    src = {"a": np.ones(3, np.float32)}
    tf.save(src, tmp_path / "a.safetensors")
    run = {
        "to_host": lambda: tf.to_host(src, like="jax"),
        "to_device": lambda: tf.to_device(src, "cpu", like="jax"),
        "load": lambda: tf.load(tmp_path / "a.safetensors", like="jax"),
        "load_non_blocking": lambda: tf.load(tmp_path / "a.safetensors", like="jax", non_blocking=True),
    }[call]
    with pytest.raises(tf.FormatError, match=r"like='jax': jax cannot be imported"):
        run()


def test_argument_errors_name_what_was_given():
    with pytest.raises(tf.FormatError, match=r"host has no pool of its own") as info:
        tf.pinned_pool_stats("cpu")
    assert "backend" not in str(info.value)
    with pytest.raises(tf.FormatError, match=r'configure_emulated.*unknown key "bogus"') as info:
        tf.configure_emulated(0, bogus=1)
    assert "TENSORFERRY_EMU" not in str(info.value)
