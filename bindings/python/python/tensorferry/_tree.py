"""Key paths of nested containers, for names and messages.

The containers themselves are walked by one walker, the native one (``_native``:
``collect_tensors``, ``rebuild``, ``nested_keys``, ``container_kind``), which enters every
kind of container (dicts and any Mapping, lists, tuples and namedtuples) by its rules.
"""

from . import _native

MAX_DEPTH = _native.MAX_DEPTH
"""The deepest nesting of containers a walk accepts; deeper is a ``FormatError``."""


def dotted(path):
    """The file name of a key path: its parts joined with '.'."""
    return ".".join(str(p) for p in path)


def shown(path):
    """A key path for messages: 'a/b/0', shortened in the middle when very deep (as the
    walker's own errors show them)."""
    return _native.shown_path(list(path))
