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


def _torch_groups(leaves, exact):
    """``{(dtype, shape): [index, …]}`` of the exact ``Tensor``/``Parameter`` leaves, in
    order, in one pass (a leaf whose dtype or shape cannot be read is left out). Device,
    layout and quantization are checked once per group, on its first leaf: a group that
    mixes them is refused by ``torch.stack`` as a whole, and left to the engine."""
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


def copy_many(leaves):
    """A copy of each small PyTorch CPU tensor of ``leaves`` copied in bulk, and None in
    the places of the other leaves (any kind), which are left to the caller's ordinary
    path."""
    out = [None] * len(leaves)
    torch = sys.modules.get("torch")
    if torch is None or len(leaves) < 2:
        return out
    exact = (torch.Tensor, torch.nn.Parameter)
    strided = torch.strided
    with torch.no_grad():
        for group in _torch_groups(leaves, exact).values():
            first = leaves[group[0]]
            try:
                if first.layout != strided or first.is_quantized or not first.is_cpu:
                    continue
                item = first.element_size() * first.numel()
            except Exception:
                continue
            if item > SMALL_BYTES:
                continue
            for part in _chunks(group, item):
                try:
                    rows = torch.stack([leaves[j] for j in part]).unbind(0)
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    continue
                for j, row in zip(part, rows):
                    out[j] = row
    return out
