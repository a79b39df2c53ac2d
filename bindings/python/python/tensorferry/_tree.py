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
    """A key path for messages: 'a/b/0', shortened in the middle when very deep."""
    if len(path) > 12:
        head = "/".join(str(p) for p in path[:5])
        tail = "/".join(str(p) for p in path[-5:])
        return f"{head}/…({len(path) - 10} more)…/{tail}"
    return "/".join(str(p) for p in path) or "<root>"
