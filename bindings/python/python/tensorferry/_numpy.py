"""Host tensors as NumPy arrays, zero-copy, with bfloat16 and float8 through ml_dtypes."""

from . import _native
from ._errors import FormatError

#: dtypes NumPy cannot hold by itself (ml_dtypes provides them).
ML_DTYPES = frozenset(
    {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz"}
)

#: dtypes no NumPy array holds: values packed several to an element (ml_dtypes keeps one
#: 4- or 6-bit value a byte).
PACKED_DTYPES = frozenset({"float4_e2m1fn_x2", "float6_e2m3fn_x4", "float6_e3m2fn_x4"})


def numpy_can_hold(dtype):
    """True when a tensor of ``dtype`` (a name) can become a NumPy array here."""
    if dtype in PACKED_DTYPES:
        return False
    if dtype not in ML_DTYPES:
        return True
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def require_ml_dtypes(name, key=""):
    """Raises a FormatError that names the key, the dtype and the way out when ml_dtypes
    is missing."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        where = f" at {key!r}" if key else ""
        raise FormatError(
            f"the {name} tensor{where} needs ml_dtypes to become a NumPy array: "
            f"pip install ml_dtypes (or read its raw bits with .view() on a uint array)"
        ) from None


def tensors_to_numpy(tensors, keys):
    """NumPy arrays viewing host tensors (read-only where the memory is), in one native
    call; ``keys()`` gives the key path of item ``i`` for error messages."""
    for i, t in enumerate(tensors):
        if t.dtype in ML_DTYPES:
            require_ml_dtypes(t.dtype, keys(i))
        elif t.dtype in PACKED_DTYPES:
            raise FormatError(
                f"cannot handle the value at {keys(i)!r}: a {t.dtype} tensor holds several values "
                "packed in each element, which no NumPy dtype holds (ml_dtypes keeps one value a "
                "byte): keep it a tensorferry.Tensor or a PyTorch tensor"
            )
    return _native.to_numpy_many(tensors)


def tensor_to_numpy(tensor, key=""):
    """A NumPy array viewing one host ``tensorferry.Tensor``."""
    return tensors_to_numpy([tensor], lambda i: key)[0]
