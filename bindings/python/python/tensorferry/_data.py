"""Lists of Python numbers that ``to_device`` takes as data: which lists are data, and
the tensor each becomes (float -> float32, int -> int64, bool -> bool), for the engine's
moves and the frameworks' alike."""

import warnings

import numpy as np

from . import _frameworks as fw
from . import _native
from ._errors import FormatError, TensorferryOverflowError
from ._tree import MAX_DEPTH, shown


def _is_number(x):
    return type(x) in (int, float, bool) or isinstance(x, (int, float))


def numeric_data(obj, depth=0):
    """True for a non-empty list holding only numbers and such lists: data to become one
    tensor (a tuple is a record, never data). Lists nested deeper than a walk goes are
    not data (the walk then refuses them with the depth)."""
    if not isinstance(obj, list) or not obj or depth >= MAX_DEPTH:
        return False
    for x in obj:
        if _is_number(x):
            continue
        if not numeric_data(x, depth + 1):
            return False
    return True


_STANDARD = {"f": np.float32, "i": np.int64, "u": np.int64, "b": np.bool_}


def data_to_tensor(data, path):
    try:
        with warnings.catch_warnings():
            # NumPy 1.x warns and makes an object array of a ragged list; 2.x raises.
            warnings.simplefilter("ignore")
            arr = np.asarray(data)
    except (ValueError, RuntimeError) as e:
        raise FormatError(f"ragged list at {shown(path)!r} cannot become a tensor: {e}") from None
    if (arr.dtype.kind in "uf" and _all_ints(data)) or (arr.dtype.kind == "O" and _beyond_int64(data)):
        # NumPy makes uint64, float64 or objects of lists holding integers beyond int64.
        raise TensorferryOverflowError(
            f"cannot handle the value at {shown(path)!r}: an integer does not fit in int64"
        )
    if arr.dtype.kind not in _STANDARD:
        raise FormatError(f"ragged list at {shown(path)!r} cannot become a tensor (rows differ in length)")
    if arr.dtype.kind == "f":
        with np.errstate(over="ignore"):
            narrow = arr.astype(np.float32)
        if np.isinf(narrow).any() and not np.array_equal(np.isinf(narrow), np.isinf(arr)):
            raise TensorferryOverflowError(
                f"cannot handle the value at {shown(path)!r}: a finite number exceeds float32's range "
                f"(±{float(np.finfo(np.float32).max):.4g}); pass a float64 NumPy array to keep it"
            )
        arr = narrow
    arr = np.ascontiguousarray(arr, dtype=_STANDARD[arr.dtype.kind])
    return fw.Tensor.from_numpy(arr)


def _numbers(data):
    """Every number of the nested list ``data``."""
    stack = [data]
    while stack:
        x = stack.pop()
        if _native.container_kind(x) in ("list", "tuple"):
            stack.extend(x)
        else:
            yield x


def _beyond_int64(data):
    """True when the nested list ``data`` holds an integer outside int64's range."""
    return any(isinstance(x, int) and not -(2**63) <= x < 2**63 for x in _numbers(data))


def _all_ints(data):
    """True when every number in the nested list ``data`` is an int (bools included)."""
    return all(isinstance(x, int) for x in _numbers(data))
