"""One contract for every moving function (to_host, to_device, to_numpy, save, load): the
same keywords with the same defaults, ``non_blocking=True`` always a ``Transfer`` whose
result is the blocking call's, ``like=`` wherever tensors come back, and typed errors.

Every function runs over every kind of leaf this machine has: NumPy, PyTorch and JAX on
the host, ``tensorferry.Tensor`` on the host, on the emulated device and on a CUDA device
(the fake driver's, in scripts/test.sh), lists of numbers.
"""

import inspect
import time

import numpy as np
import pytest
from _trees import assert_same

import tensorferry as tf

MOVING = ("to_host", "to_device", "to_numpy", "save", "load")
SHARED_DEFAULTS = {"non_blocking": False, "stream": None, "staging": "auto"}
RETURNING_TENSORS = ("to_host", "to_device", "load")


# -- the leaves ----------------------------------------------------------------------------


def _numpy():
    return np.arange(6, dtype=np.float32).reshape(2, 3)


def _leaf_numpy():
    return _numpy()


def _leaf_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    return torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _leaf_jax():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    jax.config.update("jax_platforms", "cpu")
    return jax.numpy.arange(6, dtype=jax.numpy.float32).reshape(2, 3)


def _leaf_native_cpu():
    return tf.Tensor.from_numpy(_numpy())


def _leaf_native_emu():
    return tf.to_device({"x": _numpy()}, "emu:0")["x"]


def _leaf_native_cuda():
    if "cuda:0" not in tf.devices():
        pytest.skip("no CUDA device (scripts/test.sh runs these on the fake driver)")
    return tf.to_device({"x": _numpy()}, "cuda:0")["x"]


def _leaf_list():
    return [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


LEAVES = {
    "numpy": _leaf_numpy,
    "torch": _leaf_torch,
    "jax": _leaf_jax,
    "tensorferry-cpu": _leaf_native_cpu,
    "tensorferry-emu": _leaf_native_emu,
    "tensorferry-cuda": _leaf_native_cuda,
    "list": _leaf_list,
}


def _tree(kind):
    return {"model": {"w": LEAVES[kind]()}, "step": 3, "tag": "run-1"}


# -- the calls -----------------------------------------------------------------------------


def _call(name, tree, tmp_path, tag, **kw):
    """``name`` called on ``tree`` with ``kw``: what it returns (save: None)."""
    if name == "to_host":
        return tf.to_host(tree, **kw)
    if name == "to_device":
        return tf.to_device(tree, "emu:0", **kw)
    if name == "to_numpy":
        return tf.to_numpy(tree, **kw)
    if name == "save":
        return tf.save(tree, tmp_path / f"{tag}.safetensors", **kw)
    src = tmp_path / "src.safetensors"
    if not src.exists():
        tf.save(tree, src)
    return tf.load(src, **kw)


def _values(x):
    """A leaf's values as NumPy, whatever its framework and device."""
    if isinstance(x, tf.Tensor):
        return x.numpy()
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _saved(tmp_path, tag):
    return tf.to_numpy(tf.load(tmp_path / f"{tag}.safetensors"))


# -- non_blocking=True: one handle, the blocking call's result -------------------------------


@pytest.mark.parametrize("kind", LEAVES)
@pytest.mark.parametrize("name", MOVING)
def test_non_blocking_returns_a_transfer_whose_result_is_the_blocking_result(name, kind, tmp_path):
    tree = _tree(kind)
    blocking = _call(name, tree, tmp_path, "blocking")
    pending = _call(name, tree, tmp_path, "pending", non_blocking=True)
    assert isinstance(pending, tf.Transfer), f"{name}(non_blocking=True) gave {type(pending).__name__}"
    got = pending.result(timeout=60)
    assert pending.done() and pending.exception() is None
    if name == "save":
        assert blocking is None and got is None
        assert_same(_saved(tmp_path, "pending"), _saved(tmp_path, "blocking"))
    else:
        assert_same(got, blocking)


@pytest.mark.parametrize("name", MOVING)
def test_a_transfer_can_be_awaited(name, tmp_path):
    import asyncio

    tree = _tree("numpy")

    async def main():
        return await _call(name, tree, tmp_path, "awaited", non_blocking=True)

    got = asyncio.run(main())
    if name != "save":
        assert_same(got, _call(name, tree, tmp_path, "blocking"))


@pytest.fixture
def slow_emu1():
    tf.configure_emulated(1, latency_us=300_000)
    yield "emu:1"
    tf.configure_emulated(1)


@pytest.mark.parametrize("name", ["to_host", "to_device", "to_numpy"])
def test_a_transfer_is_not_done_before_its_copies_and_its_result_waits_for_them(name, slow_emu1):
    src = {"w": np.arange(1000, dtype=np.float32)}
    if name == "to_device":
        start = time.monotonic()
        pending = tf.to_device(src, slow_emu1, non_blocking=True)
    else:
        on_device = tf.to_device(src, slow_emu1)
        start = time.monotonic()
        pending = getattr(tf, name)(on_device, non_blocking=True)
    assert time.monotonic() - start < 0.15, "returned before the 300 ms copy"
    assert not pending.done()
    assert pending.wait(timeout=0.01) is False
    with pytest.raises(TimeoutError):
        pending.result(timeout=0.01)
    np.testing.assert_array_equal(_values(pending.result()["w"]), src["w"])
    assert pending.done()


@pytest.mark.parametrize("name", ["to_host", "to_device", "to_numpy"])
def test_a_failed_copy_is_raised_by_result_every_time(name):
    tf.configure_emulated(1)
    try:
        src = {"w": np.arange(10.0)}
        on_device = tf.to_device(src, "emu:1")
        tf.configure_emulated(1, fail_copy=1, latency_us=20_000)
        if name == "to_device":
            pending = tf.to_device(src, "emu:1", non_blocking=True)
        else:
            pending = getattr(tf, name)(on_device, non_blocking=True)
        for _ in range(2):
            with pytest.raises(tf.CopyError, match="emu:1"):
                pending.result()
        assert isinstance(pending.exception(), tf.CopyError)
    finally:
        tf.configure_emulated(1)


def test_a_failed_non_blocking_load_is_raised_by_result(tmp_path):
    pending = tf.load(tmp_path / "missing.safetensors", non_blocking=True)
    assert isinstance(pending, tf.Transfer)
    with pytest.raises(FileNotFoundError) as info:
        pending.result(timeout=60)
    assert isinstance(info.value, tf.TensorferryError)


def test_a_non_blocking_load_onto_a_device_gives_device_tensors(tmp_path):
    tf.save({"w": _numpy()}, tmp_path / "x.safetensors")
    got = tf.load(tmp_path / "x.safetensors", device="emu:0", non_blocking=True).result(timeout=60)
    assert got["w"].device == "emu:0"
    np.testing.assert_array_equal(got["w"].numpy(), _numpy())


@pytest.mark.parametrize("name", ["to_host", "to_device", "to_numpy", "save"])
def test_a_transfer_passed_on_as_a_tree_is_refused_naming_result(name, tmp_path):
    pending = tf.to_host({"w": _numpy()}, non_blocking=True)
    with pytest.raises(tf.TensorferryTypeError, match=r"\.result\(\)"):
        _call(name, pending, tmp_path, "handle")


# -- the same keywords, the same defaults -------------------------------------------------


@pytest.mark.parametrize("name", MOVING)
def test_every_moving_function_takes_the_shared_keywords_with_the_same_defaults(name):
    params = inspect.signature(getattr(tf, name)).parameters
    for keyword, default in SHARED_DEFAULTS.items():
        assert keyword in params, f"{name} has no {keyword}="
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, (name, keyword)
        assert params[keyword].default == default, (name, keyword, params[keyword].default)


@pytest.mark.parametrize("name", RETURNING_TENSORS)
def test_every_function_returning_tensors_takes_like(name):
    params = inspect.signature(getattr(tf, name)).parameters
    assert "like" in params and params["like"].default is None
    assert params["like"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("name", ["save", "load"])
def test_save_and_load_take_progress_off_by_default(name):
    params = inspect.signature(getattr(tf, name)).parameters
    assert params["progress"].default is False and params["progress"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("kind", ["numpy", "tensorferry-emu"])
@pytest.mark.parametrize("name", MOVING)
def test_a_bad_staging_is_a_format_error_on_every_function_whatever_moves(name, kind, non_blocking, tmp_path):
    tree = _tree(kind)
    tf.save(tree, tmp_path / "src.safetensors")
    with pytest.raises(tf.FormatError, match="staging"):
        _call(name, tree, tmp_path, "bad", staging="sometimes", non_blocking=non_blocking).result(timeout=60)


@pytest.mark.parametrize("name", ["to_device", "load"])
def test_a_device_is_taken_in_every_form(name, tmp_path, torch):
    p = tmp_path / "src.safetensors"
    tf.save({"w": _numpy()}, p)

    def call(device):
        return tf.to_device({"w": _numpy()}, device) if name == "to_device" else tf.load(p, device=device)

    jax = pytest.importorskip("jax", reason="JAX is not installed")
    for device in ("cpu", torch.device("cpu"), jax.devices("cpu")[0], "emu:0"):
        np.testing.assert_array_equal(_values(call(device)["w"]), _numpy())
    with pytest.raises(tf.TensorferryTypeError, match="device") as info:
        call(object())
    assert isinstance(info.value, TypeError)


class _Stream:
    """A producer's stream as tensorferry takes one: anything with ``synchronize()``."""

    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("name", MOVING)
def test_the_producers_stream_is_waited_for_once_before_tensors_are_read(name, non_blocking, tmp_path):
    stream = _Stream()
    tree = {"w": _numpy(), "d": _leaf_native_emu()}
    kw = {"out": {"w": np.zeros_like(_numpy()), "d": np.zeros_like(_numpy())}} if name == "load" else {}
    got = _call(name, tree, tmp_path, "s", stream=stream, non_blocking=non_blocking, **kw)
    if non_blocking:
        got = got.result(timeout=60)
    assert stream.waited == 1
    if name == "load":
        np.testing.assert_array_equal(got["d"], _numpy())


# -- like= ---------------------------------------------------------------------------------

FRAMEWORKS = {
    "numpy": lambda: np.ndarray,
    "tensorferry": lambda: tf.Tensor,
    "torch": lambda: pytest.importorskip("torch", reason="PyTorch is not installed").Tensor,
    "jax": lambda: pytest.importorskip("jax", reason="JAX is not installed").Array,
}


@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("like", FRAMEWORKS)
@pytest.mark.parametrize("kind", LEAVES)
@pytest.mark.parametrize("name", RETURNING_TENSORS)
def test_like_gives_every_tensor_in_that_framework(name, kind, like, non_blocking, tmp_path):
    if kind == "list" and name != "to_device":
        pytest.skip(f"{name} keeps a list of numbers as a list: only to_device makes it a tensor")
    want = FRAMEWORKS[like]()
    tree = _tree(kind)
    if name == "to_device":
        got = tf.to_device(tree, "cpu", like=like, non_blocking=non_blocking)
    else:
        got = _call(name, tree, tmp_path, "", like=like, non_blocking=non_blocking)
    if non_blocking:
        got = got.result(timeout=60)
    assert isinstance(got["model"]["w"], want), type(got["model"]["w"])
    np.testing.assert_array_equal(_values(got["model"]["w"]), _numpy())
    assert got["step"] == 3 and got["tag"] == "run-1"


def test_numpy_to_pytorch_is_one_call(torch):
    out = tf.to_host({"w": np.ones(3)}, like="torch")
    assert isinstance(out["w"], torch.Tensor) and out["w"].tolist() == [1.0, 1.0, 1.0]


def test_like_on_a_device_holds_only_what_it_can():
    with pytest.raises(tf.FormatError, match="cannot hold memory of emu:0"):
        tf.to_device({"w": _numpy()}, "emu:0", like="numpy")
    got = tf.to_device({"w": _numpy()}, "emu:0", like="tensorferry")
    assert got["w"].device == "emu:0"


@pytest.mark.parametrize("name", RETURNING_TENSORS)
def test_an_unknown_like_is_a_format_error_and_a_value_error(name, tmp_path):
    with pytest.raises(tf.FormatError, match="like must be one of") as info:
        _call(name, {"w": _numpy()}, tmp_path, "x", like="pandas")
    assert isinstance(info.value, ValueError)


# -- errors: the package's own, also the built-ins ----------------------------------------


def test_argument_errors_of_load_are_format_errors(tmp_path):
    p = tmp_path / "x.safetensors"
    tf.save({"w": _numpy()}, p)
    cases = [
        dict(direct=True, keys="w"),
        dict(direct=True, device="emu:0", out={"w": _numpy()}),
        dict(device="emu:0", like="numpy"),
    ]
    for kw in cases:
        with pytest.raises(tf.FormatError) as info:
            tf.load(p, **kw)
        assert isinstance(info.value, ValueError), kw
    with pytest.raises(tf.FormatError, match="object storage"):
        tf.load("s3://bucket/x.safetensors", direct=True)
