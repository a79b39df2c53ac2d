"""What ``load`` does after reading: keep a subset of keys, cast floating dtypes, and fill
existing tensors (``out=``) after checking every name, shape and dtype."""

import fnmatch
from collections.abc import Mapping

import numpy as np

from . import _frameworks as fw
from . import _native
from ._errors import FormatError, TensorferryKeyError, TensorferryTypeError
from ._tree import dotted

_FLOATS = ("float16", "bfloat16", "float32", "float64")


_KEYS_TAKE = "a name or glob pattern (str), a key path (tuple), or a list of those"


def patterns(keys):
    """``(text, literal)`` for each of ``keys``: a str is a dotted name or a glob pattern
    ("model.*"); a tuple is a key path, matched literally (its parts may hold '*' or '[').
    Anything else is a :class:`TensorferryTypeError` naming ``keys`` and what it takes."""
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    elif isinstance(keys, (bytes, bytearray, memoryview)):
        raise TensorferryTypeError(f"keys={keys!r}: bytes are not names; keys takes {_KEYS_TAKE}")
    else:
        try:
            keys = list(keys)
        except TypeError:
            raise TensorferryTypeError(f"keys={keys!r}: keys takes {_KEYS_TAKE}, not {type(keys).__name__}") from None
    out = []
    for k in keys:
        if isinstance(k, tuple):
            out.append((dotted(k), True))
        elif isinstance(k, str):
            out.append((k, False))
        else:
            raise TensorferryTypeError(
                f"keys holds {k!r} ({type(k).__name__}): keys takes {_KEYS_TAKE}"
            )
    return out


def _matches(name, pattern):
    """A name is kept when the pattern names it, or a subtree that holds it."""
    text, literal = pattern
    if name == text or name.startswith(text + "."):
        return True
    return not literal and fnmatch.fnmatchcase(name, text)


def select(tree, keys):
    """The part of ``tree`` whose leaves' dotted names ``keys`` (as :func:`patterns` gives
    them) match; containers left empty are dropped. A pattern that matches nothing is a
    :class:`TensorferryKeyError`."""
    used = set()

    def keep(path):
        name = dotted(path)
        hits = [p for p in keys if _matches(name, p)]
        used.update(hits)
        return bool(hits)

    out = _native.prune(tree, keep)
    missing = [text for text, literal in keys if (text, literal) not in used]
    if missing:
        raise TensorferryKeyError(f"no key matches {missing}")
    return {} if out is None else out


def distinct(leaves, stored=None):
    """``leaves`` (``[(path, tensor)]``), each tensor once (tied names, such as a head sharing
    the embedding's weight, are one tensor), in order, under a name of the set ``stored``
    (the names the files hold: a tied name is in no header) where it has one."""
    first = {}
    for path, leaf in leaves:
        seen = first.get(id(leaf))
        if seen is None or (stored is not None and dotted(seen[0]) not in stored and dotted(path) in stored):
            first[id(leaf)] = (path, leaf)
    return list(first.values())


def stored_names(tree, stored):
    """``{id(tensor): name}``: the name each tensor of ``tree`` is stored under, one of the
    set ``stored`` where it has one (see :func:`distinct`)."""
    return {id(t): dotted(p) for p, t in distinct(_native.collect_tensors(tree, fw.kind_of), stored)}


def _dtype_name(dtype):
    """"bfloat16" of "bf16", "bfloat16", torch.bfloat16, np.float16, …"""
    text = str(dtype).replace("torch.", "").replace("<class 'numpy.", "").rstrip("'>")
    text = {"bf16": "bfloat16", "f16": "float16", "half": "float16", "f32": "float32", "float": "float32",
            "f64": "float64", "double": "float64"}.get(text, text)
    if text not in _FLOATS:
        raise FormatError(f"dtype={dtype!r}: loads cast to one of {_FLOATS}")
    return text


_ITEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def cast(tree, dtype, narrowing_only=False):
    """Every floating tensor of ``tree`` in ``dtype`` (integer and bool tensors stay), in
    its own framework and on its own device (PyTorch casts on the GPU). With
    ``narrowing_only``, only the tensors whose elements the cast makes smaller."""
    name = _dtype_name(dtype)

    def convert(x, path):
        if narrowing_only and _ITEM_BYTES.get(_name_of(x.dtype), 0) <= _ITEM_BYTES[name]:
            return x
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

    leaves = _native.collect_tensors(tree, fw.kind_of)
    return _native.rebuild(tree, {id(x): convert(x, p) for p, x in leaves})


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def fill(out, loaded):
    """Copies each tensor of ``loaded`` into the tensor of ``out`` at the same dotted name
    (a model's ``state_dict()``), after checking every name, shape and dtype, and that every
    target can be written, naming every problem at once: nothing is written unless all
    can be. Returns ``out``."""
    sources = {dotted(p): t for p, t in _native.collect_tensors(loaded, fw.kind_of)}
    targets = fill_targets(out, sources, sources.__getitem__)
    plain = plain_updates(out, loaded)
    # Every source in its target's framework before the first write: a conversion that
    # fails leaves every target as it was.
    ready = [(t, _like_target(t, sources[name])) for name, t in targets.items()]
    for t, s in ready:
        _copy_into(t, s)
    for update in plain:
        update()
    return out


def plain_updates(out, loaded):
    """The writes that give ``out=``'s plain values (None, bool, int, float, str: an epoch,
    a learning rate) those of ``loaded`` at the same key paths, as
    ``torch.distributed.checkpoint.load`` sets them: a list of functions to call once the
    tensors are filled. As there, a list or tuple holding no tensor is one value, replaced
    whole (a scheduler's milestones, an optimizer's betas); keys match as tensors' names
    do (0 and "0" alike). A value only one side has is left; one that differs inside a
    tuple that holds tensors (which cannot change) is a :class:`FormatError`, raised here,
    before anything is written."""
    leaves = _native.collect_tensors(out, fw.kind_of, True, plain=True)
    plain = [p for p, v in leaves if fw.kind_of(v) is None]
    if not plain:
        return []
    # The containers that hold a tensor somewhere below: the others are values.
    holding = {p[:i] for p, v in leaves if fw.kind_of(v) is not None for i in range(len(p))}
    units = {}
    for path in plain:
        node = out
        for i, key in enumerate(path):
            if isinstance(node, (list, tuple)) and path[:i] not in holding and i:
                path = path[:i]
                break
            node = _child(node, key)
        units[path] = None
    updates, problems = [], []
    for path in units:
        try:
            new = _at(loaded, path)
        except (LookupError, TypeError, AttributeError):
            continue  # out= alone has it
        parent = _at(out, path[:-1])
        old = _child(parent, path[-1])
        if _same_plain(new, old):
            continue
        if isinstance(parent, tuple) or not hasattr(parent, "__setitem__"):
            problems.append(f"{dotted(path)}: {new!r} in the file, {old!r} in out=, in a "
                            f"{type(parent).__name__}, which cannot change")
        else:
            updates.append(lambda parent=parent, key=path[-1], new=new: parent.__setitem__(key, new))
    if problems:
        raise FormatError("out= cannot be filled from the file:\n  " + "\n  ".join(problems))
    return updates


def _child(node, key):
    """The item ``key`` of a container (a field or attribute where it has no such item: a
    namedtuple's, a state dict's ``_metadata``); of a mapping, also under the key's other
    spelling (0 for "0", "0" for 0), as names match."""
    try:
        return node[key]
    except (KeyError, IndexError, TypeError):
        pass
    if isinstance(node, Mapping):
        other = str(key) if isinstance(key, int) else int(key) if isinstance(key, str) and key.isdigit() else None
        if other is not None and other in node:
            return node[other]
    return getattr(node, key)


def _at(tree, path):
    for key in path:
        tree = _child(tree, key)
    return tree


def _same_plain(a, b):
    """``a`` and ``b`` are the same plain value (of one type: 1 is not True nor 1.0; NaN is
    NaN), or lists or tuples of such values item by item."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same_plain, a, b))
    return a == b or (isinstance(a, float) and a != a and b != b)


def fill_targets(out, sources, value, cast_to=None):
    """``{name: tensor}`` of ``out=``'s leaves, once each can take the source of its name
    (``sources``: ``{name: tensor}``, whose shapes and dtypes are read; ``cast_to``: the
    dtype name floating sources arrive in); names that one tensor of ``out=`` shares (tied)
    must hold equal values, read through ``value(name)``. Every problem is named at once,
    in a :class:`FormatError`."""
    targets = {dotted(p): t for p, t in _native.collect_tensors(out, fw.kind_of)}
    problems = []
    missing = set(targets) - set(sources)
    if missing:
        # A name of a tied tensor that the file stores once, under another of its names (as
        # transformers' save_pretrained and safetensors' save_model store lm_head.weight
        # tied to the embeddings), is filled through that name.
        held = {_memory_of(t) for n, t in targets.items() if n in sources} - {None}
        for name in [n for n in missing if _memory_of(targets[n]) in held]:
            missing.discard(name)
            del targets[name]
    for name in sorted(missing):
        problems.append(f"{name}: in out= but not in the file")
    for name in sorted(set(sources) - set(targets)):
        problems.append(f"{name}: in the file but not in out=")
    for name in sorted(set(targets) & set(sources)):
        t, s = targets[name], sources[name]
        unwritable = _unwritable(t)
        stored = _name_of(s.dtype)
        if cast_to is not None and stored in _FLOATS:
            stored = cast_to
        if unwritable:
            problems.append(f"{name}: {unwritable}")
        elif tuple(t.shape) != tuple(s.shape):
            problems.append(f"{name}: shape {tuple(s.shape)} in the file, {tuple(t.shape)} in out=")
        elif _name_of(t.dtype) != stored:
            problems.append(f"{name}: dtype {stored} in the file, {_name_of(t.dtype)} in out=")
    problems += _aliased({n: t for n, t in targets.items() if n in sources}, value)
    if problems:
        raise FormatError("out= cannot be filled from the file:\n  " + "\n  ".join(problems))
    return targets


def copy_into(target, source):
    """Writes ``source`` (a loaded tensor of the same shape and dtype) into ``target``, a
    leaf of ``out=`` that :func:`fill_targets` accepted."""
    _copy_into(target, _like_target(target, source))


def _memory_of(t):
    """``(first byte, end byte, layout)`` of a PyTorch tensor's or NumPy array's memory, or
    None for other leaves. ``layout`` tells the same tensor from an overlapping view."""
    kind = fw.kind_of(t)
    if kind == fw.TORCH:
        import torch

        if t.is_meta or t.layout != torch.strided:
            return None
        start, size, shape, strides = t.data_ptr(), t.element_size(), tuple(t.shape), tuple(t.stride())
        strides = tuple(st * size for st in strides)
    elif kind == fw.NUMPY:
        start, size, shape, strides = t.__array_interface__["data"][0], t.itemsize, t.shape, t.strides
    else:
        return None
    if 0 in shape:
        return None
    low = start + sum(st * (n - 1) for n, st in zip(shape, strides) if st < 0)
    high = start + sum(st * (n - 1) for n, st in zip(shape, strides) if st > 0) + size
    return low, high, (start, shape, strides, str(t.dtype))


def _overlap_runs(spans):
    """The runs of ``spans`` (``[(low, high, layout, item)]``, sorted) whose memory overlaps
    an earlier member's, each ``[(layout, item)]`` of two or more, in order."""
    runs, run, reach = [], [], None
    for low, high, layout, item in spans:
        if reach is not None and low < reach:
            run.append((layout, item))
            reach = max(reach, high)
        else:
            if len(run) > 1:
                runs.append(run)
            run, reach = [(layout, item)], high
    if len(run) > 1:
        runs.append(run)
    return runs


def tie_shared(tree):
    """``tree`` with every PyTorch tensor or NumPy array that is the same view of memory as
    an earlier one (tied weights: ``lm_head.weight`` and ``wte.weight`` of one storage)
    replaced by that earlier object, so that a copy of the tree keeps them one tensor.
    Views that overlap without being the same are a :class:`FormatError` naming both, as a
    save refuses them."""
    leaves = [(p, x) for p, x in _native.collect_tensors(tree, fw.kind_of) if fw.kind_of(x) in (fw.TORCH, fw.NUMPY)]
    spans = sorted((m[0], m[1], m[2], i) for i, m in enumerate(_memory_of(x) for _, x in leaves) if m is not None)
    ties = {}
    for (first, j), *rest in _overlap_runs(spans):
        for layout, i in rest:
            if layout != first:
                a, b = sorted((i, j))
                raise FormatError(
                    f"{dotted(leaves[b][0])!r}: its memory overlaps that of {dotted(leaves[a][0])!r} (views of "
                    "one storage that are not the same tensor); a file stores each tensor's bytes apart and "
                    "cannot keep the overlap: save a copy of one (`.clone()`), or leave one out"
                )
            ties[id(leaves[i][1])] = leaves[j][1]
    if not ties:
        return tree
    return _native.rebuild(tree, ties)


def _aliased(targets, value):
    """Problems with targets that share memory: names of one tensor (tied weights) must
    hold equal values in the file (``value(name)``: the loaded tensor of a name), and
    overlapping views cannot be filled at all."""
    spans = sorted(
        (m[0], m[1], m[2], name) for name, m in ((n, _memory_of(t)) for n, t in targets.items()) if m is not None
    )
    problems = []
    for group in _overlap_runs(spans):
        names = sorted(n for _, n in group)
        if len({layout for layout, _ in group}) > 1:
            problems.append(f"{', '.join(names)}: overlapping views of one memory in out= cannot be filled; clone() them")
            continue
        first = np.asarray(_bytes_of(value(names[0])))
        differ = [n for n in names[1:] if not np.array_equal(first, np.asarray(_bytes_of(value(n))))]
        if differ:
            problems.append(
                f"{', '.join(names)}: one tensor in out= (tied), but the file holds different values for "
                f"{', '.join([names[0]] + differ)}"
            )
    return problems


def _bytes_of(x):
    """The raw bytes of a loaded tensor, for comparing values whatever the dtype."""
    if fw.kind_of(x) == fw.TORCH:
        import torch

        x = x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def _like_target(t, src):
    """``src`` in the form ``_copy_into`` writes into ``t``: a PyTorch tensor for a
    PyTorch target (NumPy's bfloat16 and float8 arrays through their bytes, which
    ``torch.from_numpy`` refuses)."""
    if fw.kind_of(t) != fw.TORCH:
        return src
    import warnings

    import torch

    if torch.is_tensor(src):
        return src
    arr = np.asarray(src)
    with warnings.catch_warnings():
        # A mapped file's arrays are read-only; the copy only reads them.
        warnings.simplefilter("ignore", UserWarning)
        if arr.dtype.name == "bfloat16" or arr.dtype.name.startswith("float8"):
            raw = torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
            return raw.view(t.dtype).reshape(arr.shape)
        return torch.from_numpy(arr)


def _name_of(dtype):
    return str(dtype).replace("torch.", "")


def _unwritable(t):
    """Why ``t`` (a leaf of ``out=``) cannot be filled in place, or None when it can."""
    kind = fw.kind_of(t)
    if kind == fw.TORCH:
        import torch

        if t.layout != torch.strided:
            return f"a {t.layout} tensor cannot be filled in place; pass a dense (strided) tensor"
        if t.is_meta:
            return "a meta tensor has no memory to fill; materialise it first (to_empty)"
        if t.is_inference() and not torch.is_inference_mode_enabled():
            return "an inference tensor (made under torch.inference_mode()) cannot be written outside it; clone() it"
        if _shares_elements(t.shape, t.stride()):
            return "an expanded tensor (stride 0: several elements share memory) cannot be filled; clone() it"
        return None
    if kind == fw.NUMPY:
        if not t.flags.writeable:
            return "a read-only NumPy array cannot be filled; pass a writable array"
        if _shares_elements(t.shape, t.strides):
            return "an expanded array (stride 0: several elements share memory) cannot be filled; copy it"
        return None
    return f"out= holds {type(t).__name__}: PyTorch tensors and NumPy arrays can be filled"


def _shares_elements(shape, strides):
    """True when two elements of a layout share memory (a stride of 0 over two or more)."""
    return any(n > 1 and st == 0 for n, st in zip(shape, strides))


def _copy_into(dst, src):
    kind = fw.kind_of(dst)
    if kind == fw.TORCH:
        import torch

        with torch.no_grad():
            dst.copy_(src)
    else:
        np.copyto(dst, np.asarray(src))
