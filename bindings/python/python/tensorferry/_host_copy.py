"""Host copies of many small PyTorch tensors and NumPy arrays in bulk, made by the core.

``to_host(..., copy=True)`` and ``to_device(..., "cpu", copy=True)`` of a dictionary of
thousands of small PyTorch CPU tensors would otherwise cost one crossing into tensorferry
and one back per leaf (two DLPack capsules, one native tensor each): three times PyTorch's
own ``{k: v.clone()}`` loop. Here leaves that share a dtype and a shape are grouped in one
native pass (``_native.group_leaves``), and the bytes of each group of up to
:data:`CHUNK_BYTES` are copied by the core in one call (``_native.copy_rows``, which reads
each leaf's address with the fewest calls, never through a DLPack capsule) into memory
cut from blocks of a few MiB (see :class:`_Blocks`); the group is then handed out as its
rows (one view, split by ``unbind``). NumPy leaves of a plain native dtype whose rows are
whole multiples of 64 bytes (4 KiB float32 blocks, say) are grouped, copied into the same
blocks and handed out as rows (new arrays of their dtype and shape) all in one native call
(``_native.copy_arrays``), each row 64-byte aligned as the engine would place it; other
NumPy leaves keep the engine's path, which pads each tensor to 64 bytes.

Results are copies: they share no memory with the inputs, and writing one never changes
another's values. They do share memory blocks, as a consolidated tensordict's results
share their buffer: one result kept alive keeps its block (at most ``_Blocks.BLOCK``) alive.
The rows of one group's chunk are one PyTorch storage of at most :data:`CHUNK_BYTES`,
which is what ``torch.save`` of one row writes.
Tensors larger than :data:`SMALL_BYTES`, tensors of other types (subclasses, sparse or
quantized tensors) and tensors whose raw bytes are not their values as they lie
(overlapping, negative or conjugate views, GPU tensors) are left to the engine (dense
tensors in another order of their dimensions, transposed or channels-last, are copied as
they lie and keep their strides, as ``clone`` keeps them): whatever the bulk path cannot take, the ordinary path handles (and names).
Small PyTorch GPU tensors bound for the host are gathered on their GPU by ``torch.stack``
(:func:`torch_chunks` with ``cuda``): a copy on the device, before the engine's.
"""

import operator
import sys

from ._native import copy_arrays, copy_rows, group_leaves

#: Leaves up to this many bytes are copied in bulk; larger ones go through the engine, where
#: their bytes, not the crossing, set the time.
SMALL_BYTES = 64 << 10
#: The most bytes one group's chunk holds.
CHUNK_BYTES = 1 << 20
#: Results keep the engine's alignment: every chunk (and every NumPy row) starts on a
#: multiple of this.
ALIGN = 64


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
# CUDA tensors are grouped by GPU too (a stack holds tensors of one device), and by byte
# count first (PyTorch reads it in half the time of a shape): a group whose shapes differ
# is split by shape only when torch.stack refuses it.
_CUDA_KEYS = (operator.attrgetter("dtype", "nbytes", "device"), operator.attrgetter("dtype", "shape", "device"))


def _copies(leaves, group, item, blocks, conj):
    """``(part, raw, copied)`` for each chunk of ``group`` (leaves of ``item`` bytes): the
    core copied ``part``'s leaves into the rows of ``raw`` (new memory, a NumPy ``uint8``
    array, one row of ``item`` bytes a leaf) where ``copied`` says so (see
    ``_native.copy_rows``). Stops when there is
    no memory left (the rest keep the engine's path)."""
    for part in _chunks(group, item):
        raw = blocks.raw(item * len(part))
        if raw is None:
            return
        yield part, raw, copy_rows([leaves[j] for j in part], raw, item, conj)


def copy_many(leaves, out):
    """Copies in bulk the small NumPy arrays and PyTorch CPU tensors of ``[(path, leaf)]``
    (``leaves``) into ``out``, under their ``id``; returns the other items of ``leaves``,
    in order, left to the caller's ordinary path."""
    if sys.modules.get("numpy") is None or len(leaves) < 2:
        return leaves  # the blocks are NumPy memory
    leaves = copy_arrays(leaves if type(leaves) is list else list(leaves), out, _raw, ALIGN, SMALL_BYTES, CHUNK_BYTES)
    torch = sys.modules.get("torch")
    if torch is None or len(leaves) < 2:
        return leaves
    tensors, before = [leaf for _, leaf in leaves], len(out)
    with torch.no_grad():  # views made without autograd's bookkeeping
        for part, stacked, copied in _torch_copies(torch, tensors, False):
            for j, row, done in zip(part, stacked.unbind(0), copied):
                if done is True:
                    out[id(tensors[j])] = row
                elif done:  # a dense tensor in another order: its strides, as clone keeps them
                    out[id(tensors[j])] = row.as_strided(row.shape, done)
    if len(out) - before == len(leaves):
        return []  # every leaf copied (each under an id of its own)
    return [item for item in leaves if id(item[1]) not in out]


def _raw(need):
    """The memory of one call's NumPy copies (``need`` bytes): chunks cut from blocks."""
    return _Blocks(need).raw


def _torch_copies(torch, leaves, device_bound):
    """``(part, stacked, copied)`` for each chunk of the small PyTorch CPU tensors of
    ``leaves`` that share a dtype and a shape (groups of at least two): ``stacked`` is a
    new tensor whose rows hold the bytes of ``part``'s leaves where ``copied`` says so,
    copied by the core (True: in C order; a tuple: the strides they lie in). With ``device_bound``, pinned tensors are left out and so are rows
    that are not a multiple of :data:`ALIGN` bytes (see :func:`torch_chunks`)."""
    exact = (torch.Tensor, torch.nn.Parameter)
    taken = []
    for (dtype, shape), group in _groups(leaves, exact).items():
        if len(group) < 2:
            continue
        # The group's dtype and device kind are checked on its first leaf (quantized
        # tensors are a dtype of their own); each leaf's layout in copy_rows.
        first = leaves[group[0]]
        try:
            if first.is_quantized or not first.is_cpu:
                continue
            item = first.nbytes
            if device_bound and (item % ALIGN or first.is_pinned()):
                continue
        except Exception:
            continue
        if 0 < item <= SMALL_BYTES:
            taken.append((dtype, tuple(shape), group, item))
    if not taken:
        return
    blocks = _Blocks(sum(item * len(g) + ALIGN * -(-len(g) // _step(item)) for _, _, g, item in taken))
    for dtype, shape, group, item in taken:
        conj = dtype.is_complex
        for part, raw, copied in _copies(leaves, group, item, blocks, conj):
            try:
                whole = torch.from_numpy(raw)
            except (RuntimeError, TypeError, ValueError):  # a PyTorch without NumPy: the engine's path
                return
            yield part, whole.view(dtype).view((len(part),) + shape), copied


def torch_chunks(leaves, cuda=False, device_bound=False):
    """``[(indices, stacked)]``: the small PyTorch CPU tensors of ``leaves`` (with
    ``cuda``, the small CUDA ones) that share a dtype and a shape, in groups of at least
    two, each chunk of at most :data:`CHUNK_BYTES` copied into one new tensor whose rows
    are their values (by the core, for CPU tensors; by one ``torch.stack`` on their GPU,
    on PyTorch's current stream, for CUDA tensors). A move then crosses into tensorferry
    once per chunk, not once per tensor. With ``device_bound`` (stacks for a device),
    pinned tensors are left out (their uploads need no staging) and so are rows that are
    not a multiple of :data:`ALIGN` bytes: every row keeps the alignment the engine gives
    each tensor, which some GPU kernels require; a chunk the core could not copy whole
    moves one by one. A GPU out of memory ends the stacking: the rest move one by one."""
    torch = sys.modules.get("torch")
    if torch is None or len(leaves) < 2:
        return []
    if not cuda:
        if sys.modules.get("numpy") is None:
            return []  # the blocks are NumPy memory
        chunks = _torch_copies(torch, leaves, device_bound)
        return [(part, stacked) for part, stacked, copied in chunks if all(done is True for done in copied)]
    exact = (torch.Tensor, torch.nn.Parameter)
    with torch.no_grad():
        # Layout and quantization are checked once per group, on its first leaf: a group
        # that mixes them is refused by torch.stack as a whole, and left to the engine.
        chunks = []
        for group in _groups(leaves, exact, _CUDA_KEYS[0]).values():
            if len(group) < 2:
                continue
            first = leaves[group[0]]
            try:
                if first.layout != torch.strided or first.is_quantized or not first.is_cuda:
                    continue
                item = first.nbytes
            except Exception:
                continue
            if item <= SMALL_BYTES and not _stack_group(torch, leaves, group, item, (exact, _CUDA_KEYS[1]), chunks):
                break
    return chunks


class _Blocks:
    """Host memory for the copies of one call, cut from blocks of :data:`BLOCK` bytes.

    A buffer of its own per chunk (up to 1 MiB) would come from the C allocator, which in
    many of its states gives such blocks back to the system when they are freed and takes
    fresh ones next time: every 4 KiB page of every result is then a page fault, which
    costs more than copying the page (on a VM, as much as the whole ``{k: v.clone()}``
    loop; that loop's 4 KiB blocks are reused instead). A block is two 2 MiB pages (NumPy
    advises huge pages for it, and it starts on a 2 MiB boundary): one fault per 2 MiB,
    whatever the allocator's state. A result kept alive keeps its block alive (at most
    :data:`BLOCK`), as a consolidated tensordict's results keep their buffer. Calls whose
    copies need less than a block get exactly what they need. Blocks are NumPy memory:
    the rows' storage cannot be resized (as with every tensor tensorferry hands to
    PyTorch), and a PyTorch row's storage is its chunk's bytes."""

    #: Bytes of one block.
    BLOCK = 4 << 20
    #: The huge page size blocks start on.
    HUGE = 2 << 20

    def __init__(self, need):
        import numpy

        self.np, self.need = numpy, need  # bytes the copies should take
        self.block, self.at, self.end = None, 0, 0

    def _new(self, nbytes):
        """Starts a new block for a chunk of ``nbytes`` (more than one block's worth of
        chunks to come: a whole aligned block; else exactly what is left, or ``nbytes``)."""
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
        start = self.at
        self.at += nbytes + (-nbytes % ALIGN)
        return self.block[start : start + nbytes]


def _stack_group(torch, leaves, group, item, split, chunks, by_shape=False):
    """Appends to ``chunks`` the stacks on their GPU of ``group`` (CUDA tensors of one
    dtype, byte count (``item``) and device), each of at most :data:`CHUNK_BYTES`; False
    when the GPU ran out of memory. The first stack refused (shapes that differ) splits
    the rest of the group by shape (``split``: the types taken and the key that splits),
    each part stacked on its own (``by_shape``), unless it already was; what is refused
    then is left to the engine."""
    out_of_memory = getattr(torch, "OutOfMemoryError", ())
    for part in _chunks(group, item):
        try:
            stacked = torch.stack([leaves[j] for j in part])
        except out_of_memory:
            return False
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            if by_shape:
                continue
            rest = group[group.index(part[0]) :]
            for sub in _groups([leaves[j] for j in rest], *split).values():
                if len(sub) > 1 and not _stack_group(torch, leaves, [rest[k] for k in sub], item, split, chunks, True):
                    return False
            return True
        chunks.append((part, stacked))
    return True
