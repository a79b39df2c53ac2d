"""Offset reads of safetensors rank files for :mod:`tensorferry.dcp` (no torch needed here).

A file's index comes from the native header reader (validated as ``load`` validates it); a
request (offsets and lengths in a stored tensor) becomes the byte runs that hold it, which
the native run reader reads straight into destination buffers, the GIL released, counting
every byte in a :class:`ReadStats`.
"""

import ctypes
import dataclasses

from . import _native
from ._errors import FormatError, TensorferryTypeError

#: The name of a DCP checkpoint's metadata file.
METADATA_FILE = ".metadata"

#: Bytes per element of each safetensors dtype.
ITEM_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "C64": 8,
    "U64": 8, "I64": 8, "F64": 8,
}
#: The name in torch of each dtype's code.
TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "U16": "uint16", "I16": "int16", "F16": "float16", "BF16": "bfloat16", "U32": "uint32", "I32": "int32",
    "F32": "float32", "C64": "complex64", "U64": "uint64", "I64": "int64", "F64": "float64",
}


@dataclasses.dataclass(frozen=True)
class StorageInfo:
    """Where one saved item lies: the rank file (relative to the checkpoint folder) and
    the tensor's name in it. DCP keeps one per item in ``Metadata.storage_data``."""

    file: str
    name: str


# Checkpoints name it where users import it from: a pickle holds "tensorferry.dcp".
StorageInfo.__module__ = __name__.rpartition(".")[0] + ".dcp"


def byte_view(tensor):
    """A writable memoryview of a contiguous CPU tensor's bytes."""
    import torch

    flat = tensor.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


@dataclasses.dataclass
class ReadStats:
    """Bytes a reader fetched from its files, since its last ``reset``.

    ``needed``: the bytes of the chunks the plans asked for (the sum of each requested
    chunk's size); ``data``: the bytes of tensor data actually read; ``header``: the bytes
    of safetensors headers read (8 + the JSON's length, once per file and load);
    ``files``: the files opened.
    """

    needed: int = 0
    data: int = 0
    header: int = 0
    files: int = 0

    @property
    def total(self):
        """Every byte read: tensor data and headers."""
        return self.data + self.header


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype string, shape, and its first and end byte
    in the file (absolute offsets)."""

    dtype: str
    shape: tuple
    begin: int
    end: int


class RemoteObject:
    """What :func:`open_read` gives for an object-storage URL in place of a descriptor:
    the URL, and the ETag its header was read at (every later read must find that version
    of the object, else an error saying it was replaced); ``pinned``, where a reader keeps
    it, ``(etag, size, header as stored)``: what a native load of that version takes
    (``_native.load(pinned=)``) so as to ask for no header again."""

    def __init__(self, url):
        self.url = url
        self.etag = None
        self.pinned = None


def open_read(path):
    """The file at ``path`` open for reads of its byte runs (a native ``RunFile``), refused
    at once (an OSError whose ``filename`` is the path) unless it is a regular file: a
    folder, a FIFO (never waited on), a file of /proc or /sys. For an object-storage URL
    (``s3://…``), a :class:`RemoteObject` read with ranged GETs; :func:`close` either."""
    if _native.is_url(path):
        return RemoteObject(path)
    return _native.RunFile(path)


def close(fd):
    """Closes what :func:`open_read` opened."""
    if not isinstance(fd, RemoteObject):
        fd.close()


def read_small_file(path, limit):
    """The bytes of the regular file ``path`` (see :func:`open_read`), or of the object at
    that URL; one of more than ``limit`` bytes is a FormatError naming it, read no
    further."""
    fd = open_read(path)
    try:
        if isinstance(fd, RemoteObject):
            size, fd.etag = _native.object_head(path)
        else:
            size = fd.size
        if size > limit:
            raise _fail(path, f"{size} bytes, more than the {limit} bytes this file may hold")
        data = bytearray(size)
        read_pieces(fd, path, [(0, memoryview(data))], 1)
        return bytes(data)
    finally:
        close(fd)


def _fail(path, what):
    return FormatError(f"{path}: {what}")


def read_header(fd, path, stats=None, *, save_id):
    """``{name: Entry}`` of the safetensors file at ``path`` (open as ``fd`` for the reads
    that follow), from its header (see :func:`header`).

    The file must be a rank file of the DCP save ``save_id``: one whose metadata names
    another save (its ``DCP_SAVE_ID``) is a FormatError naming it. A file that names none
    was written before rank files carried it, and is taken as it is."""
    entries, metadata = header(fd, path, stats)
    found = metadata.get("DCP_SAVE_ID")
    if found is not None and found != save_id:
        raise _fail(path, f"a rank file of the save {found}, not of this checkpoint's save {save_id} "
                          f"(a file of another save?)")
    return entries


def header(fd, path, stats=None):
    """``({name: Entry}, metadata)`` of the safetensors file at ``path``, its header read
    once from ``fd`` (the file or the object version whose data is read next) and validated
    by tensorferry's reader — a known dtype, a shape whose size matches its byte range,
    ranges inside the file; a malformed file is a FormatError naming it. Counts the
    header's bytes in ``stats``."""
    if isinstance(fd, RemoteObject):
        start, items, fd.etag, _, metadata, _ = _native.object_read_header(path)
    else:
        start, items, metadata = fd.read_header()
    return entries_of(items, start, stats), metadata


def entries_of(items, start, stats=None):
    """``{name: Entry}`` of a header's ``items`` (as the native readers give them), whose
    ``start`` bytes ``stats`` counts as one file's header."""
    if stats is not None:
        stats.header += start
        stats.files += 1
    return {name: Entry(code, tuple(shape), begin, end) for name, code, shape, begin, end in items}


def byte_runs(shape, item_size, offsets, lengths):
    """The contiguous byte runs ``[(start, nbytes)]`` (relative to the tensor's first byte)
    that hold the block ``offsets``/``lengths`` of a C-ordered tensor of ``shape``, in C
    order: laid end to end, they are the block as a contiguous tensor."""
    if not shape:
        return [(0, item_size)]
    if any(n == 0 for n in lengths):
        return []
    strides, step = [0] * len(shape), item_size
    for d in reversed(range(len(shape))):
        strides[d], step = step, step * shape[d]
    # The innermost dims taken whole merge into the run of the last dim cut.
    k = len(shape) - 1
    while k > 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    run = lengths[k] * strides[k]
    starts = [offsets[k] * strides[k]]
    for d in reversed(range(k)):
        starts = [i * strides[d] + s for i in range(offsets[d], offsets[d] + lengths[d]) for s in starts]
    return [(s, run) for s in starts]


#: Reads are cut into pieces of at most this many bytes, so that one large tensor is read
#: by several reads at once (ranged GETs of an object; the native file reader cuts its own).
PIECE_BYTES = 4 << 20


def pieces(entry, runs, dest):
    """``[(file offset, destination view)]`` for reading ``runs`` of ``entry`` end to end
    into ``dest`` (a writable byte memoryview of exactly their total size), no piece
    larger than :data:`PIECE_BYTES`."""
    out, pos = [], 0
    for start, n in runs:
        at = entry.begin + start
        while n:
            k = min(n, PIECE_BYTES)
            out.append((at, dest[pos : pos + k]))
            at, pos, n = at + k, pos + k, n - k
    if pos != len(dest):
        raise FormatError(f"{pos} bytes planned for a destination of {len(dest)}")
    return out


def read_pieces(fd, path, todo, workers, stats=None):
    """Reads every ``(file offset, view)`` of ``todo`` from ``fd`` natively, the GIL
    released: a local file with up to ``workers`` positioned reads at once (a file that
    ends first is a FormatError naming it), an object with parallel ranged GETs, each
    checked against the version its header was read at."""
    held, spans = exported_spans(todo)
    try:
        if isinstance(fd, RemoteObject):
            _native.object_read_into(fd.url, spans, fd.etag)
        else:
            fd.read_into(spans, max(1, workers))
    finally:
        del held
    if stats is not None:
        stats.data += sum(len(view) for _, view in todo)


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


def read_runs(fd, path, entry, runs, dest, stats=None):
    """Reads ``runs`` of ``entry`` end to end into ``dest`` (a writable byte memoryview of
    exactly their total size) on this thread, counting the bytes in ``stats``."""
    read_pieces(fd, path, pieces(entry, runs, dest), 1, stats)
