"""Which framework a tensor leaf belongs to, and crossing between it and native tensors.

Tensor leaves: ``tensorferry.Tensor``, NumPy arrays, TensorFlow tensors and variables, DLPack
exporters (PyTorch, JAX, CuPy) and ``__cuda_array_interface__`` memory. Results follow the
input's framework; a leaf its framework cannot export is a :class:`FormatError` naming its
key. :func:`device_of` also names devices the engine does not drive ("rocm:0", "mps:0",
"tpu:0", …; :func:`engine_drives` tells them apart). ROCm is never named CUDA, though
PyTorch's ROCm builds call their GPUs "cuda" (``torch.version.hip`` tells them apart).
"""

import math
import sys

import numpy as np

from . import _native
from ._errors import DeviceUnavailableError, FormatError
from ._numpy import PACKED_DTYPES, tensor_to_numpy, tensors_to_numpy  # noqa: F401 (re-exported)
from ._tree import shown

Tensor = _native.Tensor

NATIVE = "tensorferry"
NUMPY = "numpy"
TORCH = "torch"
JAX = "jax"
CUPY = "cupy"
TENSORFLOW = "tensorflow"
NUMBA = "numba"
CAI = "cuda_array_interface"
DLPACK = "dlpack"

_kind_cache = {}


def _classify(t):
    if t is Tensor:
        return NATIVE
    if issubclass(t, np.ndarray):
        return NUMPY
    module = getattr(t, "__module__", "") or ""
    if module.startswith("tensorflow") and _is_tf_tensor_type(t):
        # Before the DLPack test: variables have no __dlpack__, and TensorFlow's DLPack
        # export aborts the process on string tensors, so TensorFlow leaves take their own path.
        return TENSORFLOW
    has_dlpack = hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")
    if hasattr(t, "__cuda_array_interface__") and (module.startswith("numba") or not has_dlpack):
        # Numba's device arrays (and producers without DLPack) are read through the CUDA
        # Array Interface, with its stream rule.
        return NUMBA if module.startswith("numba") else CAI
    if not has_dlpack:
        return None
    for prefix, kind in (("torch", TORCH), ("jax", JAX), ("cupy", CUPY)):
        if module.startswith(prefix):
            return kind
    return DLPACK


def _is_tf_tensor_type(t):
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return False
    return issubclass(t, (tf.Tensor, tf.Variable)) and hasattr(t, "numpy")


def kind_of(obj):
    """The framework of a tensor leaf, or None when ``obj`` is not a tensor."""
    t = type(obj)
    try:
        return _kind_cache[t]
    except KeyError:
        kind = _kind_cache[t] = _classify(t)
        return kind


def device_of(obj, kind):
    """The canonical device string of a tensor leaf ("cpu", "cuda:0", "rocm:0", "mps:0",
    "tpu:0", "metal:0", …)."""
    if kind == NUMPY:
        return "cpu"
    if kind == NATIVE:
        return obj.device
    if kind == TENSORFLOW:
        return _tf_device(obj.device)
    if kind in (NUMBA, CAI):
        return _native.cuda_array_interface_device(obj)
    if kind == TORCH:
        # is_cpu / is_cuda / get_device cost a fifth of torch.device.type.
        if obj.is_cpu:
            return "cpu"
        if obj.is_cuda:
            # PyTorch's ROCm builds call their GPUs "cuda" too.
            return f"{'rocm' if _torch_is_rocm() else 'cuda'}:{obj.get_device()}"
        dev = obj.device
        return f"{dev.type}:{dev.index or 0}"
    if kind == JAX:
        return _jax_device(obj)
    return dlpack_device_name(*obj.__dlpack_device__())


def engine_drives(device):
    """True for the devices tensorferry's engine copies to and from: the host, CUDA GPUs
    and the emulated devices. Leaves anywhere else move through their framework."""
    return device == "cpu" or device.startswith(("cuda:", "emu:"))


# DLPack's device types (dlpack.h, DLDeviceType), by the names tensorferry gives them.
_DLPACK_DEVICES = {
    2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev",
    13: "cuda", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia",
}


def dlpack_device_name(dev_type, dev_id):
    """The device string of a DLPack device: kDLCPU and kDLCUDAHost (1, 3) are "cpu",
    kDLCUDA and kDLCUDAManaged (2, 13) "cuda:N", kDLROCM (10) "rocm:N", kDLMetal (8)
    "metal:N", kDLOneAPI (14) "oneapi:N", …; a type DLPack does not define "dlpack-T:N"."""
    dev_type = int(dev_type)
    if dev_type in (1, 3):
        return "cpu"
    return f"{_DLPACK_DEVICES.get(dev_type, f'dlpack-{dev_type}')}:{int(dev_id)}"


def _torch_is_rocm():
    """True in a PyTorch built for ROCm (HIP), whose "cuda" tensors live on AMD GPUs."""
    version = getattr(sys.modules.get("torch"), "version", None)
    return getattr(version, "hip", None) is not None


def _jax_platform(obj):
    """The platform of the device a JAX array lives on ("cpu", "gpu", "tpu", …)."""
    return next(iter(obj.devices())).platform


def _jax_device(obj):
    """The device string of a JAX array: its DLPack device on CPU and GPU (CUDA or
    ROCm, which JAX both call "gpu"), "tpu:N" and the like elsewhere, where JAX exports
    no DLPack."""
    platform = _jax_platform(obj)
    if platform == "cpu":
        return "cpu"
    if platform in ("gpu", "cuda", "rocm"):
        return dlpack_device_name(*obj.__dlpack_device__())
    return f"{platform}:{next(iter(obj.devices())).id}"


def _tf_device(name):
    """"/job:localhost/replica:0/task:0/device:GPU:1" -> "cuda:1" ("rocm:1" in a ROCm
    build of TensorFlow), "…/device:TPU:0" -> "tpu:0"."""
    tail = name.rsplit("device:", 1)[-1]
    kind, _, index = tail.partition(":")
    if kind == "GPU":
        return f"{'rocm' if _tf_is_rocm() else 'cuda'}:{index or 0}"
    if kind in ("CPU", ""):
        return "cpu"
    return f"{kind.lower()}:{index or 0}"


def _tf_is_rocm():
    tf = sys.modules.get("tensorflow")
    try:
        return bool(tf.test.is_built_with_rocm())
    except AttributeError:
        return False


def _plain_tf(obj, key):
    """A TensorFlow tensor whose memory DLPack can export: a variable's value is read, and
    dtypes without a flat buffer (string, variant, resource, quantized) are refused."""
    dt = obj.dtype
    if not (dt.is_floating or dt.is_integer or dt.is_bool or dt.is_complex) or dt.is_quantized:
        raise FormatError(
            f"cannot handle the value at {key!r}: TensorFlow dtype {dt.name} has no flat buffer "
            "to move (only numeric and bool tensors can)"
        )
    if not hasattr(obj, "__dlpack__"):  # a tf.Variable
        obj = obj.read_value()
    return obj


def _tf_sync(tensors):
    """Waits for TensorFlow's queued GPU work before its memory is read: TensorFlow's DLPack
    export takes no stream."""
    if any(_tf_device(t.device) != "cpu" for t in tensors):
        import tensorflow as tf

        tf.test.experimental.sync_devices()


def _plain_torch(obj):
    """The tensor as DLPack can export it: detached, conjugation and negation resolved."""
    if obj.requires_grad:
        obj = obj.detach()
    if obj.is_conj():
        obj = obj.resolve_conj()
    if obj.is_neg():
        obj = obj.resolve_neg()
    return obj


def to_native(obj, kind, key=""):
    """A native tensor viewing the leaf's memory (no copy where the layout allows); a leaf
    its framework cannot export is a :class:`FormatError` naming ``key`` (a string, or a
    key path turned into one only for a message)."""
    if kind == NATIVE:
        return obj
    key = _text(key)
    if kind == NUMPY:
        return Tensor.from_numpy(obj)
    if kind == TENSORFLOW:
        return _tf_to_native_many([obj], [key])[0]
    if kind == TORCH:
        return _exported(key, lambda: Tensor.from_dlpack(_plain_torch(obj)))
    if kind in (NUMBA, CAI):
        return _exported(key, lambda: _native.from_cuda_array_interface(obj))
    return _exported(key, lambda: Tensor.from_dlpack(obj))


def _tf_to_native_many(tensors, keys):
    """Native tensors for TensorFlow tensors (``keys`` name them in errors): one capsule
    each through TensorFlow's DLPack export, after its queued GPU work."""
    import tensorflow as tf

    plain = [_plain_tf(t, key) for t, key in zip(tensors, keys)]
    _tf_sync(plain)
    capsules = [_exported(key, lambda: tf.experimental.dlpack.to_dlpack(t)) for t, key in zip(plain, keys)]
    return _native.from_dlpack_capsules(capsules)


# What producers raise when they cannot export a tensor.
_EXPORT_ERRORS = (RuntimeError, BufferError, TypeError, ValueError, NotImplementedError, AttributeError)


def _text(key):
    """``key`` for a message: a key path tuple shown as "a/b/0", a string as it is."""
    return shown(key) if isinstance(key, tuple) else key


def _exported(key, export):
    """``export()``, with a producer's refusal (quantized, meta, sparse or nested tensors,
    odd dtypes) turned into a :class:`FormatError` naming ``key``."""
    try:
        return export()
    except FormatError as e:
        if getattr(e, "key", None):
            raise  # names its key already
        # tensorferry's own refusal of what the producer described (a bad CUDA Array
        # Interface, an odd DLPack layout), which knows no key.
        raise FormatError(f"cannot handle the value at {_text(key)!r}: {e}") from e
    except _EXPORT_ERRORS as e:
        raise FormatError(f"cannot handle the value at {_text(key)!r}: its framework cannot export it ({e})") from e


def _torch_to_native_many(tensors, paths):
    """Native tensors for many PyTorch tensors, at about a microsecond each.

    PyTorch's ``__dlpack__`` costs several microseconds a call; ``to_dlpack`` under one.
    Ordering is per stream, not per tensor: on each GPU the tensors live on, tensorferry's
    copies are made to wait (on the GPU) for PyTorch's current stream there — which
    covers every tensor queued on it, also on a GPU other than the current device — and
    every tensor goes through ``to_dlpack``.
    """
    from torch.utils.dlpack import to_dlpack

    plain = _all_or_by_key(_plain_torch, tensors, paths)
    gpus = {t.get_device() for t in plain if t.is_cuda}
    if gpus:
        import torch

        for gpu in gpus:
            try:
                # 1 is the legacy default stream, PyTorch's default (its handle reads 0).
                _native.cuda_order_after_stream(gpu, torch.cuda.current_stream(gpu).cuda_stream or 1)
            except DeviceUnavailableError:
                pass  # tensorferry cannot drive that GPU: no copy of its will run there
    capsules = _all_or_by_key(to_dlpack, plain, paths)
    return list(_native.from_dlpack_capsules(capsules))


def _all_or_by_key(fn, items, keys):
    """``[fn(x) for x in items]``; when one fails, again one by one so that the error is
    the :class:`FormatError` of :func:`_exported` naming its key."""
    try:
        return [fn(x) for x in items]
    except _EXPORT_ERRORS:
        return [_exported(key, lambda x=x: fn(x)) for x, key in zip(items, keys)]


def _numpy_to_native_many(arrays, keys):
    """Native tensors for NumPy arrays in one call; when one cannot be a tensor (an object
    array, say), the :class:`FormatError` names its key."""
    try:
        return _native.from_numpy_many(arrays)
    except FormatError:
        pass
    out = []
    for a, key in zip(arrays, keys):
        try:
            out.append(_native.from_numpy_many([a])[0])
        except FormatError as e:
            reason = str(e).removeprefix('cannot handle the value at "": ')
            raise FormatError(f"cannot handle the value at {_text(key)!r}: {reason}") from e
    return out


def to_native_many(leaves, kinds, paths):
    """``to_native`` for many leaves (``paths`` name them in errors); NumPy arrays and
    PyTorch tensors each go through one native call."""
    if kinds.count(NATIVE) == len(kinds):
        return list(leaves)  # nothing to convert (no pass per leaf)
    out = [None] * len(leaves)
    _convert_each(out, [i for i, k in enumerate(kinds) if k == NUMPY],
                  lambda at: _numpy_to_native_many([leaves[i] for i in at], [paths[i] for i in at]))
    _convert_each(out, [i for i, k in enumerate(kinds) if k == TORCH],
                  lambda at: _torch_to_native_many([leaves[i] for i in at], [paths[i] for i in at]))
    _convert_each(out, [i for i, k in enumerate(kinds) if k == TENSORFLOW],
                  lambda at: _tf_to_native_many([leaves[i] for i in at], [shown(paths[i]) for i in at]))
    for i, (leaf, kind) in enumerate(zip(leaves, kinds)):
        if out[i] is None:
            out[i] = to_native(leaf, kind, paths[i])
    return out


def _convert_each(out, at, convert):
    """``out[i]`` for each index ``i`` of ``at`` from ``convert(at)`` (one call for all)."""
    if at:
        for i, result in zip(at, convert(at)):
            out[i] = result


def _host_numpy(kind, tensor):
    return kind == NUMPY or (kind in (CUPY, NUMBA, CAI) and tensor.device == "cpu")


def from_native(tensor, kind, key=""):
    """The tensor in the framework ``kind`` (host results of CuPy leaves become NumPy);
    ``key`` as in :func:`to_native`."""
    if kind in (NATIVE, DLPACK, CAI):
        return tensor
    key = _text(key)
    if _host_numpy(kind, tensor):
        return tensor_to_numpy(tensor, key)
    if kind == TORCH:
        return _torch_from_native_many([tensor])[0]
    if kind == JAX:
        import jax

        return jax.dlpack.from_dlpack(tensor)
    if kind == CUPY:
        import cupy

        return cupy.from_dlpack(tensor)
    if kind == TENSORFLOW:
        return _tf_from_native_many([tensor])[0]
    if kind == NUMBA:
        from numba import cuda

        return cuda.as_cuda_array(tensor)
    raise AssertionError(kind)


_lacking = {}


def dtypes_lacking(kind):
    """The dtypes (names) of native tensors that ``kind``'s tensors cannot hold: values
    packed several to an element, which only PyTorch holds, and only some of them (no
    float6). Conversions leave such tensors as ``tensorferry.Tensor``, as a load does
    without a framework (NumPy's conversion names them in its error instead)."""
    if kind not in _lacking:
        if kind == TORCH:
            import torch

            _lacking[kind] = frozenset(d for d in PACKED_DTYPES if not hasattr(torch, d))
        else:
            _lacking[kind] = frozenset() if kind == NATIVE else PACKED_DTYPES
    return _lacking[kind]


def from_native_many(tensors, kinds, paths, order=False, promised=False):
    """``from_native`` for many tensors; NumPy results come from one native call. With
    ``order``, PyTorch CUDA results whose copies may still run come at once, PyTorch's
    current stream on their GPU made to wait for the copies on the GPU. ``promised`` is
    ``_torch_from_native_many``'s when every result is PyTorch's (the other conversions
    wait for the bytes)."""
    if kinds.count(NATIVE) == len(kinds):
        return list(tensors)  # nothing to convert (no pass per leaf)
    if kinds.count(TORCH) == len(kinds):
        return _torch_from_native_many(list(tensors), order, promised)  # one framework: no pass per leaf
    out = [None] * len(tensors)
    for i, (t, k) in enumerate(zip(tensors, kinds)):
        if k not in (TORCH, NUMPY) and t.dtype in dtypes_lacking(k):
            out[i] = t  # packed values the framework has no dtype for stay as they are
    _convert_each(out, [i for i, (t, k) in enumerate(zip(tensors, kinds)) if out[i] is None and _host_numpy(k, t)],
                  lambda at: tensors_to_numpy([tensors[i] for i in at], lambda j: shown(paths[at[j]])))
    _convert_each(out, [i for i, (t, k) in enumerate(zip(tensors, kinds)) if k == TORCH and out[i] is None],
                  lambda at: _torch_from_native_many([tensors[i] for i in at], order))
    _convert_each(out, [i for i, (t, k) in enumerate(zip(tensors, kinds)) if k == TENSORFLOW and out[i] is None],
                  lambda at: _tf_from_native_many([tensors[i] for i in at]))
    for i, (t, k) in enumerate(zip(tensors, kinds)):
        if out[i] is None:
            out[i] = from_native(t, k, paths[i])
    return out


def _tf_from_native_many(tensors):
    """TensorFlow tensors for native tensors through TensorFlow's DLPack import. Read-only
    memory (a mapped file) is copied first: TensorFlow may reuse an input's buffer for an
    op's output, writing into it."""
    import tensorflow as tf

    return _take_capsules(_writable(tensors), tf.experimental.dlpack.from_dlpack)


def _torch_from_native_many(tensors, order=False, promised=False):
    """PyTorch tensors for many native tensors (after their pending copies). Host tensors
    that lie evenly spaced in one buffer with one dtype and shape (what a load or a move
    to the host gives) come as runs: one capsule and one strided view per run, split by
    ``unbind``, each run within 1 MiB. The others take one capsule each, which PyTorch
    takes without the protocol's per-call overhead. Read-only memory is copied first:
    PyTorch tensors are always writable. With ``order``, CUDA tensors are handed over at
    once, PyTorch's current stream on their GPU made to wait for their copies on the GPU
    (as ``torch.from_dlpack`` would ask through ``__dlpack__(stream=…)``). With
    ``promised``, host tensors whose bytes may still be arriving are made at once (views:
    no byte is read); the caller keeps ``_native.to_dlpack_capsules``'s contract for them
    (``_api._load`` alone)."""
    import torch

    take = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
    tensors = _writable(tensors)
    streams = _torch_streams(torch, tensors) if order else None
    out = [None] * len(tensors)
    runs, rest = _native.host_runs(tensors, promised) if len(tensors) > 1 else ([], list(range(len(tensors))))
    for (_, dtype, shape, spacing, at), flat in zip(runs, _take_capsules([r[0] for r in runs], take, None, promised)):
        tdtype = getattr(torch, dtype, None)
        try:
            flat = flat.view(tdtype)
        except (RuntimeError, TypeError):
            rest.extend(at)  # a dtype PyTorch cannot view bytes as: one capsule each
            continue
        step, numel = spacing // flat.element_size(), math.prod(shape)
        for i, row in zip(at, torch.as_strided(flat, (len(at), numel), (step, 1)).view((len(at), *shape)).unbind(0)):
            out[i] = row
    lacking = dtypes_lacking(TORCH)
    for i in [i for i in rest if tensors[i].dtype in lacking]:
        out[i] = tensors[i]  # packed values PyTorch has no dtype for (float6) stay as they are
    rest = [i for i in rest if out[i] is None]
    if rest:
        for i, t in zip(rest, _take_capsules([tensors[i] for i in rest], take, streams, promised)):
            out[i] = t
    return out


def _torch_streams(torch, tensors):
    """``{gpu: handle of PyTorch's current stream there}`` for the GPUs of CUDA
    ``tensors`` (1, the legacy default stream, for PyTorch's default stream, as
    ``torch.from_dlpack`` passes it)."""
    gpus = {t.device for t in tensors if t.device.startswith("cuda:")}
    return {int(g[5:]): torch.cuda.current_stream(int(g[5:])).cuda_stream or 1 for g in gpus}


def _writable(tensors):
    """``tensors`` with every read-only one (a mapped file's) replaced by a copy, all the
    copies made by one consolidated move rather than one allocation each."""
    read_only = [i for i, t in enumerate(tensors) if t.is_read_only]
    if not read_only:
        return tensors
    tensors = list(tensors)
    copies = _native.move_tensors([tensors[i] for i in read_only], "cpu", True, False, False, "off")
    for i, c in zip(read_only, copies):
        tensors[i] = c
    return tensors


def _take_capsules(tensors, take, streams=None, promised=False):
    """``take`` of a legacy DLPack capsule of each tensor (writable already); ``streams``
    and ``promised`` as for ``_native.to_dlpack_capsules``."""
    return [take(c) for c in _native.to_dlpack_capsules(tensors, streams, promised)]


def importable(kind):
    """True when the framework can be used in this process."""
    if kind in (NATIVE, NUMPY, DLPACK):
        return True
    if kind in sys.modules:
        return True
    try:
        __import__(kind)
        return True
    except ImportError:
        return False
