"""One comparison of trees for every test: ``assert_same(got, want)`` fails naming the first
place where ``got`` differs from ``want``; ``same(got, want)`` answers as a bool, for
hypothesis.

Strict by default: containers of the same class; dict keys of the same types in the same
order; plain values of the same type and value (a NaN equals a NaN); tensors of the same
class and device, with the same dtype, shape and bytes (so a NaN equals the same NaN):
NumPy arrays, PyTorch tensors, ``tensorferry.Tensor`` on any device, and any array NumPy
can read (JAX's, TensorFlow's). Each keyword loosens one of these, for the tests whose
subject it is not.
"""

import math
import sys

import numpy as np

import tensorferry as tf


def assert_same(got, want, path="<root>", *, any_framework=False, any_dict=False, any_key_order=False):
    """``got`` holds what ``want`` holds, strictly (see the module), but:

    - ``any_framework``: a tensor may be of another framework or device than ``want``'s (a
      PyTorch tensor against a tensorferry one on the emulated device); its dtype, shape
      and bytes still agree;
    - ``any_dict``: a dict may be of another dict class (a ``dict`` for an ``OrderedDict``);
    - ``any_key_order``: a dict's keys may come in another order (a foreign loader's).
    """
    loose = {"any_framework": any_framework, "any_dict": any_dict, "any_key_order": any_key_order}
    if _is_tensor(want):
        _assert_same_tensor(got, want, path, any_framework)
    elif any_dict and isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {type(got).__name__}, want a dict"
    else:
        assert type(got) is type(want), f"{path}: {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, dict):
        got_keys, want_keys = [(type(k), k) for k in got], [(type(k), k) for k in want]
        if any_key_order:
            got_keys, want_keys = set(got_keys), set(want_keys)
        assert got_keys == want_keys, f"{path}: keys {list(got)}, want {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}", **loose)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: {len(got)} items, want {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}/{i}", **loose)
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), f"{path}: {got!r}, want nan"
    elif not _is_tensor(want):
        assert got == want, f"{path}: {got!r}, want {want!r}"


def same(got, want, **loosen):
    """Whether ``assert_same(got, want, **loosen)`` passes."""
    try:
        assert_same(got, want, **loosen)
    except AssertionError:
        return False
    return True


def _torch_tensor(x):
    torch = sys.modules.get("torch")  # not imported: no PyTorch tensor exists
    return torch is not None and isinstance(x, torch.Tensor)


def _is_tensor(x):
    return isinstance(x, (np.ndarray, tf.Tensor)) or _torch_tensor(x) or hasattr(x, "__array__")


def _device(x):
    return x.device if isinstance(x, tf.Tensor) or _torch_tensor(x) else None


def _contents(x):
    """The dtype's name, the shape and the bytes in C order (a flat uint8 array, a view
    where it can be) of a tensor of any framework on any device."""
    if _torch_tensor(x):
        import torch

        flat = x.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return str(x.dtype).removeprefix("torch."), tuple(x.shape), flat.view(torch.uint8).numpy()
    a = x.numpy() if isinstance(x, tf.Tensor) else np.asarray(x)
    return str(a.dtype), a.shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _assert_same_tensor(got, want, path, any_framework):
    assert _is_tensor(got), f"{path}: {type(got).__name__}, want a tensor"
    if not any_framework:
        assert type(got) is type(want), f"{path}: {type(got).__name__}, want {type(want).__name__}"
        assert _device(got) == _device(want), f"{path}: on {_device(got)}, want {_device(want)}"
    (got_dtype, got_shape, got_bytes), (want_dtype, want_shape, want_bytes) = _contents(got), _contents(want)
    assert (got_dtype, got_shape) == (want_dtype, want_shape), (
        f"{path}: {got_dtype} {list(got_shape)}, want {want_dtype} {list(want_shape)}")
    assert np.array_equal(got_bytes, want_bytes), f"{path}: other values"
