"""Host copies of many small PyTorch tensors and NumPy arrays in bulk, by the core's engine.

``to_host(..., copy=True)`` and ``to_device(..., "cpu", copy=True)`` of a dictionary of
thousands of small PyTorch CPU tensors would otherwise cost one crossing into tensorferry
and one back per leaf (two DLPack capsules, one native tensor each): three times PyTorch's
own ``{k: v.clone()}`` loop. Here the whole list of leaves crosses once
(``_native.copy_small``): the core packs the small host leaves that share a dtype, a shape
and a layout into runs, and hands each run back as one tensor whose rows are the copies,
which the framework splits with one call (``unbind``). Uploads of many small PyTorch
tensors cross the same way: each run moves to the device as one tensor.

Results are copies: they share no memory with the inputs, and writing one never changes
another's values. PyTorch copies keep a dense layout as ``clone`` keeps it (channels-last
stays channels-last); NumPy copies are C-contiguous; every row starts on a 64-byte
boundary. Rows of one run share its memory (at most 1 MiB: what ``torch.save`` of one row
writes), and the runs of one call share buffers of at most :data:`BLOCK_BYTES`: one result
kept alive keeps its buffer alive, as a consolidated tensordict's results keep theirs.
Leaves larger than 64 KiB, leaves alone in their group, and leaves of other kinds
(subclasses, sparse, quantized, not yet resolved negation or conjugation, NumPy arrays
that are not C-contiguous) are left to the engine's ordinary path, which copies them (or
names what it cannot take).
"""

import sys

from . import _native

#: The most bytes one buffer of a call's copies holds (a kept result keeps its buffer).
BLOCK_BYTES = 4 << 20
#: Results keep the engine's alignment: every row starts on a multiple of this.
ALIGN = 64


def copy_many(leaves):
    """A copy of each small PyTorch CPU tensor and NumPy array of ``leaves`` copied in
    bulk, and None in the places of the other leaves (any kind), which are left to the
    caller's ordinary path."""
    out = [None] * len(leaves)
    if len(leaves) < 2:
        return out
    leaves = leaves if type(leaves) is list else list(leaves)
    np = sys.modules.get("numpy")
    if np is not None:
        runs = _native.copy_small(leaves, (np.ndarray,))
        for (_, at, _), rows in zip(runs, _native.to_numpy_many([r[0] for r in runs])):
            for i, j in enumerate(at):
                out[j] = rows[i, ...]  # an array also for 0-d rows (iterating gives scalars)
    for at, rows in _torch_runs(leaves):
        for j, row in zip(at, rows):
            out[j] = row
    return out


def device_stacks(leaves):
    """``[(indices, stack)]``: the small PyTorch CPU tensors of ``leaves`` bound for a
    device, copied in bulk by the core as for :func:`copy_many`, each run a native tensor
    whose rows are their values: a move then crosses into tensorferry once per run, not
    once per tensor. Rows that are not a multiple of :data:`ALIGN` bytes are left out (each
    row keeps the alignment the engine gives each tensor on the device, which some GPU
    kernels require), and so are runs of pinned tensors (their uploads need no staging)."""
    torch = sys.modules.get("torch")
    if torch is None or len(leaves) < 2:
        return []
    leaves = leaves if type(leaves) is list else list(leaves)
    runs = _native.copy_small(leaves, (torch.Tensor, torch.nn.Parameter), torch.utils.dlpack.to_dlpack, ALIGN)
    return [(at, stack) for stack, at, _ in runs if not leaves[at[0]].is_pinned()]


def _torch_runs(leaves):
    """``[(indices, rows)]`` of the PyTorch CPU tensors of ``leaves`` copied in bulk."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    from ._frameworks import _take_capsules

    runs = _native.copy_small(leaves, (torch.Tensor, torch.nn.Parameter), torch.utils.dlpack.to_dlpack)
    if not runs:
        return []
    take = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
    with torch.no_grad():  # views made without autograd's bookkeeping
        stacks = _take_capsules([r[0] for r in runs], take)
        return [(at, stack.unbind(0)) for (_, at, _), stack in zip(runs, stacks)]


def cuda_stacks(leaves):
    """``[(indices, stacked)]``: the small PyTorch CUDA tensors of ``leaves`` that share a
    dtype and a shape, in groups of at least two, each chunk of at most 1 MiB stacked by
    PyTorch on their GPU, on its current stream (``torch.stack``: GPU memory stays
    PyTorch's, in its caching allocator), so that a move to the host crosses into
    tensorferry once per chunk. A GPU out of memory ends the stacking: the rest move one
    by one."""
    torch = sys.modules.get("torch")
    if torch is None or len(leaves) < 2:
        return []
    import operator

    leaves = leaves if type(leaves) is list else list(leaves)
    exact = (torch.Tensor, torch.nn.Parameter)
    key = operator.attrgetter("dtype", "shape", "device")
    chunks = []
    with torch.no_grad():
        for group in _native.group_leaves(leaves, exact, key).values():
            first = leaves[group[0]]
            try:
                if len(group) < 2 or first.layout != torch.strided or first.is_quantized or not first.is_cuda:
                    continue
                item = first.nbytes
            except Exception:
                continue
            if item > 64 << 10:
                continue
            step = max(1, (1 << 20) // max(1, item))
            for part in (group[i : i + step] for i in range(0, len(group), step)):
                if len(part) < 2:
                    continue
                try:
                    chunks.append((part, torch.stack([leaves[j] for j in part])))
                except getattr(torch, "OutOfMemoryError", ()):
                    return chunks
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    continue
    return chunks
