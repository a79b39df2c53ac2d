"""Host copies of many small PyTorch tensors and NumPy arrays in bulk, in their own batch calls.

``to_host(..., copy=True)`` and ``to_device(..., "cpu", copy=True)`` of a dictionary of
thousands of small PyTorch CPU tensors would otherwise cost one crossing into tensorferry
and one back per leaf (two DLPack capsules, one native tensor each): three times PyTorch's
own ``{k: v.clone()}`` loop. Here tensors that share a dtype and a shape are grouped, and
each group of up to :data:`CHUNK_BYTES` is copied by one ``torch.stack`` into memory cut
from blocks of a few MiB (see :class:`_Blocks`), then handed out as its rows (``unbind``):
two calls per group instead of several per leaf. Leaves are grouped in one native pass
(``_native.group_leaves``). NumPy leaves of a plain native dtype whose rows are whole
multiples of 64 bytes (4 KiB float32 blocks, say) are joined the same way, chunk by chunk,
by ``numpy.concatenate`` into the same kind of blocks, each row 64-byte aligned as the
engine would place it; other NumPy leaves keep the engine's path, which pads each tensor to
64 bytes.

Results are copies: they share no memory with the inputs, and writing one never changes
another's values. They do share memory blocks, as a consolidated tensordict's results
share their buffer: one result kept alive keeps its block (at most ``_Blocks.BLOCK``) alive.
The rows of one stack are one PyTorch storage of at most :data:`CHUNK_BYTES`, which is what
``torch.save`` of one row writes.
Tensors larger than :data:`SMALL_BYTES` and tensors of other types (subclasses, sparse or
quantized tensors) are left to the engine, as are groups PyTorch refuses to stack: whatever it cannot
take, the ordinary path handles (and names).
"""

import operator
import sys

from ._native import group_leaves

#: Leaves up to this many bytes are copied in bulk; larger ones go through the engine, where
#: their bytes, not the crossing, set the time.
SMALL_BYTES = 64 << 10
#: The most bytes one group's buffer holds.
CHUNK_BYTES = 1 << 20


def _step(item_bytes):
    """How many leaves of ``item_bytes`` one chunk holds (at least one)."""
    return max(1, CHUNK_BYTES // max(1, item_bytes))


def _chunks(indices, item_bytes):
    """``indices`` cut into runs of at most :data:`CHUNK_BYTES` (at least one leaf each)."""
    step = _step(item_bytes)
    return [indices[i : i + step] for i in range(0, len(indices), step)]


def _groups(leaves, exact, key=None):
    """``{key: [index, …]}`` of the leaves whose type is one of ``exact``, in order, in
    one native pass; ``key`` (a leaf's ``(dtype, shape)`` unless given) is read by one C call
    per leaf (a leaf whose key cannot be read is left out)."""
    return group_leaves(leaves if type(leaves) is list else list(leaves), tuple(exact), key or _DTYPE_SHAPE)


_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
# PyTorch's shape getter builds a torch.Size (a quarter of a microsecond a leaf); its byte
# count is read in half the time. Tensors are grouped by it, and a group whose shapes
# differ is split by shape only when torch.stack refuses it.
_DTYPE_NBYTES = operator.attrgetter("dtype", "nbytes")
# CUDA tensors are grouped by GPU too (a stack holds tensors of one device).
_CUDA_KEYS = (operator.attrgetter("dtype", "nbytes", "device"), operator.attrgetter("dtype", "shape", "device"))


#: Results keep the engine's alignment: every row starts on a multiple of this.
ALIGN = 64


def _numpy_copy_many(leaves, out, np):
    """Fills ``out`` with copies of the NumPy leaves the bulk path takes: every group of
    one plain native dtype and shape whose rows are a multiple of :data:`ALIGN` bytes and
    at most :data:`SMALL_BYTES`, copied chunk by chunk (at most :data:`CHUNK_BYTES` each)
    into memory cut from blocks (see :class:`_Blocks`), every row 64-byte aligned."""
    plain = _plain_numpy_dtypes(np)
    taken = []
    for (dtype, shape), group in _groups(leaves, (np.ndarray,)).items():
        if dtype not in plain or not shape or len(group) < 2:
            continue
        item = dtype.itemsize
        for n in shape:
            item *= n
        if item == 0 or item % ALIGN or item > SMALL_BYTES:
            continue
        taken.append((dtype, shape, group, item))
    if not taken:
        return
    blocks = _Blocks(None, sum(item * len(group) for _, _, group, item in taken))
    for dtype, shape, group, item in taken:
        for part in _chunks(group, item):
            raw = blocks.raw(item * len(part))
            if raw is None:  # no memory: the rest keep the engine's path
                return
            dest = raw.view(dtype).reshape((len(part),) + shape)
            # One concatenate along the first axis fills the rows; numpy.stack would
            # first make a view of each leaf.
            flat = dest.reshape((len(part) * shape[0],) + shape[1:])
            np.concatenate([leaves[j] for j in part], out=flat)
            for j, row in zip(part, dest):
                out[j] = row


_PLAIN = None


def _plain_numpy_dtypes(np):
    """The NumPy dtypes the bulk path copies: booleans, integers, floats and complex
    numbers of the machine's byte order that the engine also takes."""
    global _PLAIN
    if _PLAIN is None:
        names = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
        names += ("float16", "float32", "float64", "complex64", "complex128")
        _PLAIN = frozenset(np.dtype(n) for n in names)
    return _PLAIN


def copy_many(leaves):
    """A copy of each small PyTorch CPU tensor and NumPy array of ``leaves`` copied in
    bulk, and None in the places of the other leaves (any kind), which are left to the
    caller's ordinary path."""
    out = [None] * len(leaves)
    if len(leaves) < 2:
        return out
    np = sys.modules.get("numpy")
    if np is not None:
        _numpy_copy_many(leaves, out, np)
    chunks = torch_chunks(leaves)
    if chunks:
        import torch

        with torch.no_grad():  # views made without autograd's bookkeeping
            for part, stacked in chunks:
                for j, row in zip(part, stacked.unbind(0)):
                    out[j] = row
    return out


def torch_chunks(leaves, cuda=False, device_bound=False):
    """``[(indices, stacked)]``: the small PyTorch CPU tensors of ``leaves`` (with
    ``cuda``, the small CUDA ones) that share a dtype and a shape, in groups of at least
    two, each chunk of at most :data:`CHUNK_BYTES` copied by one ``torch.stack`` into one
    new tensor whose rows are their values (on their GPU, on PyTorch's current stream,
    for CUDA tensors). A move then crosses into tensorferry once per chunk, not once per
    tensor. With ``device_bound`` (stacks for a device), pinned tensors are left out (their
    uploads need no staging) and so are rows that are not a multiple of :data:`ALIGN`
    bytes: every row keeps the alignment the engine gives each tensor, which some GPU
    kernels require. A GPU out of memory ends the stacking: the rest move one by one."""
    torch = sys.modules.get("torch")
    if torch is None or len(leaves) < 2:
        return []
    exact = (torch.Tensor, torch.nn.Parameter)
    strided = torch.strided
    with torch.no_grad():
        # Device, layout and quantization are checked once per group, on its first leaf: a
        # group that mixes them is refused by torch.stack as a whole, and left to the engine.
        taken = []
        keys = _CUDA_KEYS if cuda else (_DTYPE_NBYTES, _DTYPE_SHAPE)
        for group in _groups(leaves, exact, keys[0]).values():
            if len(group) < 2:
                continue
            first = leaves[group[0]]
            try:
                if first.layout != strided or first.is_quantized or not (first.is_cuda if cuda else first.is_cpu):
                    continue
                item = first.nbytes
                if device_bound and (item % ALIGN or first.is_pinned()):
                    continue
            except Exception:
                continue
            if item <= SMALL_BYTES:
                taken.append((group, item))
        if not taken:
            return []
        # Stacks in host memory are cut from blocks of a few MiB (see _Blocks); CUDA stacks
        # are PyTorch's own (its caching allocator keeps device memory warm).
        blocks = None if cuda else _Blocks(torch, sum(item * len(g) + ALIGN * -(-len(g) // _step(item)) for g, item in taken))
        chunks = []
        for group, item in taken:
            if not _stack_group(torch, leaves, group, item, (exact, keys[1]), chunks, blocks):
                break
    return chunks


class _Blocks:
    """Host memory for the stacks of one call, cut from blocks of :data:`BLOCK` bytes.

    A stack of its own (``torch.stack``'s output, up to 1 MiB) comes from the C allocator,
    which in many of its states gives such blocks back to the system when they are freed
    and takes fresh ones next time: every 4 KiB page of every result is then a page fault,
    which costs more than copying the page (on a VM, as much as the whole ``{k: v.clone()}``
    loop; that loop's 4 KiB blocks are reused instead). A block is two 2 MiB pages
    (NumPy advises huge pages for it, and it starts on a 2 MiB boundary): one fault per
    2 MiB, whatever the allocator's state. A result kept alive keeps its block alive (at
    most :data:`BLOCK`), as a consolidated tensordict's results keep their buffer. Calls
    whose stacks need less than a block get exactly what they need. Blocks are NumPy
    memory: the rows' storage cannot be resized (as with every tensor tensorferry hands
    to PyTorch), and a row's storage is its stack's bytes."""

    #: Bytes of one block.
    BLOCK = 4 << 20
    #: The huge page size blocks start on.
    HUGE = 2 << 20

    def __init__(self, torch, need):
        import numpy

        self.np, self.torch, self.need = numpy, torch, need  # bytes the stacks should take
        self.block, self.at, self.end, self.undo = None, 0, 0, 0

    def _new(self, nbytes):
        """Starts a new block for a stack of ``nbytes`` (more than one block's worth of
        stacks to come: a whole aligned block; else exactly what is left, or ``nbytes``)."""
        np = self.np
        if self.need >= self.BLOCK >= nbytes:
            size, align = self.BLOCK, self.HUGE
        else:
            size, align = max(self.need, nbytes), ALIGN
        self.block = np.empty(size + align, np.uint8)
        self.at = -self.block.__array_interface__["data"][0] % align
        self.end = self.at + size
        self.need = max(0, self.need - size)

    def raw(self, nbytes):
        """``nbytes`` of new memory (a NumPy ``uint8`` array, 64-byte aligned), or None
        when there is no memory left."""
        if self.np is None:
            return None
        try:
            if self.block is None or self.at + nbytes > self.end:
                self._new(nbytes)
        except MemoryError:
            self.np = None
            return None
        self.undo = self.at
        self.at += nbytes + (-nbytes % ALIGN)
        return self.block[self.undo : self.undo + nbytes]

    def take(self, like, count, item):
        """A new tensor of ``count`` rows of ``like``'s dtype and shape (``item`` bytes
        each), 64-byte aligned, or None when these blocks cannot give it (PyTorch's own
        stack is used then, as it is for rows that are not contiguous, whose memory format
        it keeps)."""
        if self.np is None or not like.is_contiguous():
            return None
        raw = self.raw(item * count)
        if raw is None:
            return None
        try:
            tensor = self.torch.from_numpy(raw)
        except (RuntimeError, TypeError, ValueError):  # no NumPy bridge
            self.np = None
            return None
        return tensor.view(like.dtype).view((count,) + tuple(like.shape))

    def give_back(self):
        """Returns the space of the last :meth:`take` (its stack was refused)."""
        self.at = self.undo


def _stack_group(torch, leaves, group, item, split, chunks, blocks, by_shape=False):
    """Appends to ``chunks`` the stacks of ``group`` (leaves of one dtype and byte count,
    ``item``), each of at most :data:`CHUNK_BYTES`, in ``blocks`` (None: PyTorch's own
    memory); False when a GPU ran out of memory. The first stack refused (shapes that
    differ, devices that differ) splits the rest of the group by shape (``split``: the
    types taken and the key that splits), each part stacked on its own (``by_shape``),
    unless it already was; what is refused then is left to the engine."""
    out_of_memory = getattr(torch, "OutOfMemoryError", ())
    for part in _chunks(group, item):
        members = [leaves[j] for j in part]
        into = None
        try:
            into = None if blocks is None else blocks.take(members[0], len(members), item)
            stacked = torch.stack(members) if into is None else torch.stack(members, out=into)
        except out_of_memory:
            return False
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            if into is not None:
                blocks.give_back()
            if by_shape:
                continue
            rest = group[group.index(part[0]) :]
            for sub in _groups([leaves[j] for j in rest], *split).values():
                if len(sub) > 1 and not _stack_group(
                    torch, leaves, [rest[k] for k in sub], item, split, chunks, blocks, True
                ):
                    return False
            return True
        chunks.append((part, stacked))
    return True
