"""Host copies of many small PyTorch tensors in bulk, in PyTorch's own batch calls.

``to_host(..., copy=True)`` and ``to_device(..., "cpu", copy=True)`` of a dictionary of
thousands of small PyTorch CPU tensors would otherwise cost one crossing into tensorferry
and one back per leaf (two DLPack capsules, one native tensor each): three times PyTorch's
own ``{k: v.clone()}`` loop. Here tensors that share a dtype and a shape are grouped, and
each group of up to :data:`CHUNK_BYTES` is copied by one ``torch.stack`` into one new
buffer, then handed out as its rows (``unbind``): two calls per group instead of several
per leaf. (NumPy leaves keep the engine's path: one 64-byte-aligned buffer, which NumPy's
own calls could not give each row.)

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


def _groups(keys):
    """``{key: [index, …]}`` of the leaves with a key (None: not for bulk), in order."""
    groups = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    return groups


def _torch_keys(tensors):
    """The grouping key of each PyTorch tensor — ``(dtype, shape, layout)`` for exact
    ``Tensor``/``Parameter`` leaves in host memory, else None."""
    import torch

    exact = (torch.Tensor, torch.nn.Parameter)
    try:
        return [(t.dtype, t.shape, t.layout) if type(t) in exact and t.is_cpu else None for t in tensors]
    except Exception:
        # A leaf whose shape cannot be read (a nested tensor, say): decide one by one.
        return [_torch_key(t, exact) for t in tensors]


def _torch_key(t, exact):
    try:
        return (t.dtype, t.shape, t.layout) if type(t) in exact and t.is_cpu else None
    except Exception:
        return None


def _copy_torch(tensors, out, at):
    """Puts in ``out[at[j]]`` a copy of each PyTorch CPU tensor ``tensors[j]`` copied in bulk."""
    import torch

    strided = torch.strided
    with torch.no_grad():
        for (dtype, shape, layout), group in _groups(_torch_keys(tensors)).items():
            first = tensors[group[0]]
            if layout != strided or first.is_quantized:
                continue
            item = first.element_size() * first.numel()
            if item > SMALL_BYTES:
                continue
            for part in _chunks(group, item):
                try:
                    rows = torch.stack([tensors[j] for j in part]).unbind(0)
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    continue
                for j, row in zip(part, rows):
                    out[at[j]] = row


def copy_many(leaves, kinds, torch_kind):
    """A copy of each leaf of ``leaves`` (kinds as ``kinds`` says) copied in bulk — small
    PyTorch CPU tensors — and None in the places of the others, which are left to the
    caller's ordinary path."""
    out = [None] * len(leaves)
    if "torch" in sys.modules:
        at = [i for i, k in enumerate(kinds) if k == torch_kind]
        if len(at) > 1:
            _copy_torch([leaves[i] for i in at], out, at)
    return out
