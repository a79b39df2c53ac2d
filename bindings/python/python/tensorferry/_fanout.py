"""Loading one checkpoint onto every rank of a ``torch.distributed`` process group, each byte
read from storage once, and tensor-parallel shards read as slices.

The tensors are divided among the ranks on tensor boundaries, in file order, balanced by
bytes; each rank reads its part (positioned reads, ``O_DIRECT`` with ``direct=True``, ranged
GETs of ETag-pinned objects for object storage) and broadcasts it, so every rank ends with
the whole dictionary. Names that ``shard=`` matches are not exchanged: each rank reads only
its slice's byte runs. The structure is the one :func:`tensorferry.load` builds, from a
mapped load whose tensor pages are never touched.

Failures are agreed before any exchange (``all_gather_object`` after planning and after
reading): every rank raises the same error, naming the first failing rank, so no rank waits
on a broadcast its peers will never join.

``TENSORFERRY_FANOUT_READ_MBPS=200`` throttles each process's reads to 200 MB/s, for
benchmarks; with ``TENSORFERRY_FANOUT_READ_LINK=<file>`` the rate is shared by every process
naming that file (one storage link).
"""

import builtins
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Optional

from . import _dcp_io
from . import _devices
from . import _errors
from . import _frameworks as fw
from . import _native
from . import _select
from ._errors import FormatError, ProcessGroupError, TensorferryKeyError, TensorferryTypeError, io_error
from ._tree import dotted

#: Each tensor starts at a multiple of this many bytes in a rank's part.
ALIGN = 64
#: The environment variable that throttles reads (MB/s per process); for benchmarks and tests.
READ_MBPS_ENV = "TENSORFERRY_FANOUT_READ_MBPS"
#: The environment variable naming a file that makes the throttle's rate shared by all
#: processes naming it.
READ_LINK_ENV = "TENSORFERRY_FANOUT_READ_LINK"
#: Threads reading one file at once (page-cache copies run side by side).
READ_WORKERS = min(4, os.cpu_count() or 1)

_SAVE_ID_KEY = "tensorferry.save"
_FLOAT_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}


@dataclass
class _Item:
    """One tensor the load returns: where it lies in which file, and what the rank does
    with it (``split``: ``(dim, parts)`` for a slice; else ``owner``, the rank that reads
    it, and ``offset``, where it starts in the owner's part)."""

    path: tuple
    name: str
    file: str
    code: str
    shape: tuple
    begin: int
    end: int
    wire: str
    split: Optional[tuple] = None
    owner: int = 0
    offset: int = 0

    @property
    def nbytes(self):
        return self.end - self.begin

    @property
    def wire_nbytes(self):
        return self.nbytes // _dcp_io.ITEM_SIZE[self.code] * _dcp_io.ITEM_SIZE[self.wire]


@dataclass
class _Plan:
    skeleton: object  # the tree tensorferry.load builds, tensors still mapped
    leaves: list  # [(path, leaf)] of the skeleton
    items: list  # _Item per leaf, in the leaves' order
    sizes: list  # bytes of each rank's part, as sent
    fds: dict  # file -> descriptor
    identities: dict  # file -> (st_dev, st_ino) when opened
    digest: str  # what every rank must agree on


def load(path, *, process_group, shard, read_stats, device, like, keys, dtype, out, direct, mmap, staging, local_load,
         to_device):
    """:func:`tensorferry.load` on every rank of ``process_group``; see its docstring.
    ``mmap`` and ``staging`` have no effect (parts are read into fresh memory).
    ``local_load`` and ``to_device`` are :func:`tensorferry.load` and
    :func:`tensorferry.to_device`, which the fan-out sits on: the structure as a load
    builds it, the error it gives, and the moves of the parts onto their device."""
    del mmap, staging
    if process_group is None:
        raise FormatError("shard= and read_stats= load through a process group: pass process_group=")
    import torch.distributed as dist

    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    if rank < 0:
        raise FormatError("this process is not a member of process_group")
    where = f"tensorferry.load({os.fspath(path)!r})"
    stats = read_stats if read_stats is not None else _dcp_io.ReadStats()
    agree = _Agreement(dist, process_group, rank, world, where)
    plan, error = None, None
    try:
        target = _devices.name_of(device)
        if target != "cpu":
            _native.ensure_device(target)
        plan = _plan(os.fspath(path), rank, world, like, keys, dtype, shard, stats, local_load)
    except Exception as e:  # every rank learns it below
        error = e
    try:
        agreed = agree.status(error, plan.digest if plan else None, "the plan")
        odd = [r for r, (digest, _) in enumerate(agreed) if digest != agreed[0][0]]
        if odd:
            raise FormatError(
                f"{agreed[0][1]} on rank 0 of {world}: rank{'s' if len(odd) > 1 else ''} "
                f"{', '.join(map(str, odd))} ({agreed[odd[0]][1]}) see{'' if len(odd) > 1 else 's'} another "
                "checkpoint (tensor names, shapes, "
                "offsets or save differ): every rank must load the same checkpoint"
            )
        try:
            part, slices = _read(plan, rank, stats, direct)
            _check_unchanged(plan.identities)
        except Exception as e:
            error = e
    finally:
        for fd in plan.fds.values() if plan else ():
            _dcp_io.close(fd)
    agree.status(error, None, "reading")
    # A device PyTorch cannot hold (the emulated one): each part goes there as it arrives.
    streamed = out is None and _torch_device(target) != target
    read = [part, slices]
    del part, slices  # held by `read` alone, which the exchange empties
    tree = _exchange_and_build(
        plan, read, target, dist, process_group, agree, dtype if streamed else None, streamed, to_device
    )
    if streamed:
        return tree
    if dtype is not None:
        tree = _select.cast(tree, dtype)
    if out is not None:
        return _select.fill(out, tree)
    return tree


# ---- planning ----------------------------------------------------------------------------


def _plan(path, rank, world, like, keys, dtype, shard, stats, local_load):
    """The plan of the load on this rank (every rank computes the same one but for its
    slices' places); ``local_load`` is :func:`tensorferry.load`."""
    is_index, top = _native.resolve(path)  # as tensorferry.load resolves it
    fds, identities = {}, {}
    try:
        try:
            _open(top, fds, identities)
        except OSError as e:
            local_load(path, like=like, keys=keys)  # raises the error tensorferry.load gives
            raise io_error(e.errno, f"open: {e.strerror}", e.filename) from None
        # The structure as tensorferry.load builds it, from a map whose tensor pages stay
        # untouched (an object's, below, from its headers alone).
        remote = isinstance(fds[top], _dcp_io.RemoteObject)
        skeleton = None if remote else local_load(path, like=like)
        save_id, index = None, None
        headers = {}  # file -> ({name: Entry}, metadata), each header read once
        if is_index:
            file_of, files, save_id, index = _shards(top)
        if remote:
            skeleton = _skeleton_of_objects(top, files if is_index else [top], like, fds, identities, headers,
                                            local_load, index, stats)
        if not is_index and top not in headers:
            headers[top] = _header(top, fds, identities, stats)
        # Each tensor once, under the name a file stores it by (found before keys= may
        # leave that name out): a tied name is in no header.
        name_of = _select.stored_names(skeleton, set(file_of) if is_index else set(headers[top][0]))
        if keys is not None:
            skeleton = _select.select(skeleton, _select.patterns(keys))
        leaves = _select.distinct(_native.collect_tensors(skeleton, fw.kind_of))
        names = [name_of[id(leaf)] for _, leaf in leaves]
        files = [file_of.get(n) for n in names] if is_index else [top] * len(names)
        order = sorted(set(files) - {None})
        for f in order:
            if f not in headers:
                _open(f, fds, identities)
                headers[f] = _header(f, fds, identities, stats)
            if save_id is not None and headers[f][1].get(_SAVE_ID_KEY) != save_id:
                raise _other_save(f, top)
        narrow = _narrowing(dtype)
        items = []
        for (p, leaf), name, f in zip(leaves, names, files):
            e = headers.get(f, ({},))[0].get(name)
            if e is None or tuple(leaf.shape) != e.shape:
                raise FormatError(f"{f or top}: {name!r} is not there as the load found it (changed during the load?)")
            items.append(_Item(p, name, f, e.dtype, e.shape, e.begin, e.end, narrow(e.dtype)))
        if shard is not None:
            _assign_splits(items, shard, world, path, keys)
        file_rank = {f: i for i, f in enumerate(order)}
        sizes = _assign_owners([it for it in items if it.split is None], world, file_rank)
        digest = hashlib.sha256(
            json.dumps(
                [world, save_id, sizes]
                + [[it.name, os.path.basename(it.file), it.code, it.shape, it.begin, it.end, it.wire, it.split,
                    it.owner] for it in items],
            ).encode()
        ).hexdigest()
    except BaseException:
        for fd in fds.values():
            _dcp_io.close(fd)
        raise
    return _Plan(skeleton, leaves, items, sizes, fds, identities, digest)


# A checkpoint's file is a local file (a native ``RunFile``, its identity ``(st_dev, st_ino)``) or an
# object in object storage (a :class:`_dcp_io.RemoteObject`, its identity the ETag of the
# version its header was read at); the reads below take either.


def _open(path, fds, identities):
    if path not in fds:
        fd = _dcp_io.open_read(path)
        fds[path] = fd
        if not isinstance(fd, _dcp_io.RemoteObject):
            identities[path] = fd.identity or _identity(path)  # None: a platform without inodes


def _header(path, fds, identities, stats):
    """``({name: Entry}, metadata)`` of the file open in ``fds``; an object's version is
    pinned from here on."""
    fd = fds[path]
    entries, metadata = _dcp_io.header(fd, path, stats)
    if isinstance(fd, _dcp_io.RemoteObject):
        if identities.setdefault(path, fd.etag) != fd.etag:
            raise _replaced(path)
        fd.etag = identities[path]
    return entries, metadata


def _replaced(path):
    return FormatError(f"{path}: the file was replaced during the load (a save ran meanwhile?): load again")


def _identity(path):
    """What :func:`_open` recorded for ``path``, as it is now (None: gone)."""
    try:
        if _native.is_url(path):
            return _native.object_head(path)[1]
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _skeleton_of_objects(top, files, like, fds, identities, headers, local_load, index=None, stats=None):
    """The tree :func:`tensorferry.load` gives for the checkpoint whose index (its bytes:
    ``index``) or one object is ``top`` (``files``: its objects), its tensors not read: a
    mapped load of a local stand-in holding the index and the objects' headers alone (sparse
    files of the objects' sizes, never read past their headers). Each object's header is
    read once, its version pinned here, and ``headers[url]`` given ``({name: Entry},
    metadata)``; ``stats`` counts the headers' bytes. ``local_load`` is :func:`tensorferry.load`."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="tensorferry-fanout-")
    try:
        if files != [top]:
            with open(os.path.join(folder, os.path.basename(top)), "wb") as f:
                f.write(index)
        for url in files:
            _open(url, fds, identities)
            start, items, etag, size, metadata, head = _native.object_read_header(url)
            identities[url] = fds[url].etag = etag  # the version every later read must find
            fds[url].pinned = etag, size, head
            headers[url] = _dcp_io.entries_of(items, start, stats), metadata
            with open(os.path.join(folder, os.path.basename(url)), "wb") as f:
                f.write(head)
                f.truncate(size)
        return local_load(os.path.join(folder, os.path.basename(top)), like=like)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the maps stay valid


def _shards(top):
    """``(file_of, files, save id or None, index bytes)`` of the index ``top`` (a file or
    an object), checked natively as every load checks an index: each tensor name's shard,
    as a path beside the index, and the shards in order."""
    data = _dcp_io.read_small_file(top, _native.MAX_INDEX_BYTES)
    weight_map, save_id = _native.parse_index(data, top)
    folder = os.path.dirname(top)
    file_of = {name: os.path.join(folder, f) for name, f in weight_map.items()}
    return file_of, sorted(set(file_of.values())), save_id, data


def _other_save(shard, top):
    return FormatError(f"{shard}: the shard was written by another save than its index {top!r}")


def _narrowing(dtype):
    """``code -> code`` sent for a tensor of that dtype: ``dtype=`` when it is a floating
    dtype narrower than the file's (cast before the exchange), else the file's."""
    if dtype is None:
        return lambda code: code
    to = _FLOAT_CODES[_select._dtype_name(dtype)]
    size = _dcp_io.ITEM_SIZE[to]
    return lambda code: to if code in _FLOAT_CODES.values() and _dcp_io.ITEM_SIZE[code] > size else code


def _assign_splits(items, shard, world, path, keys):
    """Marks each item that a pattern of ``shard`` matches with its ``(dim, parts)``."""
    if not isinstance(shard, dict):
        raise TensorferryTypeError(f"shard must be a dict of name or pattern -> dim (or (dim, parts)), not {type(shard).__name__}")
    specs = []
    for key, value in shard.items():
        if isinstance(value, tuple) and len(value) == 2:
            dim, parts = value
        else:
            dim, parts = value, world
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (dim, parts)):
            raise TensorferryTypeError(f"shard[{key!r}] must be a dim (int) or (dim, parts), not {value!r}")
        if parts < 1 or world % parts:
            raise FormatError(f"shard[{key!r}] = {value!r}: {parts} parts do not divide the {world} ranks")
        specs.append((_select.patterns(key)[0], dim, parts, key))
    used = set()
    for it in items:
        hits = [s for s in specs if _select._matches(it.name, s[0])]
        if not hits:
            continue
        used.update(s[3] for s in hits)
        ndim = len(it.shape)
        ways = {((d + ndim) if d < 0 else d, parts) for _, d, parts, _ in hits}
        if len(ways) > 1:
            raise FormatError(f"{it.name!r} is matched by shard= patterns {[s[3] for s in hits]} that split it differently")
        ((dim, parts),) = ways
        if not 0 <= dim < ndim:
            raise FormatError(f"{it.file}: cannot split {it.name!r} of shape {it.shape} along dim {hits[0][1]}")
        if it.shape[dim] % parts:
            raise FormatError(
                f"{it.file}: {it.name!r} of shape {it.shape} does not split evenly into {parts} parts along dim "
                f"{dim} ({it.shape[dim]} is not a multiple of {parts}); uneven splits are refused"
            )
        it.split = (dim, parts)
    missing = [k for k in shard if k not in used]
    if missing:
        among = " among those keys= selects" if keys is not None else ""
        raise TensorferryKeyError(f"shard= names {missing}: no tensor of {path!r}{among} matches")


def _assign_owners(items, world, file_rank):
    """Gives each replicated item an owner and its offset in the owner's part; returns
    each part's size. In file order, an item goes to the rank whose share of the bytes its
    midpoint falls in: parts are contiguous, each within one tensor's size of total/world."""
    items = sorted(items, key=lambda it: (file_rank[it.file], it.begin))
    total = sum(it.nbytes for it in items)
    sizes, done = [0] * world, 0
    for it in items:
        it.owner = min(world - 1, (2 * done + it.nbytes) * world // (2 * total)) if total else 0
        done += it.nbytes
        it.offset = sizes[it.owner]
        sizes[it.owner] = _aligned(it.offset + it.wire_nbytes)
    return sizes


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


def slice_runs(shape, item_size, dim, parts, part):
    """``(runs, slice shape)``: the fewest contiguous byte runs ``[(start, nbytes)]``
    (relative to the tensor's first byte, in C order) holding part ``part`` of ``parts``
    equal parts of a C-ordered tensor of ``shape`` split along ``dim``."""
    size = shape[dim] // parts
    offsets = [0] * len(shape)
    offsets[dim] = part * size
    lengths = list(shape)
    lengths[dim] = size
    runs = []
    for start, n in _dcp_io.byte_runs(shape, item_size, offsets, lengths):
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((start, n))
    return runs, tuple(lengths)


# ---- reading -----------------------------------------------------------------------------


def _read(plan, rank, stats, direct=False):
    """``(part, {index of item: slice})``: this rank's part as sent (a uint8 tensor) and
    the tensors of its slices, read from the files (with ``O_DIRECT`` when ``direct``)."""
    import torch

    throttle = _Throttle()
    mine = sorted((it for it in plan.items if it.split is None and it.owner == rank), key=lambda it: it.offset)
    # Read in the file's dtype at the same offsets as sent unless dtype= narrows some.
    narrowed = any(it.wire != it.code for it in mine)
    raw_at, size = [], 0
    for it in mine:
        raw_at.append(size)
        size = _aligned(size + it.nbytes)
    # What to read, per file: [(file offset, bytes, destination, offset in it)], where a
    # destination is None (the raw part) or the index of a sliced item.
    runs = {}
    for it, at in zip(mine, raw_at):
        runs.setdefault(it.file, []).append((it.begin, it.nbytes, None, at))
        stats.needed += it.nbytes
    shapes = {}
    for i, it in enumerate(plan.items):
        if it.split is None:
            continue
        dim, parts = it.split
        cuts, shapes[i] = slice_runs(it.shape, _dcp_io.ITEM_SIZE[it.code], dim, parts, rank % parts)
        pos = 0
        for start, n in cuts:
            runs.setdefault(it.file, []).append((it.begin + start, n, i, pos))
            pos += n
        stats.needed += pos
    reader = _read_direct if direct and not any(map(_native.is_url, runs)) else _read_cached
    raw, bufs = reader(plan, runs, size, throttle, stats)
    slices = {}
    for i, shape in shapes.items():
        it = plan.items[i]
        t = bufs.get(i, raw[:0]).view(_torch_dtype(it.code)).reshape(shape)
        slices[i] = t.to(_torch_dtype(it.wire)) if it.wire != it.code else t
    if not narrowed:
        return raw, slices
    part = torch.empty(plan.sizes[rank], dtype=torch.uint8)
    for it, at in zip(mine, raw_at):
        src = raw[at : at + it.nbytes].view(_torch_dtype(it.code))
        part[it.offset : it.offset + it.wire_nbytes].view(_torch_dtype(it.wire)).copy_(src)
    return part, slices


def _slice_sizes(runs):
    sizes = {}
    for file_runs in runs.values():
        for _, n, dest, _ in file_runs:
            if dest is not None:
                sizes[dest] = sizes.get(dest, 0) + n
    return sizes


def _read_cached(plan, runs, size, throttle, stats):
    """``(raw part, {item index: slice bytes})`` read through the page cache, with
    positioned reads on several threads."""
    import torch

    raw = torch.empty(size, dtype=torch.uint8)
    bufs = {i: torch.empty(n, dtype=torch.uint8) for i, n in _slice_sizes(runs).items()}
    views = {None: memoryview(raw.numpy())}
    views.update((i, memoryview(b.numpy())) for i, b in bufs.items())
    for f in sorted(runs):
        todo = []
        for at, n, dest, to in runs[f]:
            todo.extend(_dcp_io.pieces(_dcp_io.Entry("U8", (n,), at, at + n), [(0, n)], views[dest][to : to + n]))
        throttle.read(plan.fds[f], f, sorted(todo, key=lambda p: p[0]), stats)
    return raw, bufs


def _read_direct(plan, runs, size, throttle, stats):
    """As :func:`_read_cached`, with ``O_DIRECT`` (the native reader): per file, one call
    reads its runs into fresh buffers, the raw part's among them when one file holds it
    all (else its pieces are copied into place). A filesystem that refuses ``O_DIRECT``
    is read through the page cache, with a ``RuntimeWarning`` saying why, as
    ``tf.load(direct=True)`` does."""
    import torch

    files_of_raw = [f for f in runs if any(dest is None for _, _, dest, _ in runs[f])]
    raw = None if len(files_of_raw) == 1 else torch.empty(size, dtype=torch.uint8)
    bufs = {}
    for f in sorted(runs):
        mine = [r for r in runs[f] if r[2] is None]
        lo = 0 if raw is None else min((to for _, _, _, to in mine), default=0)
        hi = size if raw is None else max((to + n for _, n, _, to in mine), default=0)
        dests = ([None] if mine else []) + sorted({dest for _, _, dest, _ in runs[f] if dest is not None})
        index = {dest: k for k, dest in enumerate(dests)}
        sizes = [hi - lo if dest is None else 0 for dest in dests]
        native_runs = []
        for at, n, dest, to in runs[f]:
            k = index[dest]
            if dest is not None:
                sizes[k] += n
            native_runs.append((at, n, k, to - lo if dest is None else to))
        throttle.wait(sum(n for _, n, _, _ in native_runs))
        got, read, fallback = _native.read_runs(f, sizes, native_runs)
        stats.data += read
        if fallback is not None:
            warnings.warn(f"tensorferry.load(direct=True): {fallback}", RuntimeWarning, stacklevel=5)
        for dest, t in zip(dests, got):
            t = torch.from_dlpack(t)
            if dest is not None:
                bufs[dest] = t
            elif raw is None:
                raw = t
            else:
                raw[lo:hi].copy_(t)
    if raw is None:
        raw = torch.empty(size, dtype=torch.uint8)
    return raw, bufs


class _Throttle:
    """Lets bytes through at most :data:`READ_MBPS_ENV` MB/s when it is set (a stand-in for
    storage slower than the page cache): each batch of bytes takes a turn on a link of that
    rate, this process's own or, with :data:`READ_LINK_ENV`, one shared by every process
    naming the same file (which holds the time the link is busy until, under ``flock``)."""

    BATCH = 8 << 20

    def __init__(self):
        text = os.environ.get(READ_MBPS_ENV, "").strip()
        try:
            self.rate = float(text) * 1e6 if text else None
        except ValueError:
            raise FormatError(f"{READ_MBPS_ENV}={text!r}: expected a rate in MB/s, such as 200") from None
        self.link = os.environ.get(READ_LINK_ENV) or None
        self.busy_until = 0.0

    def read(self, fd, path, todo, stats):
        if not self.rate:
            _dcp_io.read_pieces(fd, path, todo, READ_WORKERS, stats)
            return
        batch, size = [], 0
        for piece in todo + [None]:
            if piece is not None:
                batch.append(piece)
                size += len(piece[1])
            if batch and (piece is None or size >= self.BATCH):
                self.wait(size)
                _dcp_io.read_pieces(fd, path, batch, READ_WORKERS, stats)
                batch, size = [], 0

    def wait(self, nbytes):
        """Returns once ``nbytes`` have passed the link, in turns of :attr:`BATCH` bytes."""
        while self.rate and nbytes > 0:
            n = min(nbytes, self.BATCH)
            nbytes -= n
            end = self._take_turn(n / self.rate)
            time.sleep(max(0.0, end - time.time()))

    def _take_turn(self, seconds):
        """The time at which a turn of ``seconds`` on the link, queued now, ends."""
        if self.link is None:
            self.busy_until = max(time.time(), self.busy_until) + seconds
            return self.busy_until
        import fcntl

        fd = os.open(self.link, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                busy_until = float(os.pread(fd, 64, 0) or b"0")
            except ValueError:
                busy_until = 0.0
            end = max(time.time(), busy_until) + seconds
            data = f"{end:.6f}".encode().ljust(32)
            os.pwrite(fd, data, 0)
            return end
        finally:
            os.close(fd)  # releases the lock


def _check_unchanged(identities):
    """Every file still has the identity ``identities`` recorded for it (the path it was
    opened by; an object's ETag): a save that replaced one during the load would have mixed
    two checkpoints."""
    for f, ident in identities.items():
        if _identity(f) != ident:
            raise _replaced(f)


# ---- exchange and results ------------------------------------------------------------------


def _torch_dtype(code):
    import torch

    return getattr(torch, _dcp_io.TORCH_NAMES[code])


def _torch_device(target):
    """Where the results are built: the target when PyTorch can hold it, else the host."""
    return target if target == "cpu" or target.startswith("cuda") else "cpu"


def _exchange_device(backend, target):
    """Where the parts travel: on the GPU when the group has a GPU backend (NCCL) and the
    target is a GPU, or when it has no host backend (gloo, MPI); else on the host."""
    import torch

    backend = str(backend).lower()
    on_gpu = "nccl" in backend
    if on_gpu and (target.startswith("cuda") or not ("gloo" in backend or "mpi" in backend)):
        return target if target.startswith("cuda") else f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _view(part, it):
    """Item ``it`` in the part it came in (``None``: a part of no bytes)."""
    import torch

    if part is None:
        return torch.empty(it.shape, dtype=_torch_dtype(it.wire))
    return part[it.offset : it.offset + it.wire_nbytes].view(_torch_dtype(it.wire)).reshape(it.shape)


def _moved(plan, indices, tensors, target, dtype, to_device):
    """``{item index: tensor on target}``: host ``tensors`` (items ``indices``) cast to
    ``dtype`` and moved to ``target`` (one move for all, through the staging ring)."""
    if not indices:
        return {}
    if dtype is not None:
        tensors = _select.cast(tensors, dtype)
    moved = to_device({str(i): t for i, t in zip(indices, tensors)}, target)
    return {i: moved[str(i)] for i in indices}


def _exchange_and_build(plan, read, target, dist, pg, agree, dtype, streamed, to_device):
    """Broadcasts every rank's part from its owner and builds the tree: the skeleton with
    each tensor leaf replaced by a tensor of the framework ``tensorferry.load`` gives it.
    ``read`` is ``[part, slices]`` (emptied here: the part is freed once sent or moved).

    With ``streamed`` (a target PyTorch cannot hold), each part's tensors are cast to
    ``dtype`` and moved to the target as soon as the part arrives, so the host holds this
    rank's part and one part in flight, never the whole dictionary."""
    import torch

    part, slices = read
    read.clear()
    built = _torch_device(target)
    sending = _exchange_device(dist.get_backend(pg), target)
    parts = [None] * agree.world
    moved = {}
    for owner, size in enumerate(plan.sizes):
        buf = None
        if size:
            buf = part.to(sending) if owner == agree.rank else torch.empty(size, dtype=torch.uint8, device=sending)
            if agree.world > 1:
                agree.run(lambda: dist.broadcast(buf, src=dist.get_global_rank(pg, owner), group=pg), "the exchange")
        if owner == agree.rank:
            part = None
        if streamed:
            mine = [i for i, it in enumerate(plan.items) if it.split is None and it.owner == owner]
            moved.update(_moved(plan, mine, [_view(buf, plan.items[i]) for i in mine], target, dtype, to_device))
        elif buf is not None:
            parts[owner] = buf.to(built)
        del buf
    if streamed:
        moved.update(_moved(plan, list(slices), list(slices.values()), target, dtype, to_device))
        results = [moved[i] for i in range(len(plan.items))]
        return _native.rebuild(plan.skeleton, {id(leaf): r for (_, leaf), r in zip(plan.leaves, results)})
    tensors = []
    for i, it in enumerate(plan.items):
        if it.split is not None:
            t = slices[i].to(built)
        else:
            t = _view(parts[it.owner], it).to(built)
        tensors.append(t)
    # Each result owns its own storage (as tensorferry.load's do: safetensors refuses to
    # save tensors that share one), viewing the part it came in.
    kinds = [fw.kind_of(leaf) for _, leaf in plan.leaves]
    if built != "cpu":
        kinds = [fw.NATIVE if k == fw.NUMPY else k for k in kinds]
    results = [torch.from_dlpack(t) if k == fw.TORCH else None for t, k in zip(tensors, kinds)]
    others = [i for i, k in enumerate(kinds) if k != fw.TORCH]
    if others:
        paths = [plan.leaves[i][0] for i in others]
        natives = fw.to_native_many([tensors[i] for i in others], [fw.TORCH] * len(others), paths)
        for i, r in zip(others, fw.from_native_many(natives, [kinds[i] for i in others], paths)):
            results[i] = r
    return _native.rebuild(plan.skeleton, {id(leaf): r for (_, leaf), r in zip(plan.leaves, results)})


# ---- agreement -----------------------------------------------------------------------------


class _Agreement:
    """The collectives every rank joins, and errors that every rank raises alike."""

    def __init__(self, dist, pg, rank, world, where):
        self.dist, self.pg, self.rank, self.world, self.where = dist, pg, rank, world, where

    def run(self, collective, phase):
        try:
            return collective()
        except Exception as e:
            raise ProcessGroupError(
                f"{self.where} on rank {self.rank} of {self.world}: the process group failed during {phase} "
                f"(a rank died or timed out): {e}"
            ) from e

    def status(self, error, digest, phase):
        """Every rank's ``(digest, what it loads)`` once all ranks report; if any rank
        reports an error, every rank raises the first failing rank's, the same everywhere."""
        mine = (None if error is None else _describe(error), digest, self.where)
        statuses = [mine]
        if self.world > 1:
            statuses = [None] * self.world
            self.run(lambda: self.dist.all_gather_object(statuses, mine, group=self.pg), f"the agreement on {phase}")
        failed = [r for r, (d, _, _) in enumerate(statuses) if d is not None]
        if failed:
            first, rest = failed[0], ", ".join(map(str, failed[1:]))
            others = f" (rank{'s' if len(failed) > 2 else ''} {rest} failed too)" if rest else ""
            description, _, where = statuses[first]
            raised = _rebuilt(description, f"{where} failed on rank {first} of {self.world}", others)
            raise raised from (error if self.rank == first else None)
        return [(d, where) for _, d, where in statuses]


def _describe(e):
    """A picklable description of ``e`` that every rank can raise again as the same class."""
    if isinstance(e, OSError) and (e.errno is not None or isinstance(e, _errors.TensorferryIOError)):
        return ("os", None, e.errno, e.strerror if e.strerror is not None else str(e), e.filename)
    message = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else str(e)
    for cls in type(e).__mro__:
        if getattr(_errors, cls.__name__, None) is cls:
            return ("tensorferry", cls.__name__, None, message, None)
        if getattr(builtins, cls.__name__, None) is cls and issubclass(cls, Exception):
            return ("builtin", cls.__name__, None, message, None)
    return ("tensorferry", "TensorferryError", None, f"{type(e).__name__}: {message}", None)


def _rebuilt(description, prefix, suffix):
    kind, name, errno, message, filename = description
    if kind == "os":
        return io_error(errno, f"{prefix}: {message}{suffix}", filename)
    cls = getattr(_errors if kind == "tensorferry" else builtins, name)
    return cls(f"{prefix}: {message}{suffix}")
