"""Walking nested containers: dicts (any Mapping), lists and tuples (namedtuples too).

Two passes share one set of rules: ``collect`` finds the leaves an operation must
change, and ``rebuild`` makes the new structure with the replacements, keeping every
other leaf as the very same object and each container's own type where possible.
"""

from collections import OrderedDict, defaultdict
from collections.abc import Mapping

from . import _native
from ._errors import TensorferryRuntimeError

_DICT, _LIST, _TUPLE, _NAMEDTUPLE, _MAPPING, _LEAF = range(6)

MAX_DEPTH = _native.MAX_DEPTH
"""The deepest nesting of containers a walk accepts; deeper is a ``FormatError``."""


def container_kind(obj):
    t = type(obj)
    if t is dict:
        return _DICT
    if t is list:
        return _LIST
    if t is tuple:
        return _TUPLE
    if isinstance(obj, tuple):
        return _NAMEDTUPLE if hasattr(t, "_fields") else _TUPLE
    if isinstance(obj, list):
        return _LIST
    if isinstance(obj, Mapping):
        return _MAPPING
    return _LEAF


def _enter(obj, path, ancestors):
    """``ancestors`` with ``obj`` (a container at ``path``) added; a :class:`FormatError`
    when ``obj`` encloses itself or lies deeper than ``MAX_DEPTH`` levels."""
    from ._errors import FormatError

    if id(obj) in ancestors:
        raise FormatError(
            f"cannot handle the value at {shown(path)!r}: the structure contains itself here "
            "(a container inside itself); tensorferry needs a tree"
        )
    if len(ancestors) >= MAX_DEPTH:
        raise FormatError(
            f"cannot handle the value at {shown(path)!r}: nested deeper than {MAX_DEPTH} levels, "
            "the most tensorferry walks"
        )
    return ancestors + (id(obj),)


def is_torch_state(obj):
    """True for the state dict of a PyTorch optimizer (it holds ``"state"`` and
    ``"param_groups"``) or learning-rate scheduler (it holds ``"_last_lr"``, as every
    scheduler's does, or ``"base_lrs"`` and ``"last_epoch"``): records of hyper-parameters,
    whose lists of numbers are no data (the native walker's rule, in ``walk.rs``)."""
    try:
        return ("state" in obj and "param_groups" in obj) or "_last_lr" in obj or (
            "base_lrs" in obj and "last_epoch" in obj
        )
    except Exception:  # a Mapping whose ``in`` fails holds no such state
        return False


def collect(obj, select, path=(), out=None, ancestors=()):
    """``[(path, leaf)]`` for every leaf (or data list) for which ``select(obj, path)``
    is true, in traversal order. ``select`` sees containers too, so that it can claim a
    list of numbers as one leaf; within a PyTorch optimizer's or scheduler's state
    (:func:`is_torch_state`) only tensors are leaves. ``ancestors`` are the ids of the
    enclosing containers (for a walk that starts inside a tree)."""
    if out is None:
        out = []
    if select(obj, path):
        out.append((path, obj))
        return out
    kind = container_kind(obj)
    if kind == _LEAF:
        return out
    ancestors = _enter(obj, path, ancestors)
    if kind == _DICT or kind == _MAPPING:
        if select is not select_tensors and is_torch_state(obj):
            select = select_tensors
        for k, v in list(obj.items()):
            collect(v, select, path + (k,), out, ancestors)
    else:
        for i, v in enumerate(list(obj)):
            collect(v, select, path + (i,), out, ancestors)
    return out


def rebuild(obj, replacements, plain=False, ancestors=(), path=(), strict=None, skip_numpy=False):
    """A new structure like ``obj`` where each object whose ``id`` is in ``replacements``
    is swapped for its replacement. With ``plain``, containers become dict/list/tuple.
    With ``strict`` (a ``kind_of``), a tensor leaf without a replacement is an error: the
    structure changed after its leaves were collected (NumPy arrays exempt with
    ``skip_numpy``)."""
    r = replacements.get(id(obj), _MISSING) if replacements else _MISSING
    if r is not _MISSING:
        return r
    kind = container_kind(obj)
    if kind == _LEAF:
        if strict is not None and strict(obj) is not None:
            if not (skip_numpy and strict(obj) == "numpy"):
                raise TensorferryRuntimeError(
                    f"the structure changed during the call at {shown(path)!r}: a tensor appeared that "
                    "was not there when its leaves were collected (another thread modified it?)"
                )
        return obj
    ancestors = _enter(obj, path, ancestors)
    if kind == _DICT or kind == _MAPPING:
        items = {}
        for k, v in list(obj.items()):
            items[k] = rebuild(v, replacements, plain, ancestors, path + (k,), strict, skip_numpy)
        if kind == _DICT or plain:
            return items
        return _same_mapping(obj, items)
    items = []
    for i, v in enumerate(list(obj)):
        items.append(rebuild(v, replacements, plain, ancestors, path + (i,), strict, skip_numpy))
    t = type(obj)
    if kind == _LIST:
        return items if plain or t is list else _same_type(t, items, list)
    if kind == _NAMEDTUPLE:
        return tuple(items) if plain else t(*items)
    return tuple(items) if plain or t is tuple else _same_type(t, items, tuple)


_MISSING = object()


def _same_mapping(obj, items):
    """A mapping of ``obj``'s type holding ``items`` (a defaultdict keeps its factory, an
    ``OrderedDict`` its instance attributes, such as the ``_metadata`` of PyTorch's
    ``state_dict()``, as the native walker keeps them); a plain dict when the type cannot
    be built from items. Never touches ``obj``."""
    try:
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, items)
        if type(obj) is OrderedDict:
            out = OrderedDict(items)
            out.__dict__.update(obj.__dict__)
            return out
        return type(obj)(items)
    except Exception:
        return items


def _same_type(t, items, base):
    try:
        return t(items)
    except Exception:
        return base(items)


def select_tensors(obj, path):
    """``collect``'s selector for tensor leaves (the native walker hands subtrees of
    unusual containers back to ``collect`` with it)."""
    from ._frameworks import kind_of

    return kind_of(obj) is not None


def dotted(path):
    """The file name of a key path: its parts joined with '.'."""
    return ".".join(str(p) for p in path)


def shown(path):
    """A key path for messages: 'a/b/0', shortened in the middle when very deep."""
    if len(path) > 12:
        head = "/".join(str(p) for p in path[:5])
        tail = "/".join(str(p) for p in path[-5:])
        return f"{head}/…({len(path) - 10} more)…/{tail}"
    return "/".join(str(p) for p in path) or "<root>"
