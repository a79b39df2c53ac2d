"""Host tensors as NumPy arrays, zero-copy, with bfloat16 and float8 through ml_dtypes."""

import numpy as np

from ._errors import FormatError

#: dtypes NumPy cannot hold by itself, and the ml_dtypes name of each.
ML_DTYPES = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


class _View:
    """Carries a tensor's array interface; the array keeps it (and so the tensor) alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor
        self.__array_interface__ = tensor._array_interface()


def ml_dtype(name, key=""):
    """The ml_dtypes dtype for ``name``, or a FormatError that says how to get one."""
    try:
        import ml_dtypes
    except ImportError:
        where = f" at {key!r}" if key else ""
        raise FormatError(
            f"the {name} tensor{where} needs ml_dtypes to become a NumPy array: "
            f"pip install ml_dtypes (or read its raw bits with .view() on a uint array)"
        ) from None
    return np.dtype(getattr(ml_dtypes, ML_DTYPES[name]))


def tensor_to_numpy(tensor, key=""):
    """A NumPy array viewing a host ``tensorferry.Tensor`` (read-only if its memory is)."""
    arr = np.asarray(_View(tensor))
    name = tensor.dtype
    if name in ML_DTYPES:
        arr = arr.view(ml_dtype(name, key))
    return arr


def numpy_dtype_name(arr):
    """The tensorferry dtype name of an array's dtype when the type string is ambiguous."""
    name = arr.dtype.name
    return name if name in ML_DTYPES else None
