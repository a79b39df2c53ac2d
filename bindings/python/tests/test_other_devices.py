"""Leaves on devices tensorferry's engine does not drive (ROCm, Apple MPS, TPU, XLA, oneAPI,
any DLPack device but CPU and CUDA) move through their framework's own copies, in the same
call as the rest of their dictionary and under the same rules.

There is no such hardware here. The stand-ins report their devices exactly as the real
producers do, and honour the calls the fallback makes as the frameworks document them:
- DLPack producers: ``__dlpack_device__`` gives ``(device type, index)`` as dlpack.h numbers
  them (kDLROCM 10, kDLMetal 8, kDLOneAPI 14, …); ``__dlpack__`` follows the array API's
  DLPack 1.0 rules — without ``dl_device`` the capsule describes memory on the producer's own
  device, with ``dl_device=(kDLCPU, 0)`` and ``copy=True`` it is a host copy made before the
  call returns; another device is a ``BufferError``. Every call is recorded.
- PyTorch's ROCm build: ``torch.version.hip`` is set, its GPU tensors say ``is_cuda`` and
  ``device.type == "cuda"`` while ``__dlpack_device__`` says kDLROCM, and ``.to("cpu")``
  copies; there is no CUDA driver. Its MPS, XPU and XLA tensors report their device types. Uploads (``to_device`` onto
  those devices) call ``torch.Tensor.to(device, non_blocking=…, copy=…)``, recorded, which
  gives such a tensor; ``pin_memory`` (what the fallback pins through) is recorded too.
- JAX: real arrays of its CPU backend, with the platform check answering "tpu" for them, so
  that they take the path of TPU arrays (which export no DLPack) through ``jax.device_put``;
  ``jax.devices("tpu")`` answers the CPU devices, so that uploads onto "tpu:0" run
  ``jax.device_put`` (recorded) onto a real device.
- TensorFlow (where it is not installed): a module answering what the fallback calls,
  ``tf.identity`` under ``tf.device("/TPU:0")`` recorded, its tensors naming their device as
  TensorFlow's do.
"""

import contextlib
import ctypes
import importlib.util
import sys
import types

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _fallback
from tensorferry import _frameworks as fw

KDL_CPU, KDL_METAL, KDL_ROCM, KDL_ROCM_HOST, KDL_ONEAPI, KDL_VULKAN, KDL_MAIA = 1, 8, 10, 11, 14, 7, 17

DLPACK_DEVICES = [
    ((KDL_ROCM, 0), "rocm:0"),
    ((KDL_ROCM, 1), "rocm:1"),
    ((KDL_METAL, 0), "metal:0"),
    ((KDL_ONEAPI, 0), "oneapi:0"),
    ((KDL_ROCM_HOST, 0), "rocm_host:0"),
    ((KDL_VULKAN, 0), "vulkan:0"),
    ((KDL_MAIA, 0), "maia:0"),
]


def _capsule_on(array, device):
    """A legacy DLPack capsule of ``array`` describing its memory as lying on ``device``:
    what a producer on that device hands out without ``dl_device``."""
    capsule = array.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    # DLManagedTensor begins with DLTensor: void *data, then DLDevice {int32 type, int32 id}.
    at = managed + ctypes.sizeof(ctypes.c_void_p)
    ctypes.c_int32.from_address(at).value, ctypes.c_int32.from_address(at + 4).value = device
    return capsule


def _host_capsule(array, max_version):
    """A capsule of ``array`` (host memory) in the newest form NumPy and the caller share."""
    try:
        return array.__dlpack__(max_version=max_version)
    except TypeError:  # NumPy 1.x: legacy capsules only
        return array.__dlpack__()


class DeviceArray:
    """A DLPack producer whose memory lies on ``device`` (a ``(type, index)`` pair)."""

    def __init__(self, values, device):
        self._values = np.array(values)
        self._device = device
        self.calls = []

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy})
        if dl_device is None or tuple(dl_device) == self._device:
            if copy:
                return _capsule_on(self._values.copy(), self._device)
            return _capsule_on(self._values, self._device)
        if tuple(dl_device) != (KDL_CPU, 0):
            raise BufferError(f"cannot export to DLPack device {dl_device}")
        if stream is not None:
            raise ValueError("stream must be None when dl_device is kDLCPU")
        if copy is False:
            raise BufferError("a copy to the host is needed")
        return _host_capsule(self._values.copy(), max_version)


class OldDeviceArray(DeviceArray):
    """A producer from before DLPack 1.0: no ``dl_device``, no ``copy``."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        return _capsule_on(self._values, self._device)


# PyTorch's __dlpack_device__ for the device types it maps (kDLROCM only in a ROCm build).
_TORCH_DLPACK = {"cuda": KDL_ROCM, "xpu": KDL_ONEAPI, "mps": KDL_METAL}


class TorchDeviceTensor:
    """A PyTorch tensor on a GPU of PyTorch's ROCm build ("cuda"), on MPS, XPU or XLA: what
    PyTorch reports for one (``type(t).__module__ == "torch"``), with ``.to`` recorded."""

    __module__ = "torch"

    def __init__(self, torch, values, device_type, index=0):
        self._torch = torch
        self._values = torch.as_tensor(values)
        self.device = torch.device(device_type, index)
        self.is_cpu = False
        self.is_cuda = device_type == "cuda"
        self.is_meta = False
        self.layout = torch.strided
        self.requires_grad = False
        self.calls = []

    dtype = property(lambda self: self._values.dtype)
    shape = property(lambda self: self._values.shape)

    def data_ptr(self):
        return self._values.data_ptr()  # stands for the device address

    def element_size(self):
        return self._values.element_size()

    def stride(self):
        return self._values.stride()

    def get_device(self):
        return self.device.index

    def is_conj(self):
        return False

    def is_neg(self):
        return False

    def __dlpack_device__(self):
        if self.device.type not in _TORCH_DLPACK:
            raise ValueError(f"Unknown device type {self.device.type} for Dlpack")
        return (_TORCH_DLPACK[self.device.type], self.device.index)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append(("__dlpack__", dl_device, copy))
        return _capsule_on(self._values.numpy(), self.__dlpack_device__())

    def to(self, *args, **kwargs):
        self.calls.append(("to", args, kwargs))
        target = self._torch.device(kwargs.get("device", args[0] if args else None))
        if target.type == self.device.type and (target.index or 0) == self.device.index:
            # PyTorch: "If self Tensor already has the correct torch.dtype and torch.device,
            # then self is returned. Otherwise, the returned tensor is a copy" (or copy=True).
            if kwargs.get("copy"):
                return TorchDeviceTensor(self._torch, self._values.clone(), target.type, self.device.index)
            return self
        if target.type != "cpu":
            raise RuntimeError(f"this stand-in copies to the host or within its device only, not to {target}")
        return self._values.clone()


@pytest.fixture
def rocm_torch(torch, monkeypatch):
    """PyTorch as its ROCm build reports itself; the synchronisations of its GPUs
    (``torch.cuda``, HIP's in that build), of MPS and of XPU recorded."""
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: synced.append("mps"))
    monkeypatch.setattr(torch.xpu, "synchronize", lambda device=None: synced.append(("xpu", device)))
    torch.synced = synced
    yield torch
    del torch.synced


@pytest.fixture
def tpu_jax(jax, monkeypatch):
    """JAX whose CPU arrays made by ``tpu_jax.on_tpu(values)`` take the TPU path; the
    fallback's ``jax.device_put`` calls recorded."""
    on_tpu = set()
    real_platform = fw._jax_platform
    monkeypatch.setattr(fw, "_jax_platform", lambda a: "tpu" if id(a) in on_tpu else real_platform(a))
    puts = []
    real_put = jax.device_put

    def device_put(x, *args, **kwargs):
        puts.append((x, args, kwargs))
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", device_put)
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices("cpu" if backend == "tpu" else backend))

    def make(values):
        a = jax.numpy.asarray(values)
        on_tpu.add(id(a))
        return a

    jax.on_tpu, jax.puts = make, puts
    yield jax
    del jax.on_tpu, jax.puts


def _emulated(values):
    tf.configure_emulated(0, latency_us=0)
    return tf.to_device({"x": np.asarray(values)}, "emu:0")["x"]


def _mixed(other):
    """A dictionary of a leaf on another device beside host, emulated and plain leaves."""
    return {
        "other": {"w": other},
        "host": np.arange(4, dtype=np.float32),
        "emu": _emulated(np.full(3, 7, np.int64)),
        "step": 12,
        "name": "run-1",
        "betas": (0.9, 0.999),
    }


def _host_values(x):
    return np.asarray(x.numpy() if isinstance(x, tf.Tensor) else x)


# -- how leaves are classified -----------------------------------------------------------


@pytest.mark.parametrize("device, name", DLPACK_DEVICES)
def test_a_dlpack_device_the_engine_does_not_drive_is_named_and_left_to_the_fallback(device, name):
    x = DeviceArray([1.0, 2.0], device)
    assert fw.device_of(x, fw.kind_of(x)) == name
    assert not fw.engine_drives(name)
    assert _fallback.split([(("x",), x)])[1][0][3] == name


def test_rocm_from_pytorch_is_rocm_not_cuda(rocm_torch):
    t = TorchDeviceTensor(rocm_torch, [1.0], "cuda", 1)
    assert t.__dlpack_device__() == (KDL_ROCM, 1)
    assert fw.device_of(t, fw.kind_of(t)) == "rocm:1"


def test_a_tpu_array_is_named_by_its_platform(tpu_jax):
    assert fw.device_of(tpu_jax.on_tpu([1.0]), fw.JAX) == "tpu:0"


# -- each device alone --------------------------------------------------------------------


@pytest.mark.parametrize("device, name", DLPACK_DEVICES)
def test_to_host_copies_through_the_dlpack_cross_device_copy(device, name):
    x = DeviceArray([1.0, 2.0, 3.0], device)
    out = tf.to_host({"model": {"w": x}})
    w = out["model"]["w"]
    assert isinstance(w, tf.Tensor) and w.device == "cpu"
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0, 3.0])
    assert x.calls == [{"stream": None, "max_version": (1, 0), "dl_device": (KDL_CPU, 0), "copy": True}]


@pytest.mark.parametrize("device_type", ["cuda", "mps", "xpu", "xla"])
def test_pytorch_tensors_on_other_devices_move_through_to(rocm_torch, device_type):
    torch = rocm_torch
    t = TorchDeviceTensor(torch, [1.0, 2.0], device_type)
    out = tf.to_host({"w": t, "tag": "x"})
    assert type(out["w"]) is torch.Tensor and out["w"].device.type == "cpu"
    assert torch.equal(out["w"], torch.tensor([1.0, 2.0]))
    assert t.calls == [("to", ("cpu",), {})]


def test_a_rocm_dictionary_needs_no_cuda_driver(rocm_torch):
    torch = rocm_torch
    d = {f"layer.{i}": TorchDeviceTensor(torch, [float(i)] * 4, "cuda") for i in range(5)}
    out = tf.to_host(d)
    assert list(out) == list(d)
    for i, t in enumerate(out.values()):
        assert torch.equal(t, torch.full((4,), float(i)))


def test_a_tpu_array_moves_through_jax_device_put(tpu_jax):
    jax = tpu_jax
    a = jax.on_tpu(np.arange(6.0).reshape(2, 3))
    out = tf.to_host({"params": {"kernel": a}})
    k = out["params"]["kernel"]
    assert isinstance(k, jax.Array) and next(iter(k.devices())).platform == "cpu"
    np.testing.assert_array_equal(np.asarray(k), np.arange(6.0).reshape(2, 3))
    assert [(x is a, args[0].platform) for x, args, _ in jax.puts] == [(True, "cpu")]


def test_a_cupy_array_on_rocm_moves_through_get():
    class CupyOnRocm(DeviceArray):
        """A CuPy array in CuPy's ROCm build: kDLROCM, and ``.get()`` to the host."""

        __module__ = "cupy._core.core"

        def get(self):
            self.calls.append("get")
            return self._values.copy()

    x = CupyOnRocm([4, 5], (KDL_ROCM, 0))
    out = tf.to_host({"x": x})
    assert type(out["x"]) is np.ndarray and x.calls == ["get"]
    np.testing.assert_array_equal(out["x"], [4, 5])


# -- mixed with host and emulated leaves, for every operation ------------------------------


def _others(torch=None, jax=None):
    yield "rocm-dlpack", DeviceArray(np.arange(5.0), (KDL_ROCM, 0))
    yield "metal", DeviceArray(np.arange(5.0), (KDL_METAL, 0))
    yield "oneapi", DeviceArray(np.arange(5.0), (KDL_ONEAPI, 0))
    if torch is not None:
        yield "rocm-torch", TorchDeviceTensor(torch, np.arange(5.0), "cuda")
        yield "mps", TorchDeviceTensor(torch, np.arange(5.0), "mps")
    if jax is not None:
        yield "tpu", jax.on_tpu(np.arange(5.0))


@pytest.fixture
def others(request):
    """Every stand-in; those of a framework that is not installed are left out (the DLPack
    producers need none)."""
    frameworks = []
    for name in ("rocm_torch", "tpu_jax"):
        try:
            frameworks.append(request.getfixturevalue(name))
        except pytest.skip.Exception:
            frameworks.append(None)
    return list(_others(*frameworks))


def _check_mixed(out, d, host_results=True, loaded=False):
    assert list(out) == list(d) and list(out["other"]) == ["w"]
    assert out["step"] == d["step"] and out["name"] == d["name"] and out["betas"] == d["betas"]
    if not loaded:  # non-tensor leaves are the very same objects
        assert out["name"] is d["name"] and out["betas"][0] is d["betas"][0]
    np.testing.assert_array_equal(_host_values(out["other"]["w"]), np.arange(5.0))
    np.testing.assert_array_equal(_host_values(out["host"]), np.arange(4))
    np.testing.assert_array_equal(_host_values(out["emu"]), [7, 7, 7])
    if host_results:
        assert out["emu"].device == "cpu"


def test_to_host_moves_a_mixed_dictionary_in_one_call(others):
    for name, other in others:
        d = _mixed(other)
        out = tf.to_host(d)
        _check_mixed(out, d)
        assert out["host"] is d["host"], "host leaves stay as they are"
        assert out["other"]["w"] is not other, name


def test_to_numpy_takes_every_device(others):
    for name, other in others:
        d = _mixed(other)
        out = tf.to_numpy(d)
        assert all(type(out[k]) is np.ndarray for k in ("host", "emu")), name
        assert type(out["other"]["w"]) is np.ndarray, name
        _check_mixed(out, d, host_results=False)


def test_save_takes_every_device_and_loads_back(others, tmp_path):
    for name, other in others:
        d = _mixed(other)
        path = tmp_path / f"{name}.safetensors"
        tf.save(d, path)
        back = tf.load(path, like="numpy")
        _check_mixed(back, d, host_results=False, loaded=True)


def test_a_non_blocking_save_takes_every_device(others, tmp_path):
    for name, other in others:
        d = _mixed(other)
        path = tmp_path / f"{name}.safetensors"
        tf.save(d, path, non_blocking=True).result()
        _check_mixed(tf.load(path, like="numpy"), d, host_results=False, loaded=True)


def test_non_blocking_results_come_once_the_framework_has_finished(others):
    for name, other in others:
        d = _mixed(other)
        pending = tf.to_host(d, non_blocking=True)
        assert isinstance(pending, tf.Transfer), name
        _check_mixed(pending.result(), d)


def test_a_non_blocking_rocm_copy_is_handed_out_after_the_gpu_synchronised(rocm_torch):
    torch = rocm_torch
    t = TorchDeviceTensor(torch, [1.0, 2.0, 3.0], "cuda")
    pending = tf.to_host({"w": t, "host": np.ones(2)}, non_blocking=True)
    assert isinstance(pending, tf.Transfer)
    assert t.calls[0][0] == "to" and t.calls[0][2] == {"non_blocking": True}
    assert torch.synced == [], "nothing waited yet"
    out = pending.result()
    assert torch.synced == [0], "the ROCm GPU synchronised before the results were handed out"
    assert torch.equal(out["w"], torch.tensor([1.0, 2.0, 3.0]))


def test_non_blocking_to_numpy_takes_every_device(others):
    for name, other in others:
        out = tf.to_numpy(_mixed(other), non_blocking=True).result()
        assert type(out["other"]["w"]) is np.ndarray, name
        np.testing.assert_array_equal(out["other"]["w"], np.arange(5.0))


def test_to_device_cpu_and_emulated_take_every_device(others):
    for name, other in others:
        d = _mixed(other)
        _check_mixed(tf.to_device(d, "cpu"), d)
        there = tf.to_device(d, "emu:0")
        assert there["other"]["w"].device == "emu:0" and there["emu"].device == "emu:0", name
        _check_mixed(tf.to_numpy(there), d, host_results=False)


def test_copies_are_fresh_and_the_source_untouched():
    x = DeviceArray(np.arange(3.0), (KDL_ROCM, 0))
    first, second = (tf.to_numpy({"x": x})["x"] for _ in range(2))
    first[:] = -1
    np.testing.assert_array_equal(second, np.arange(3.0))
    np.testing.assert_array_equal(x._values, np.arange(3.0))


def test_one_tensor_under_two_keys_is_copied_once_and_stays_shared():
    x = DeviceArray(np.arange(3.0), (KDL_METAL, 0))
    out = tf.to_host({"a": x, "b": x})
    assert out["a"] is out["b"] and len(x.calls) == 1


# -- errors --------------------------------------------------------------------------------


def test_a_producer_that_cannot_copy_to_the_host_is_named_with_its_key_and_device():
    x = OldDeviceArray([1.0], (KDL_METAL, 0))
    for call in (tf.to_host, tf.to_numpy):
        with pytest.raises(tf.DeviceUnavailableError) as info:
            call({"model": {"w": x}, "ok": np.ones(1)})
        assert "model/w" in str(info.value) and "metal:0" in str(info.value)


def test_pinned_and_staging_name_the_engine_and_the_fallback():
    x = DeviceArray([1.0], (KDL_ROCM, 0))
    for options in ({"pinned": True}, {"staging": "on"}, {"staging": (1 << 20, 2)}):
        with pytest.raises(tf.DeviceUnavailableError) as info:
            tf.to_host({"a": {"w": x}}, **options)
        text = str(info.value)
        assert "a/w" in text and "rocm:0" in text and "fallback" in text and "engine" in text, text
    tf.to_host({"a": {"w": x}}, staging="off")  # no ring asked for: fine


def test_to_device_takes_leaves_from_the_other_devices_to_the_engines():
    x = DeviceArray([1.0, 2.0], (KDL_METAL, 0))
    out = tf.to_device({"x": x}, "emu:0")["x"]
    assert out.device == "emu:0"
    np.testing.assert_array_equal(out.numpy(), [1.0, 2.0])


def test_the_engine_keeps_its_own_leaves():
    # Host, CUDA and emulated leaves never take the fallback: one native call moves them.
    leaves = [(("a",), np.ones(1)), (("b",), _emulated([1]))]
    assert _fallback.split(leaves) == (leaves, [])


def test_a_rocm_build_asked_for_cuda_says_its_gpus_are_amd_gpus_and_names_the_fallback(rocm_torch, tmp_path):
    if any(d.startswith("cuda") for d in tf.devices()):
        pytest.skip("a CUDA driver is present: cuda:0 is tensorferry's")
    tf.save({"x": np.ones(2)}, tmp_path / "f.safetensors")
    calls = (
        lambda: tf.to_device({"x": np.ones(1)}, "cuda"),
        lambda: tf.load(tmp_path / "f.safetensors", device="cuda:0"),
    )
    for call in calls:
        with pytest.raises(tf.DeviceUnavailableError) as info:
            call()
        text = str(info.value)
        assert "ROCm" in text and "AMD" in text and "fallback" in text and "to_host" in text, text


def test_saved_leaves_load_back_in_their_framework(rocm_torch, tpu_jax, tmp_path):
    torch, jax = rocm_torch, tpu_jax
    d = {"rocm": TorchDeviceTensor(torch, [1.0, 2.0], "cuda"), "mps": TorchDeviceTensor(torch, [3.0], "mps")}
    tf.save(d, tmp_path / "torch.safetensors")
    back = tf.load(tmp_path / "torch.safetensors")
    assert all(type(back[k]) is torch.Tensor for k in d)
    assert torch.equal(back["rocm"], torch.tensor([1.0, 2.0])) and torch.equal(back["mps"], torch.tensor([3.0]))
    tf.save({"kernel": jax.on_tpu(np.arange(3.0))}, tmp_path / "jax.safetensors")
    kernel = tf.load(tmp_path / "jax.safetensors")["kernel"]
    assert isinstance(kernel, jax.Array)
    np.testing.assert_array_equal(np.asarray(kernel), np.arange(3.0))


# -- onto the other devices (to_device) ----------------------------------------------------


@pytest.fixture
def uploading_torch(rocm_torch, monkeypatch):
    """PyTorch whose ``Tensor.to`` onto a device other than the host gives a
    ``TorchDeviceTensor`` there (a copy), each such call recorded in ``.uploads`` as
    ``(source, torch.device, keyword arguments)``; ``pin_memory`` recorded in ``.pinned``."""
    torch = rocm_torch
    uploads, pinned = [], []
    real_to, real_pin = torch.Tensor.to, torch.Tensor.pin_memory

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if not isinstance(target, (str, torch.device)) or torch.device(target).type == "cpu":
            return real_to(self, *args, **kwargs)
        target = torch.device(target)
        uploads.append((self, target, {k: v for k, v in kwargs.items() if k != "device"}))
        return TorchDeviceTensor(torch, self.detach().clone(), target.type, target.index or 0)

    def pin_memory(self, *args, **kwargs):
        pinned.append(self)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    torch.uploads, torch.pinned = uploads, pinned
    yield torch
    del torch.uploads, torch.pinned


class JaxTpuDevice:
    """A JAX TPU device as JAX's device objects report one (only what ``tensorferry``
    reads of it: its module, ``platform`` and ``id``)."""

    __module__ = "jaxlib._jax"
    platform = "tpu"

    def __init__(self, id):
        self.id = id


def _to_upload(torch):
    """A dictionary of NumPy, PyTorch CPU and emulated leaves, lists of numbers and plain
    values, to be put on another device."""
    return {
        "np": np.arange(3, dtype=np.float32),
        "layer": {"torch": torch.arange(4.0), "ids": [[1, 2], [3, 4]]},
        "emu": _emulated(np.full(2, 7, np.int64)),
        "lr": [0.5, 0.25],
        "step": 12,
        "name": "run-1",
        "betas": (0.9, 0.999),
        "empty": [],
    }


def _check_uploaded(out, d, values, int_dtype=np.int64):
    """``out`` keeps ``d``'s structure and plain values (the very objects), and its tensors
    hold the values of ``d``'s, as ``values`` reads them, in to_device's dtypes for lists
    (integers in ``int_dtype``, which JAX without x64 narrows int64 to)."""
    assert list(out) == list(d) and list(out["layer"]) == ["torch", "ids"]
    assert out["step"] is d["step"] and out["name"] is d["name"] and out["empty"] == []
    assert out["betas"] == d["betas"] and out["betas"][0] is d["betas"][0]
    np.testing.assert_array_equal(values(out["np"]), [0, 1, 2])
    np.testing.assert_array_equal(values(out["layer"]["torch"]), [0, 1, 2, 3])
    np.testing.assert_array_equal(values(out["emu"]), [7, 7])
    ids, lr = values(out["layer"]["ids"]), values(out["lr"])
    assert ids.dtype == int_dtype and ids.shape == (2, 2) and lr.dtype == np.float32
    np.testing.assert_array_equal(lr, [0.5, 0.25])
    np.testing.assert_array_equal(d["np"], [0, 1, 2]), "the sources stay as they were"


def _torch_values(t):
    return t._values.numpy()


@pytest.mark.parametrize(
    "device, name", [("mps", "mps:0"), ("mps:0", "mps:0"), ("xla:0", "xla:0"), ("xpu:1", "xpu:1"), ("rocm:0", "cuda:0")]
)
def test_to_device_onto_a_pytorch_device_uploads_every_leaf_through_tensor_to(uploading_torch, device, name):
    torch = uploading_torch
    d = _to_upload(torch)
    out = tf.to_device(d, device)
    _check_uploaded(out, d, _torch_values)
    leaves = [out["np"], out["layer"]["torch"], out["layer"]["ids"], out["emu"], out["lr"]]
    assert all(isinstance(t, TorchDeviceTensor) and str(t.device) == name for t in leaves)
    # One PyTorch upload per tensor, lists of numbers included ("rocm:0" is PyTorch's cuda:0 there).
    assert len(torch.uploads) == 5
    assert {str(target) for _, target, _ in torch.uploads} == {name}
    assert all(kwargs == {"non_blocking": False, "copy": False} for _, _, kwargs in torch.uploads)
    assert any(source is d["layer"]["torch"] for source, _, _ in torch.uploads), "PyTorch leaves go as they are"
    assert torch.synced == [], "a blocking upload has read its source when .to returns"


def test_to_device_takes_a_torch_device(uploading_torch):
    torch = uploading_torch
    d = {"w": np.ones(2, np.float32), "b": [1.0], "tag": "x"}
    out = tf.to_device(d, torch.device("mps"))
    assert str(out["w"].device) == "mps:0" and str(out["b"].device) == "mps:0" and out["tag"] is d["tag"]
    assert [str(target) for _, target, _ in torch.uploads] == ["mps:0", "mps:0"]


def test_rocm_is_pytorchs_cuda_only_in_a_rocm_build(uploading_torch, monkeypatch):
    monkeypatch.setattr(uploading_torch.version, "hip", None)
    with pytest.raises(tf.DeviceUnavailableError) as info:
        tf.to_device({"w": np.ones(1)}, "rocm:0")
    assert "rocm:0" in str(info.value) and "ROCm build" in str(info.value)


def test_a_non_blocking_upload_pins_and_hands_out_results_after_the_device_synchronised(uploading_torch):
    torch = uploading_torch
    d = {"w": torch.arange(3.0), "x": np.ones(2, np.float32), "n": [1, 2], "step": 3}
    pending = tf.to_device(d, "rocm:0", non_blocking=True)
    assert isinstance(pending, tf.Transfer)
    assert len(torch.pinned) == 3, "host tensors are copied into pinned memory first"
    assert all(kwargs["non_blocking"] is True for _, _, kwargs in torch.uploads)
    assert torch.synced == [], "nothing waited yet"
    out = pending.result()
    assert torch.synced == [0], "the ROCm GPU synchronised before the results were handed out"
    np.testing.assert_array_equal(_torch_values(out["w"]), [0, 1, 2])
    assert out["step"] is d["step"] and str(out["n"].device) == "cuda:0"


def test_a_non_blocking_upload_onto_mps_waits_for_mps(uploading_torch):
    torch = uploading_torch
    pending = tf.to_device({"w": np.ones(2, np.float32)}, "mps", non_blocking=True)
    assert torch.synced == []
    out = pending.result()
    assert torch.synced == ["mps"] and str(out["w"].device) == "mps:0"


def test_tensors_already_on_the_device_stay_unless_copy(uploading_torch):
    torch = uploading_torch
    on_mps, on_gpu = TorchDeviceTensor(torch, [1.0], "mps"), TorchDeviceTensor(torch, [2.0], "cuda")
    out = tf.to_device({"a": on_mps}, "mps")
    assert out["a"] is on_mps and on_mps.calls[-1][2] == {"non_blocking": False, "copy": False}
    assert tf.to_device({"b": on_gpu}, "rocm:0")["b"] is on_gpu, "the ROCm build's cuda:0 is rocm:0"
    copied = tf.to_device({"a": on_mps}, "mps:0", copy=True)["a"]
    assert copied is not on_mps and str(copied.device) == "mps:0"
    assert torch.equal(copied._values, on_mps._values)


def test_one_tensor_under_two_keys_is_uploaded_once_and_stays_shared(uploading_torch):
    torch = uploading_torch
    w = torch.ones(3)
    out = tf.to_device({"encoder": w, "decoder": w}, "xpu:0")
    assert out["encoder"] is out["decoder"] and len(torch.uploads) == 1


def test_an_upload_pytorch_refuses_names_the_key_and_the_device(rocm_torch):
    # No stand-in: this PyTorch has no MPS backend, and says so.
    with pytest.raises(tf.DeviceUnavailableError) as info:
        tf.to_device({"model": {"w": np.ones(2)}}, "mps")
    text = str(info.value)
    assert "model/w" in text and "mps:0" in text and "PyTorch" in text, text


@pytest.mark.parametrize("device", ["tpu", "tpu:0", JaxTpuDevice(0)])
def test_to_device_onto_a_tpu_puts_every_leaf_through_jax_device_put(tpu_jax, torch, device):
    jax = tpu_jax
    d = _to_upload(torch)
    d["layer"]["jax"] = jax.numpy.arange(2.0)
    out = tf.to_device(d, device)
    d["layer"].pop("jax")
    kernel = out["layer"].pop("jax")
    _check_uploaded(out, d, np.asarray, jax.dtypes.canonicalize_dtype(np.int64))
    leaves = [kernel, out["np"], out["layer"]["torch"], out["layer"]["ids"], out["emu"], out["lr"]]
    assert all(isinstance(a, jax.Array) for a in leaves)
    # One device_put per tensor onto JAX's "tpu" device (the CPU device stands for it).
    assert len(jax.puts) == 6 and {args[0] for _, args, _ in jax.puts} == {jax.devices("tpu")[0]}
    np.testing.assert_array_equal(np.asarray(kernel), [0.0, 1.0])


def test_jax_leaves_are_put_as_they_are(tpu_jax):
    jax = tpu_jax
    a = jax.numpy.arange(3.0)
    tf.to_device({"a": a}, "tpu:0")
    assert [x is a for x, _, _ in jax.puts] == [True]


def test_a_non_blocking_upload_onto_a_tpu_is_a_transfer(tpu_jax):
    jax = tpu_jax
    pending = tf.to_device({"w": np.arange(3.0, dtype=np.float32), "b": [1.0]}, "tpu", non_blocking=True)
    assert isinstance(pending, tf.Transfer) and len(jax.puts) == 2
    out = pending.result()
    assert isinstance(out["w"], jax.Array) and isinstance(out["b"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["w"]), [0.0, 1.0, 2.0])


def test_like_other_than_the_owning_framework_is_a_format_error(uploading_torch, tpu_jax):
    for device, like, owner in (("mps", "jax", "torch"), ("xla:0", "numpy", "torch"), ("tpu", "torch", "jax")):
        with pytest.raises(tf.FormatError) as info:
            tf.to_device({"w": np.ones(1)}, device, like=like)
        text = str(info.value)
        assert repr(like) in text and repr(owner) in text, text
    assert str(tf.to_device({"w": np.ones(1)}, "mps", like="torch")["w"].device) == "mps:0"


def test_staging_names_the_engine_and_the_fallback_for_an_upload(uploading_torch):
    with pytest.raises(tf.DeviceUnavailableError) as info:
        tf.to_device({"w": np.ones(1)}, "mps", staging="on")
    text = str(info.value)
    assert "mps:0" in text and "fallback" in text and "engine" in text and "PyTorch" in text, text
    assert uploading_torch.uploads == []


def test_a_malformed_device_is_still_an_invalid_device_error_naming_the_framework_devices():
    for bad in ("mps:x", "tpu:-1", "xla0", "metal", "bogus"):
        with pytest.raises(tf.InvalidDeviceError) as info:
            tf.to_device({"w": np.ones(1)}, bad)
        assert f'"{bad}"' in str(info.value) and '"mps"' in str(info.value) and '"tpu"' in str(info.value)


@pytest.fixture
def tpu_tensorflow(monkeypatch):
    """TensorFlow, where it is not installed, as the fallback calls it: ``tf.device(name)``
    a context, ``tf.identity`` a copy placed on the innermost device (recorded in
    ``.placed``), ``tf.test.experimental.sync_devices`` recorded in ``.synced``; its
    tensors name their device as TensorFlow does ("/job:localhost/…/device:TPU:0")."""
    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip("TensorFlow is installed: the stand-in would shadow it")
    tf_module = types.ModuleType("tensorflow")
    placed, synced, scopes = [], [], ["/CPU:0"]

    class Tensor:
        __module__ = "tensorflow.python.framework.ops"

        def __init__(self, values, device):
            self.values = np.asarray(values)
            self.device = f"/job:localhost/replica:0/task:0/device:{device.strip('/')}"

        def numpy(self):
            return self.values.copy()

    class Variable(Tensor):
        pass

    @contextlib.contextmanager
    def device(name):
        scopes.append(name)
        try:
            yield
        finally:
            scopes.pop()

    def identity(x):
        placed.append((x, scopes[-1]))
        return Tensor(x.values.copy(), scopes[-1])

    tf_module.Tensor, tf_module.Variable, tf_module.device, tf_module.identity = Tensor, Variable, device, identity
    tf_module.test = types.SimpleNamespace(experimental=types.SimpleNamespace(sync_devices=lambda: synced.append(1)))
    tf_module.placed, tf_module.synced = placed, synced
    monkeypatch.setitem(sys.modules, "tensorflow", tf_module)
    return tf_module


def test_tensorflow_leaves_go_onto_a_tpu_through_identity_under_device(tpu_tensorflow, tpu_jax):
    tf_module, jax = tpu_tensorflow, tpu_jax
    x = tf_module.Tensor([1.0, 2.0], "/CPU:0")
    d = {"tf": x, "np": np.ones(2, np.float32), "step": 1}
    out = tf.to_device(d, "tpu:0")
    assert [(src is x, where) for src, where in tf_module.placed] == [(True, "/TPU:0")]
    assert isinstance(out["tf"], tf_module.Tensor) and out["tf"].device.endswith("device:TPU:0")
    np.testing.assert_array_equal(out["tf"].values, [1.0, 2.0])
    assert tf_module.synced == [1], "TensorFlow's devices synchronised before the results were handed out"
    assert isinstance(out["np"], jax.Array) and out["step"] is d["step"]
