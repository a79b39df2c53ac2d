"""Which framework a tensor leaf belongs to, and crossing between it and native tensors.

Leaves that count as tensors: ``tensorferry.Tensor``, NumPy arrays, and anything that
exports DLPack (PyTorch, JAX, CuPy). Results follow the input's framework.
"""

import sys

import numpy as np

from . import _native
from ._numpy import tensor_to_numpy, tensors_to_numpy  # noqa: F401 (re-exported)
from ._tree import shown

Tensor = _native.Tensor

NATIVE = "tensorferry"
NUMPY = "numpy"
TORCH = "torch"
JAX = "jax"
CUPY = "cupy"
DLPACK = "dlpack"

_kind_cache = {}


def _classify(t):
    if t is Tensor:
        return NATIVE
    if issubclass(t, np.ndarray):
        return NUMPY
    module = getattr(t, "__module__", "") or ""
    has_dlpack = hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")
    if not has_dlpack:
        return None
    for prefix, kind in (("torch", TORCH), ("jax", JAX), ("cupy", CUPY)):
        if module.startswith(prefix):
            return kind
    return DLPACK


def kind_of(obj):
    """The framework of a tensor leaf, or None when ``obj`` is not a tensor."""
    t = type(obj)
    try:
        return _kind_cache[t]
    except KeyError:
        kind = _kind_cache[t] = _classify(t)
        return kind


def device_of(obj, kind):
    """The canonical device string of a tensor leaf ("cpu", "cuda:0")."""
    if kind == NUMPY:
        return "cpu"
    if kind == NATIVE:
        return obj.device
    if kind == TORCH:
        dev = obj.device
        if dev.type == "cpu":
            return "cpu"
        return f"{dev.type}:{dev.index or 0}"
    dev_type, dev_id = obj.__dlpack_device__()
    return {1: "cpu", 3: "cpu", 2: f"cuda:{dev_id}", 13: f"cuda:{dev_id}"}.get(int(dev_type), f"dlpack:{dev_type}")


def to_native(obj, kind):
    """A native tensor viewing the leaf's memory (no copy where the layout allows)."""
    if kind == NATIVE:
        return obj
    if kind == NUMPY:
        return Tensor.from_numpy(obj)
    if kind == TORCH:
        if obj.requires_grad:
            obj = obj.detach()
        if obj.is_conj():
            obj = obj.resolve_conj()
        if obj.is_neg():
            obj = obj.resolve_neg()
    return Tensor.from_dlpack(obj)


def to_native_many(leaves, kinds):
    """``to_native`` for many leaves; NumPy arrays go through one native call."""
    out = [None] * len(leaves)
    numpy_at = [i for i, k in enumerate(kinds) if k == NUMPY]
    if numpy_at:
        for i, t in zip(numpy_at, _native.from_numpy_many([leaves[i] for i in numpy_at])):
            out[i] = t
    for i, (leaf, kind) in enumerate(zip(leaves, kinds)):
        if kind != NUMPY:
            out[i] = to_native(leaf, kind)
    return out


def _host_numpy(kind, tensor):
    return kind == NUMPY or (kind == CUPY and tensor.device == "cpu")


def from_native(tensor, kind, key=""):
    """The tensor in the framework ``kind`` (host results of CuPy leaves become NumPy)."""
    if kind == NATIVE or kind == DLPACK:
        return tensor
    if _host_numpy(kind, tensor):
        return tensor_to_numpy(tensor, key)
    if kind == TORCH:
        import torch

        if tensor.is_read_only:
            # PyTorch tensors are always writable: give it memory it may write.
            tensor = tensor.copy()
        return torch.from_dlpack(tensor)
    if kind == JAX:
        import jax

        return jax.dlpack.from_dlpack(tensor)
    if kind == CUPY:
        import cupy

        return cupy.from_dlpack(tensor)
    raise AssertionError(kind)


def from_native_many(tensors, kinds, paths):
    """``from_native`` for many tensors; NumPy results come from one native call."""
    out = [None] * len(tensors)
    numpy_at = [i for i, (t, k) in enumerate(zip(tensors, kinds)) if _host_numpy(k, t)]
    if numpy_at:
        arrays = tensors_to_numpy([tensors[i] for i in numpy_at], lambda j: shown(paths[numpy_at[j]]))
        for i, a in zip(numpy_at, arrays):
            out[i] = a
    for i, (t, k) in enumerate(zip(tensors, kinds)):
        if out[i] is None:
            out[i] = from_native(t, k, shown(paths[i]))
    return out


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
