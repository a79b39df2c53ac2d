"""Host copies of many small PyTorch tensors in bulk, in PyTorch's own batch calls.

``to_host(..., copy=True)`` and ``to_device(..., "cpu", copy=True)`` of a dictionary of
thousands of small PyTorch CPU tensors would otherwise cost one crossing into tensorferry
and one back per leaf (two DLPack capsules, one native tensor each): three times PyTorch's
own ``{k: v.clone()}`` loop. Here tensors that share a dtype and a shape are grouped, and
each group of up to :data:`CHUNK_BYTES` is copied by one ``torch.stack`` into one new
buffer, then handed out as its rows (``unbind``): two calls per group instead of several
per leaf. NumPy leaves of a plain native dtype whose rows are whole multiples of 64 bytes
(4 KiB float32 blocks, say) are joined by ``numpy.concatenate`` into one 64-byte-aligned buffer
for all their groups, as the engine would place them, each row 64-byte aligned; other NumPy
leaves keep the engine's path, which pads each tensor to 64 bytes.

Results are copies: they share no memory with the inputs, and writing one never changes
another's values. The results of one chunk do share its buffer, as a consolidated
tensordict's do: one result kept alive keeps its chunk (at most :data:`CHUNK_BYTES`) alive.
Tensors larger than :data:`SMALL_BYTES` and tensors of other types (subclasses, sparse or
quantized tensors) are left to the engine, as are groups PyTorch refuses to stack: whatever it cannot
take, the ordinary path handles (and names).
"""

import sys

#: Leaves up to this many bytes are copied in bulk; larger ones go through the engine, where
#: their bytes, not the crossing, set the time.
SMALL_BYTES = 64 << 10
#: The most bytes one group's buffer holds.
CHUNK_BYTES = 1 << 20


def _chunks(indices, item_bytes):
    """``indices`` cut into runs of at most :data:`CHUNK_BYTES` (at least one leaf each)."""
    step = max(1, CHUNK_BYTES // max(1, item_bytes))
    return [indices[i : i + step] for i in range(0, len(indices), step)]


def _groups(leaves, exact):
    """``{(dtype, shape): [index, …]}`` of the leaves whose type is one of ``exact``, in
    order, in one pass (a leaf whose dtype or shape cannot be read is left out)."""
    groups = {}
    for i, t in enumerate(leaves):
        if type(t) not in exact:
            continue
        try:
            key = (t.dtype, t.shape)
        except Exception:  # a nested tensor, say
            continue
        group = groups.get(key)
        if group is None:
            groups[key] = [i]
        else:
            group.append(i)
    return groups


#: Results keep the engine's alignment: every row starts on a multiple of this.
ALIGN = 64


def _numpy_copy_many(leaves, out, np):
    """Fills ``out`` with copies of the NumPy leaves the bulk path takes: every group of
    one plain native dtype and shape whose rows are a multiple of :data:`ALIGN` bytes and
    at most :data:`SMALL_BYTES`, copied into its slice of one aligned buffer."""
    plain = _plain_numpy_dtypes(np)
    taken = []
    total = 0
    for (dtype, shape), group in _groups(leaves, (np.ndarray,)).items():
        if dtype not in plain or not shape or len(group) < 2:
            continue
        item = dtype.itemsize
        for n in shape:
            item *= n
        if item == 0 or item % ALIGN or item > SMALL_BYTES:
            continue
        taken.append((dtype, shape, group, item))
        total += item * len(group)
    if not taken:
        return
    raw = np.empty(total + ALIGN, np.uint8)
    at = -raw.__array_interface__["data"][0] % ALIGN
    for dtype, shape, group, item in taken:
        end = at + item * len(group)
        dest = raw[at:end].view(dtype).reshape((len(group),) + shape)
        # One concatenate along the first axis fills the rows; numpy.stack would first
        # make a view of each leaf.
        flat = dest.reshape((len(group) * shape[0],) + shape[1:])
        np.concatenate([leaves[j] for j in group], out=flat)
        for j, row in zip(group, dest):
            out[j] = row
        at = end


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
    out_of_memory = getattr(torch, "OutOfMemoryError", ())
    chunks = []
    with torch.no_grad():
        # Device, layout and quantization are checked once per group, on its first leaf: a
        # group that mixes them is refused by torch.stack as a whole, and left to the engine.
        for group in _groups(leaves, exact).values():
            if len(group) < 2:
                continue
            first = leaves[group[0]]
            try:
                if first.layout != strided or first.is_quantized or not (first.is_cuda if cuda else first.is_cpu):
                    continue
                item = first.element_size() * first.numel()
                if device_bound and (item % ALIGN or first.is_pinned()):
                    continue
            except Exception:
                continue
            if item > SMALL_BYTES:
                continue
            for part in _chunks(group, item):
                try:
                    stacked = torch.stack([leaves[j] for j in part])
                except out_of_memory:
                    return chunks
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    continue
                chunks.append((part, stacked))
    return chunks
