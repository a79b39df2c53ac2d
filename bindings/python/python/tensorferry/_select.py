"""What ``load`` does after reading: keep a subset of keys, cast floating dtypes, and fill
existing tensors (``out=``) after checking every name, shape and dtype."""

import fnmatch

import numpy as np

from . import _frameworks as fw
from ._errors import FormatError, TensorferryKeyError
from ._tree import _DICT, _LEAF, _MAPPING, _NAMEDTUPLE, _TUPLE, collect, container_kind, dotted

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _patterns(keys):
    """``(text, literal)`` for each of ``keys``: a str is a dotted name or a glob pattern
    ("model.*"); a tuple is a key path, matched literally (its parts may hold '*' or '[')."""
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    out = []
    for k in keys:
        if isinstance(k, tuple):
            out.append((dotted(k), True))
        elif isinstance(k, str):
            out.append((k, False))
        else:
            raise TypeError(f"keys must be names, glob patterns or key-path tuples, not {type(k).__name__}")
    return out


def _matches(name, pattern):
    """A name is kept when the pattern names it, or a subtree that holds it."""
    text, literal = pattern
    if name == text or name.startswith(text + "."):
        return True
    return not literal and fnmatch.fnmatchcase(name, text)


def select(tree, keys):
    """The part of ``tree`` whose leaves' dotted names ``keys`` match; containers left
    empty are dropped. A pattern that matches nothing is a :class:`TensorferryKeyError`."""
    patterns = _patterns(keys)
    used = set()

    def prune(node, path):
        kind = container_kind(node)
        if kind == _LEAF:
            name = dotted(path)
            hits = [p for p in patterns if _matches(name, p)]
            used.update(hits)
            return node if hits else _DROP
        if kind in (_DICT, _MAPPING):
            items = {k: prune(v, path + (k,)) for k, v in node.items()}
            items = {k: v for k, v in items.items() if v is not _DROP}
            return items if items else _DROP
        items = [prune(v, path + (i,)) for i, v in enumerate(node)]
        kept = [v for v in items if v is not _DROP]
        if not kept:
            return _DROP
        return tuple(kept) if kind in (_TUPLE, _NAMEDTUPLE) else kept

    out = prune(tree, ())
    missing = [text for text, literal in patterns if (text, literal) not in used]
    if missing:
        raise TensorferryKeyError(f"no key matches {missing}")
    return {} if out is _DROP else out


_DROP = object()


def _dtype_name(dtype):
    """"bfloat16" of "bf16", "bfloat16", torch.bfloat16, np.float16, …"""
    text = str(dtype).replace("torch.", "").replace("<class 'numpy.", "").rstrip("'>")
    text = {"bf16": "bfloat16", "f16": "float16", "half": "float16", "f32": "float32", "float": "float32",
            "f64": "float64", "double": "float64"}.get(text, text)
    if text not in _FLOATS:
        raise ValueError(f"dtype={dtype!r}: loads cast to one of {_FLOATS}")
    return text


def cast(tree, dtype):
    """Every floating tensor of ``tree`` in ``dtype`` (integer and bool tensors stay), in
    its own framework and on its own device (PyTorch casts on the GPU)."""
    name = _dtype_name(dtype)

    def convert(x, path):
        kind = fw.kind_of(x)
        if kind == fw.TORCH:
            import torch

            return x.to(getattr(torch, name)) if x.is_floating_point() else x
        if kind == fw.NUMPY:
            if x.dtype.kind == "f" or str(x.dtype) == "bfloat16":
                return x.astype(_numpy_dtype(name))
            return x
        if kind == fw.JAX:
            import jax.numpy as jnp

            return x.astype(getattr(jnp, name)) if jnp.issubdtype(x.dtype, jnp.floating) else x
        if kind == fw.NATIVE:
            if x.dtype not in _FLOATS or x.dtype == name:
                return x
            if x.device != "cpu":
                raise FormatError(f"cannot cast {'/'.join(map(str, path))!r} on {x.device}: load with a framework (like=)")
            return fw.Tensor.from_numpy(np.ascontiguousarray(x.numpy().astype(_numpy_dtype(name))))
        return x

    leaves = collect(tree, lambda x, p: fw.kind_of(x) is not None)
    from ._tree import rebuild

    return rebuild(tree, {id(x): convert(x, p) for p, x in leaves})


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def fill(out, loaded):
    """Copies each tensor of ``loaded`` into the tensor of ``out`` at the same dotted name
    (a model's ``state_dict()``), after checking every name, shape and dtype and naming
    every mismatch at once; returns ``out``."""
    targets = {dotted(p): t for p, t in collect(out, lambda x, p: fw.kind_of(x) is not None)}
    sources = {dotted(p): t for p, t in collect(loaded, lambda x, p: fw.kind_of(x) is not None)}
    problems = []
    for name in sorted(set(targets) - set(sources)):
        problems.append(f"{name}: in out= but not in the file")
    for name in sorted(set(sources) - set(targets)):
        problems.append(f"{name}: in the file but not in out=")
    for name in sorted(set(targets) & set(sources)):
        t, s = targets[name], sources[name]
        if tuple(t.shape) != tuple(s.shape):
            problems.append(f"{name}: shape {tuple(s.shape)} in the file, {tuple(t.shape)} in out=")
        elif _name_of(t.dtype) != _name_of(s.dtype):
            problems.append(f"{name}: dtype {_name_of(s.dtype)} in the file, {_name_of(t.dtype)} in out=")
    if problems:
        raise FormatError("out= does not match the file:\n  " + "\n  ".join(problems))
    for name, t in targets.items():
        _copy_into(t, sources[name])
    return out


def _name_of(dtype):
    return str(dtype).replace("torch.", "")


def _copy_into(dst, src):
    kind = fw.kind_of(dst)
    if kind == fw.TORCH:
        import torch

        import warnings

        with torch.no_grad(), warnings.catch_warnings():
            # A mapped file's arrays are read-only; copy_ only reads them.
            warnings.simplefilter("ignore", UserWarning)
            dst.copy_(src if torch.is_tensor(src) else torch.from_numpy(np.asarray(src)))
    elif kind == fw.NUMPY:
        np.copyto(dst, np.asarray(src))
    else:
        raise FormatError(f"out= holds {type(dst).__name__}: PyTorch tensors and NumPy arrays can be filled")
