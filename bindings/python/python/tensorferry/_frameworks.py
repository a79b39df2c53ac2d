"""Which framework a tensor leaf belongs to, and crossing between it and native tensors.

Leaves that count as tensors: ``tensorferry.Tensor``, NumPy arrays, and anything that
exports DLPack (PyTorch, JAX, CuPy). Results follow the input's framework.
"""

import sys

import numpy as np

from . import _native
from ._numpy import numpy_dtype_name, tensor_to_numpy

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
    """A native tensor viewing the leaf's memory (no copy)."""
    if kind == NATIVE:
        return obj
    if kind == NUMPY:
        if not obj.dtype.isnative:
            obj = obj.astype(obj.dtype.newbyteorder("="))
        try:
            return Tensor.from_numpy(obj, numpy_dtype_name(obj))
        except ValueError:
            # Byte strides that are no multiple of the element size: pack them first.
            return Tensor.from_numpy(np.ascontiguousarray(obj), numpy_dtype_name(obj))
    if kind == TORCH:
        if obj.requires_grad:
            obj = obj.detach()
        if obj.is_conj():
            obj = obj.resolve_conj()
        if obj.is_neg():
            obj = obj.resolve_neg()
    return Tensor.from_dlpack(obj)


def from_native(tensor, kind, key=""):
    """The tensor in the framework ``kind`` (host results of CuPy leaves become NumPy)."""
    if kind == NATIVE or kind == DLPACK:
        return tensor
    if kind == NUMPY or (kind == CUPY and tensor.device == "cpu"):
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
