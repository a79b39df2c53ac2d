"""Reads of chosen byte ranges of one object in object storage (``s3://…``), straight into
writable buffers: for readers that plan their own reads (``tensorferry.dcp``'s reader,
process-group loads). The requests are the native client's (parallel ranged GETs, retries,
every answer checked against one version of the object)."""

import ctypes

from . import _native
from ._errors import TensorferryTypeError


def read_header(url):
    """``(data_start, entries, etag, size)`` of the safetensors object at ``url``: entries
    ``(name, dtype code, shape, begin, end)`` with offsets absolute in the object, validated
    as ``tensorferry.load`` validates a header; ``etag`` None where the store gives none."""
    return _native.object_read_header(url)[:4]


def read_into(url, targets, etag=None):
    """Fills each ``(offset, buffer)`` of ``targets`` — a writable, C-contiguous buffer
    (``bytearray``, a NumPy array, ``memoryview(tensor.numpy())``…) — with the object's
    bytes from ``offset``, ``len`` of the buffer's bytes, in parallel ranged GETs with the
    GIL released. With ``etag`` the object must still be that version (else an ``OSError``
    saying it was replaced); in any case all bytes come from one version of it.

    >>> buf = bytearray(16)                                          # doctest: +SKIP
    >>> read_into("s3://bucket/model.safetensors", [(0, buf)])       # doctest: +SKIP
    """
    held, spans = exported_spans(targets)
    try:
        _native.object_read_into(url, spans, etag)
    finally:
        del held


def exported_spans(targets):
    """``(held, spans)`` for ``(offset, buffer)`` targets: ``spans`` are ``(offset,
    address, length)`` of the writable buffers (empty ones left out), which stay exported
    while ``held`` lives — the way native reads write into Python buffers."""
    held, spans = [], []
    for offset, buffer in targets:
        view = memoryview(buffer).cast("B")  # TypeError for a buffer that is not contiguous
        if view.readonly:
            raise TensorferryTypeError(f"read_into writes into its buffers: a read-only {type(buffer).__name__} was given")
        if not len(view):
            continue
        window = (ctypes.c_char * len(view)).from_buffer(view)  # keeps the buffer exported
        held.append(window)
        spans.append((int(offset), ctypes.addressof(window), len(view)))
    return held, spans


def read_ranges(url, ranges, etag=None):
    """The bytes of each ``(start, end)`` of ``ranges`` of the object at ``url``, as
    ``bytes``, read as :func:`read_into` reads."""
    return _native.object_read_ranges(url, [(int(a), int(b)) for a, b in ranges], etag)
