"""The public functions: moving, converting, saving and loading nested tensor trees."""

import functools
import json
import math
import os
import traceback
import warnings
from collections import Counter

import numpy as np

from . import _cast_load
from . import _devices
from . import _fallback
from . import _fanout
from . import _frameworks as fw
from . import _native
from . import _progress
from . import _save_order
from . import _select
from ._errors import (
    CopyError,
    DeviceUnavailableError,
    FormatError,
    OutOfMemoryError,
    TensorferryTypeError,
    naming_key,
)
from ._data import data_to_tensor, numeric_data
from ._gc_pause import gc_paused
from ._host_copy import copy_many, torch_chunks
from ._numpy import numpy_can_hold
from ._transfer import Transfer, run_in_background
from ._tree import dotted, shown

_FRAMEWORKS_KEY = "tensorferry.frameworks"
_RESERVED_PREFIX = "tensorferry"


def _start(leaves, target, copy, non_blocking, pinned, staging, packed=False, stackable=True):
    """Queues the copies of a move: ``({id(leaf): leaf kept as is}, queued)``, where
    ``queued`` is ``(leaves, native results, result kinds, paths, stacks)`` or None. With
    ``packed``, every copy goes through the engine into one buffer. ``stackable`` says
    that PyTorch's current stream may read the PyTorch GPU tensors (no other producer
    stream was named), so that blocking moves to the host may stack them there."""
    out = {}
    # Blocking host copies of many small NumPy and PyTorch CPU leaves: in bulk, rows of chunks.
    if copy and target == "cpu" and not packed and not non_blocking:
        leaves = copy_many(leaves, out)
    # Leaves on devices the engine does not drive (ROCm, MPS, TPU, …): their frameworks' copies.
    leaves, fallback = _fallback.start(leaves, target, non_blocking, pinned, staging)
    paths, pending, kinds = [], [], []
    for path, leaf in leaves:
        kind = fw.kind_of(leaf)
        if not copy and fw.device_of(leaf, kind) == target:
            out[id(leaf)] = leaf
            continue
        paths.append(path)
        pending.append(leaf)
        kinds.append(kind)
    if not pending:
        return out, None if fallback is None else ([], [], [], [], None, fallback)
    # Many small PyTorch CPU tensors bound for a device cross into tensorferry as stacks,
    # one per group of one dtype and shape (of at most 1 MiB), not one by one; each stack
    # moves as one tensor and is handed back as its rows.
    # Bound for the host, blocking, small PyTorch GPU tensors are stacked on their GPU by
    # PyTorch, on its current stream (which the copies of their stacks then wait for).
    if packed or fw.TORCH not in kinds:
        chunks = []
    elif target != "cpu":
        chunks = torch_chunks(pending, device_bound=True)
    else:
        chunks = torch_chunks(pending, cuda=True) if stackable and not non_blocking else []
    groups = [([pending[j] for j in part], paths[part[0]]) for part, _ in chunks]  # leaves, a path
    if chunks:
        stacked = {j for part, _ in chunks for j in part}
        rest = [j for j in range(len(pending)) if j not in stacked]
        pending, kinds, paths = [pending[j] for j in rest], [kinds[j] for j in rest], [paths[j] for j in rest]
    natives = fw.to_native_many(
        pending + [t for _, t in chunks], kinds + [fw.TORCH] * len(chunks), paths + [p for _, p in groups]
    )
    try:
        moved = _native.move_tensors(natives, target, copy, non_blocking, pinned, staging)
    except CopyError as e:
        raise naming_key(e, [shown(p) for p in paths + [p for _, p in groups]]) from None
    if target.startswith("emu"):
        # No framework holds emulated memory.
        kinds = [fw.NATIVE] * len(kinds)
    elif target != "cpu":
        # Frameworks that hold GPU memory get their tensors back; NumPy cannot.
        kinds = [fw.NATIVE if k in (fw.NUMPY, fw.DLPACK, fw.CAI) else k for k in kinds]
    if chunks:
        stacks = (groups, moved[len(pending):], fw.NATIVE if target.startswith("emu") else fw.TORCH)
        return out, (pending, moved[: len(pending)], kinds, paths, stacks, fallback)
    return out, (pending, moved, kinds, paths, None, fallback)


def _finish(out, queued, order=False):
    """Fills ``out`` with the queued results in their frameworks (waiting for the copies
    where a framework's tensors cannot wait by themselves; with ``order``, PyTorch CUDA
    results come at once, PyTorch's current stream made to wait for them on the GPU)."""
    if queued is None:
        return
    pending, moved, kinds, paths, stacks, fallback = queued
    if fallback is not None:
        out.update(fallback.results())
    for leaf, result in zip(pending, fw.from_native_many(moved, kinds, paths, order)):
        out[id(leaf)] = result
    if stacks is not None:
        groups, moved, kind = stacks
        wholes = fw.from_native_many(moved, [kind] * len(moved), [p for _, p in groups], order)
        if kind == fw.TORCH:
            import torch

            with torch.no_grad():  # views made without autograd's bookkeeping
                rows = [whole.unbind(0) for whole in wholes]
        else:
            rows = [_native.unbind(whole) for whole in wholes]
        for (leaves, _), part in zip(groups, rows):
            for leaf, row in zip(leaves, part):
                out[id(leaf)] = row


# Results on a GPU whose framework's stream is made to wait for their copies there (through
# DLPack's stream argument), and tensorferry tensors, which wait on every read.
_STREAM_ORDERED = {fw.TORCH, fw.JAX, fw.CUPY, fw.NATIVE}


def _pending(obj, out, queued, then=None, made=None, ordered=False):
    """The :class:`Transfer` of a non-blocking move of ``obj``: the structure is taken now,
    and given by ``.result()`` once every copy has finished, each result in its framework,
    ``then`` applied to the whole. ``out`` and ``queued`` are :func:`_start`'s; ``made``
    (``{id(tensor): id(leaf)}``) names the leaves that queued tensors were made from.

    With ``ordered`` (a move onto a CUDA device) and only results of frameworks that order
    their streams after the copies (PyTorch, JAX, CuPy; tensorferry tensors wait by
    themselves), the results are made at once: the framework's current stream waits for
    the copies on the GPU, as ``tensor.to("cuda", non_blocking=True)`` orders them, and the
    handle waits only for the tensorferry tensors' copies."""
    made = made or {}
    stand_ins, copies = {}, []
    if queued is not None:
        leaves, moved, kinds, _, stacks, fallback = queued
        if (
            ordered
            and fallback is None
            and set(kinds) <= _STREAM_ORDERED
            and (stacks is None or stacks[2] in _STREAM_ORDERED)
        ):
            done = dict(out)
            _finish(done, queued, order=True)
            result = _native.rebuild(obj, {made.get(k, k): v for k, v in done.items()}, False, fw.kind_of)
            result = result if then is None else then(result)
            return Transfer([t for t, k in zip(moved, kinds) if k == fw.NATIVE], lambda: result)
        stand_ins = {id(leaf): t for leaf, t in zip(leaves, moved)}
        if fallback is not None:
            # Leaves their frameworks copy hold their own places until the copies exist.
            stand_ins.update({id(leaf): leaf for leaf in fallback.leaves})
        copies = list(moved)
        if stacks is not None:
            groups, wholes, _ = stacks
            copies += wholes
            stand_ins.update({id(leaf): object() for rows, _ in groups for leaf in rows})
    taken = {made.get(k, k): v for k, v in {**out, **stand_ins}.items()}
    # Stand-ins, not the sources, hold the places: the sources may be freed meanwhile.
    skeleton = _native.rebuild(obj, taken, False, fw.kind_of)

    def finish():
        result = skeleton
        if stand_ins:
            converted = {}
            _finish(converted, queued)
            result = _native.rebuild(skeleton, {id(s): converted[k] for k, s in stand_ins.items()})
        return result if then is None else then(result)

    keys = []
    if queued is not None:
        keys = [shown(p) for p in queued[3]] + [shown(p) for _, p in (queued[4][0] if queued[4] else [])]
    return Transfer(copies, finish, keys=keys)


def _not_a_handle(obj, name):
    """Refuses a :class:`Transfer` given as a tree: it would pass through as a plain leaf."""
    if isinstance(obj, Transfer):
        raise TensorferryTypeError(
            f"{name} was given a Transfer (the handle of a non_blocking=True call): pass its .result()"
        )


def _check_staging(staging):
    """Refuses a bad ``staging`` whatever the call then moves (the default costs nothing)."""
    if not (isinstance(staging, str) and staging == "auto"):
        _native.check_staging(staging)


def _check_like(like):
    if like is not None and like not in _LIKE:
        raise FormatError(f"like must be one of {_LIKE}, not {like!r}")
    if like is not None and not fw.importable(like):
        # Never a quiet fallback to another framework's tensors.
        raise FormatError(f"like={like!r}: {like} cannot be imported in this process (is it installed?)")


def _as_like(obj, like):
    """``obj`` with every tensor leaf in the framework ``like`` (None: as they are),
    sharing memory where the frameworks allow."""
    if like is None:
        return obj
    leaves = [(p, x, k) for p, x in _native.collect_tensors(obj, fw.kind_of) if (k := fw.kind_of(x)) != like]
    if not leaves:
        return obj
    paths = [p for p, _, _ in leaves]
    natives = fw.to_native_many([x for _, x, _ in leaves], [k for _, _, k in leaves], paths)
    results = fw.from_native_many(natives, [like] * len(leaves), paths)
    return _native.rebuild(obj, {id(x): r for (_, x, _), r in zip(leaves, results)})


def _sync_producer(stream, leaves=(), target="cpu"):
    """Makes the work queued on the caller's stream come before tensorferry reads.

    ``stream`` is a framework stream (``torch.cuda.Stream``, ``cupy.cuda.Stream``: anything
    with ``synchronize()``) or a raw CUDA stream handle (an int). When every tensor of
    ``leaves`` (``[(path, leaf)]``; leaves that are no tensor, such as lists of numbers, are
    passed over) lives on the stream's GPU and the copies run on that GPU (to the host, or
    within it), tensorferry's copies there wait for it on the GPU and the caller does not
    wait at all; otherwise (a tensor in host memory, which host threads may read, several
    GPUs, or another GPU copying) the caller waits for the stream.
    """
    if stream is None:
        return
    handle, gpu = _stream_handle(stream)
    gpus = set()
    if handle is not None:
        kinds = ((leaf, fw.kind_of(leaf)) for _, leaf in leaves)
        gpus = {fw.device_of(leaf, kind) for leaf, kind in kinds if kind is not None}
        if len(gpus) == 1:
            (only,) = gpus
            if only.startswith("cuda:") and gpu in (None, int(only[5:])) and target in ("cpu", only):
                try:
                    _native.cuda_order_after_stream(int(only[5:]), handle)
                    return
                except DeviceUnavailableError:
                    pass  # a handle the driver refuses there: wait for it on the host instead
    if hasattr(stream, "synchronize"):
        stream.synchronize()
    elif isinstance(stream, int):
        # A stream's handle names its GPU; the default-stream handles (1 and 2) name the
        # default stream of the context they are used in: each GPU the tensors live on
        # (GPU 0 when they all live on the host).
        ordinals = sorted(int(g[5:]) for g in gpus if g.startswith("cuda:")) or [0]
        for ordinal in ordinals if stream in (1, 2) else ordinals[:1]:
            _native.cuda_stream_synchronize(ordinal, stream)
    else:
        _check_stream(stream)


def _check_stream(stream):
    """Refuses a ``stream=`` that is no stream: neither a CUDA stream handle (an int) nor an
    object with ``synchronize()`` (a framework's stream)."""
    if stream is not None and not (isinstance(stream, int) or hasattr(stream, "synchronize")):
        raise TensorferryTypeError(
            f"stream must be a framework stream or a CUDA stream handle, not {type(stream).__name__}"
        )


def _stream_handle(stream):
    """``(raw CUstream handle, GPU ordinal or None)`` of a stream argument, or ``(None,
    None)`` where neither is known (any other object with ``synchronize()``)."""
    if isinstance(stream, bool):
        return None, None
    if isinstance(stream, int):
        return stream, None
    raw = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if isinstance(raw, int):
        device = getattr(stream, "device", None)
        return raw, getattr(device, "index", None)
    raw = getattr(stream, "ptr", None)  # cupy.cuda.Stream
    if isinstance(raw, int):
        return raw, getattr(stream, "device_id", None)
    return None, None


def _to_host_many(leaves):
    """``{id(leaf): host tensor}`` for the leaves of ``[(path, leaf)]`` on a device: one
    planned transfer for all of them, not one per leaf."""
    on_device = [(p, x) for p, x in leaves if fw.device_of(x, fw.kind_of(x)) != "cpu"]
    if not on_device:
        return {}
    out, queued = _start(on_device, "cpu", False, False, False, None)
    _finish(out, queued)
    return out


@gc_paused
def to_host(obj, *, non_blocking=False, stream=None, staging="auto", like=None, copy=False, pinned=False, _packed=False):
    """Moves every tensor in ``obj`` to host memory, keeping the structure.

    ``obj`` is any nesting of dicts (any Mapping), lists and tuples (namedtuples kept); an
    ``OrderedDict`` (what a module's ``state_dict()`` returns) keeps its order and its
    instance attributes, such as ``_metadata``, as the very same objects. Tensor leaves (tensorferry, NumPy, PyTorch, JAX, CuPy, any DLPack exporter) come back
    in their own framework (CuPy as NumPy); every other leaf is returned as the very same
    object. Tensors already on the host are returned as they are unless ``copy=True``,
    in which case no result shares memory with the input. The source is never modified.
    Blocking host copies of many small PyTorch CPU tensors are made in bulk by the core,
    each group of tensors of one dtype and shape as rows of chunks of at most 1 MiB cut
    from 4 MiB blocks (their values independent; a result kept alive keeps its block
    alive); other copies land in one 64-byte-aligned buffer. Blocking
    moves of many small PyTorch GPU tensors stack each such group on its GPU first (on
    PyTorch's current stream) and copy the stacks. Rows are views made without autograd:
    an in-place operation that would record autograd history on one (adding a tensor
    that requires grad, in grad mode) raises PyTorch's error about such views; ``.clone()``
    it first.
    With ``pinned=True`` results copied from a device live in the device's pinned pool,
    reused by the next transfer, instead of fresh ordinary memory. ``stream`` is the
    producer's stream (a torch/CuPy stream or a raw handle): its queued work comes before
    the tensors are read — on the GPU, without the caller waiting, when every tensor lives
    on that stream's GPU; else the caller waits for the stream. ``staging`` says whether copies into ordinary memory go through a
    ring of pinned buffers: ``"auto"`` (on CUDA, for 64 MB and more; direct copies where
    pinned memory is refused), ``"off"``, ``"on"``, or ``(chunk_bytes, depth)``: chunks of
    4 KiB to 1 GiB, a depth of 1 to 64, at most 4 GiB in all (the ring pins at most twice
    that), else a :class:`FormatError` (a ``ValueError``) naming the value.

    ``like="numpy" | "torch" | "jax" | "tensorflow" | "tensorferry"`` gives every tensor
    of the result in that framework (sharing memory where the frameworks allow):
    ``to_host({"w": np.ones(3)}, like="torch")`` is a dict of a PyTorch tensor.

    With ``non_blocking=True`` the call returns a :class:`Transfer` before the copies
    finish, whatever the leaves: ``.result()`` (or ``await``) gives the structure once
    every copy has finished and raises a failed copy's error; ``.done()`` and ``.wait()``
    as in ``concurrent.futures``. No result can be read early.

    >>> import numpy as np, tensorferry as tf
    >>> out = tf.to_host({"w": np.ones(2, np.float32), "name": "run-1"}, copy=True)
    >>> out["w"], out["name"]
    (array([1., 1.], dtype=float32), 'run-1')
    >>> tf.to_host({"w": np.ones(2, np.float32)}, non_blocking=True).result()["w"]
    array([1., 1.], dtype=float32)
    """
    _not_a_handle(obj, "to_host")
    _check_staging(staging)
    _check_like(like)
    leaves = _native.collect_tensors(obj, fw.kind_of)
    _sync_producer(stream, leaves)
    out, queued = _start(leaves, "cpu", copy, non_blocking, pinned, staging, _packed, stream is None)
    if non_blocking:
        return _pending(obj, out, queued, lambda result: _as_like(result, like))
    _finish(out, queued)
    return _as_like(_native.rebuild(obj, out, False, fw.kind_of), like)


@gc_paused
def to_numpy(obj, *, non_blocking=False, stream=None, staging="auto"):
    """Like :func:`to_host`, then every tensor leaf becomes a ``numpy.ndarray``.

    Host memory is shared, not copied (read-only arrays for read-only memory such as a
    memory-mapped file). bfloat16 and float8 become ``ml_dtypes`` arrays. ``stream`` (the
    producer's stream) and ``staging`` are as for :func:`to_host`. With
    ``non_blocking=True`` it returns at once a :class:`Transfer` whose ``.result()`` is the
    structure of arrays, once every copy from a device has finished.

    >>> import numpy as np, tensorferry as tf
    >>> tf.to_numpy({"t": tf.Tensor.from_numpy(np.arange(3))})["t"]
    array([0, 1, 2])
    """
    _not_a_handle(obj, "to_numpy")
    if non_blocking:
        return to_host(obj, non_blocking=True, stream=stream, staging=staging).then(to_numpy)
    if stream is not None or staging != "auto":
        # The copies from devices with the producer's stream or the ring asked for; what
        # follows then finds every tensor on the host.
        obj = to_host(obj, stream=stream, staging=staging)
    converted = _torch_cpu_to_numpy(obj)
    if converted is not None:
        return converted
    collected = _native.collect_tensors(obj, fw.kind_of, True)
    # tensorferry tensors, the common case, in one native pass; other frameworks' here.
    out, rest = _native.native_leaves_to_numpy(collected)
    rest = _torch_host_to_numpy(rest, out)
    natives, paths, leaves = [], [], []
    hosted = _to_host_many(rest)
    for path, leaf in rest:
        kind = fw.kind_of(leaf)
        if id(leaf) in hosted:
            leaf_host = hosted[id(leaf)]
            kind_host = fw.kind_of(leaf_host)
            if kind_host == fw.NUMPY:
                out[id(leaf)] = leaf_host
                continue
        else:
            leaf_host, kind_host = leaf, kind
        if kind_host == fw.NATIVE:
            natives.append(leaf_host)
            paths.append(path)
            leaves.append(leaf)
        elif kind_host == fw.TORCH and leaf_host.dtype not in _torch_no_numpy():
            out[id(leaf)] = fw._exported(path, lambda: _torch_numpy(leaf_host))
        elif kind_host == fw.JAX:
            out[id(leaf)] = np.asarray(leaf_host)
        else:
            natives.append(fw.to_native(leaf_host, kind_host, path))
            paths.append(path)
            leaves.append(leaf)
    if natives:
        arrays = fw.tensors_to_numpy(natives, lambda i: shown(paths[i]))
        for leaf, arr in zip(leaves, arrays):
            out[id(leaf)] = arr
    return _native.rebuild(obj, out, False, fw.kind_of, True)


def _torch_cpu_to_numpy(obj):
    """``obj`` rebuilt with each PyTorch tensor as its ``.numpy()``, in one native pass,
    when every tensor leaf is a PyTorch tensor (exactly ``torch.Tensor``) whose ``.numpy()``
    answers as it is, or a NumPy array; else None, for the general path (which names any
    error)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return _native.rebuild(obj, {}, False, fw.kind_of, True, (torch.Tensor, torch.Tensor.numpy))
    except Exception:
        return None


def _torch_host_to_numpy(leaves, out):
    """``out[id(t)] = t.numpy()`` for each PyTorch host tensor of ``[(path, leaf)]`` whose
    ``.numpy()`` answers as it is (at the cost of the loop a user would write); the other
    leaves back, for the general path (devices, dtypes NumPy lacks, tensors that require
    grad or are lazy views, and refusals, which it names by key)."""
    if not leaves or fw.kind_of(leaves[0][1]) != fw.TORCH:
        return leaves  # a tree of PyTorch tensors starts with one
    import torch

    exact, rest = torch.Tensor, []
    for path, t in leaves:
        try:
            if (type(t) is exact or fw.kind_of(t) == fw.TORCH) and t.is_cpu:
                out[id(t)] = t.numpy()
                continue
        except Exception:
            pass
        rest.append((path, t))
    return rest


def _torch_numpy(t):
    """A host PyTorch tensor as NumPy, sharing memory where PyTorch allows."""
    try:
        return t.numpy()
    except RuntimeError:  # requires grad, or a lazy conjugate/negative view
        return t.detach().resolve_conj().resolve_neg().numpy()


def _torch_no_numpy():
    """PyTorch dtypes whose ``.numpy()`` fails: they go through ml_dtypes instead."""
    import torch

    return (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


@gc_paused
def to_device(obj, device, *, non_blocking=False, stream=None, staging="auto", like=None, copy=False):
    """Moves every tensor in ``obj`` to ``device`` ("cpu", "cuda", "cuda:1", "emu:0"; or a
    GPU index, a ``torch.device``, a JAX or a CuPy device, as every function that takes a
    device does).

    ``device`` may also be one only a framework drives: "mps", "xpu:N", "xla:N", "hpu:N"
    and "rocm:N" (a ROCm build's "cuda:N") are PyTorch's, "tpu:N" JAX's (also as
    ``torch.device`` and JAX device objects). Every tensor and list of numbers then goes
    through that framework's upload (``Tensor.to``, ``jax.device_put``; TensorFlow leaves
    onto a TPU ``tf.identity`` under ``tf.device``) and the results are its tensors;
    ``like`` may only name it, ``staging`` rings are refused, and a non-blocking result
    comes after the framework's own synchronisation.

    Lists of Python numbers (rectangular, nested lists) are data: they become
    ``tensorferry.Tensor`` leaves in a standard dtype: float -> float32, int -> int64, bool
    -> bool; a ragged list is a :class:`FormatError` naming its key, and an empty list stays
    a list; integers beyond int64 and finite floats beyond float32 are a
    :class:`TensorferryOverflowError`. A tuple is a record (``betas=(0.9, 0.999)``, a
    shape) and stays as it is, and so does a list holding one. The state dict of a PyTorch
    optimizer (a dict holding ``"state"`` and ``"param_groups"``) or learning-rate
    scheduler (holding ``"_last_lr"``, or ``"base_lrs"`` and ``"last_epoch"``) holds
    hyper-parameters: in it only existing tensors move (``params=[0, 1]``,
    ``base_lrs=[0.1]`` stay lists), so ``load_state_dict`` takes the result.
    ``like="torch" | "jax" | "tensorflow" | "numpy" | "tensorferry"`` gives every tensor of
    the result in that framework, those made from lists included (NumPy on the host only;
    on the emulated device only "tensorferry").
    Many small PyTorch CPU tensors of one dtype and shape (rows of a multiple of 64
    bytes) cross into tensorferry as one ``torch.stack`` per group of at most 1 MiB and come
    back as the rows of the moved stack (each 64-byte aligned on the device).
    Tensors already on ``device`` are returned as they are unless ``copy=True``. A bad
    device string raises :class:`InvalidDeviceError`; an absent device raises
    :class:`DeviceUnavailableError` with the reason. ``stream`` is the producer's stream, and
    ``staging`` the choice of pinned staging for copies from ordinary memory, as for
    :func:`to_host`. With ``non_blocking=True`` the call returns a :class:`Transfer` at
    once, as :func:`to_host` does.

    >>> import tensorferry as tf
    >>> out = tf.to_device({"embedding_1": [1.0, 2.0, 3.0], "ids": [[1, 2], [3, 4]]}, "cpu")
    >>> out["embedding_1"].dtype, out["ids"].dtype, out["ids"].shape
    ('float32', 'int64', (2, 2))
    >>> pending = tf.to_device({"w": [1.0, 2.0]}, "emu:0", non_blocking=True)  # at once
    >>> pending.result()["w"].device
    'emu:0'
    """
    _not_a_handle(obj, "to_device")
    target = _devices.name_of(device, frameworks=True)
    if _fallback.owner_of(target) is not None:  # mps, xpu, xla, hpu, rocm, tpu: their framework's copies
        _check_staging(staging)
        _sync_producer(stream)
        return _fallback.onto(obj, target, non_blocking=non_blocking, like=like, copy=copy, staging=staging)
    _fallback.ensure_device(target)
    _check_staging(staging)
    _check_like(like)
    if like not in (None, fw.NATIVE) and (target.startswith("emu") or (like == fw.NUMPY and target != "cpu")):
        raise FormatError(f"like={like!r} cannot hold memory of {target}")

    def select(x, path):
        return fw.kind_of(x) is not None or numeric_data(x)

    leaves = _native.collect_tensors(obj, fw.kind_of, False, select)
    _sync_producer(stream, leaves, target)
    out = {}
    made = {}  # id(new tensor) -> id(the list it was made from)
    # Without leaves that may be lists of numbers (the walk takes only lists and tuples as
    # data), everything is one move; the leaves' types are read once per type.
    if any(issubclass(t, (list, tuple)) for t in {type(leaf) for _, leaf in leaves}):
        tensors = []
        for path, leaf in leaves:
            if fw.kind_of(leaf) is None:
                t = data_to_tensor(leaf, path)
                if target == "cpu":
                    out[id(leaf)] = t  # already a fresh host tensor
                    continue
                made[id(t)] = id(leaf)
                tensors.append((path, t))
            else:
                tensors.append((path, leaf))
        leaves = tensors
    # One planned transfer for everything, tensors made from lists included.
    moved, queued = _start(leaves, target, copy, non_blocking, False, staging, stackable=stream is None)
    if non_blocking:
        return _pending(obj, {**out, **moved}, queued, lambda result: _as_like(result, like), made,
                        ordered=target.startswith("cuda") and like is None)
    _finish(moved, queued)
    for key, result in moved.items():
        out[made.get(key, key)] = result
    return _as_like(_native.rebuild(obj, out, False, fw.kind_of), like)


def _native_tree(obj):
    """``(tree, frameworks)``: the tree for the native writer, plain containers and native
    tensors where they are (the writer streams device tensors into each file through its
    pinned ring, so host memory stays bounded by the ring), and the record of the
    frameworks its tensors come from: the most common one, and the names of the others."""
    leaves = _native.collect_tensors(obj, fw.kind_of)
    paths = [path for path, _ in leaves]
    tensors = [leaf for _, leaf in leaves]
    kinds = [fw.kind_of(leaf) for leaf in tensors]
    # Leaves on devices the engine does not drive reach the writer as host copies.
    natives = fw.to_native_many(*_fallback.on_host(tensors, kinds, paths), paths)
    tree = _native.rebuild(obj, {id(leaf): t for leaf, t in zip(tensors, natives)}, True, fw.kind_of)
    if not kinds:
        return tree, None
    # Files hold what CuPy and CUDA-array-interface leaves come back as: NumPy.
    saved = [fw.NUMPY if kind in (fw.CUPY, fw.NUMBA, fw.CAI) else kind for kind in kinds]
    default = Counter(saved).most_common(1)[0][0]
    # Names only for the exceptions: a dotted name per tensor is most of the walk's cost.
    others = {dotted(path): kind for path, kind in zip(paths, saved) if kind != default}
    return tree, {"default": default, "except": others}


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


_MAX_SHARD_BYTES = 2**63 - 1
_SHARD_SIZES = (
    f"max_shard_size takes a whole number of bytes from 1 to {_MAX_SHARD_BYTES} (2**63 - 1), "
    "or a str such as '5GB' or '2GiB'"
)


def _parse_size(size):
    """Bytes of ``5_000_000``, ``"5GB"`` (decimal, as transformers reads it) or ``"2GiB"``;
    a :class:`FormatError` (a ``ValueError``) naming ``max_shard_size`` and the range for
    anything else (``"inf"``, ``2**70``, ``0``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        digits = text.rstrip("KMGTIB")
        unit = text[len(digits):]
        try:
            n = float(digits) * _SIZE_UNITS[unit]
        except (KeyError, ValueError):
            raise FormatError(f"max_shard_size={size!r} is not a size: {_SHARD_SIZES}") from None
        if not math.isfinite(n):
            raise FormatError(f"max_shard_size={size!r} is out of range: {_SHARD_SIZES}")
        n = int(n)
    else:
        raise TensorferryTypeError(f"max_shard_size={size!r}: {_SHARD_SIZES}, not {type(size).__name__}")
    if not 1 <= n <= _MAX_SHARD_BYTES:
        raise FormatError(f"max_shard_size={size!r} is out of range: {_SHARD_SIZES}")
    return n


@gc_paused
def save(obj, path, *, non_blocking=False, stream=None, staging="auto", metadata=None, fsync=True, max_shard_size=None,
         progress=False):
    """Saves ``obj`` as a safetensors file at ``path``, atomically.

    Nesting, container types, keys containing dots and plain values (str, int, float
    including NaN and infinities, bool, None) are recorded, so :func:`load` returns the
    same structure; other tools see tensors named by their key paths joined with ".".
    ``metadata`` (str -> str) is stored beside (with ``"format": "pt"`` added, as Hugging
    Face's loaders expect, when every tensor is a PyTorch tensor). Anything else (an arbitrary object,
    complex128) is a :class:`FormatError` naming its key: no pickle, ever. On failure the
    previous file at ``path`` is left untouched.

    With ``max_shard_size`` (bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"``) a larger tree is
    written as Hugging Face writes checkpoints: ``model-00001-of-0000N.safetensors`` shards
    beside ``path`` plus ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``), which ``transformers.from_pretrained`` reads; every file is atomic,
    the index is written last, and each shard's metadata says ``"format": "pt"`` unless
    ``metadata`` names a format. A tree that fits one shard is written as ``path`` itself.

    With ``non_blocking=True`` the call returns a :class:`Transfer` as soon as a consistent
    snapshot of every tensor exists (copied into the pinned pool, reused by the next save,
    so the caller may overwrite its tensors at once); the file is written in the background
    with the GIL released. ``.wait()`` / ``.result()`` raise the save's error, and a failed
    save leaves the previous file intact. A failure is never silent: one nobody awaited is a
    ``RuntimeWarning`` on stderr when the last handle is collected, or at exit. The
    interpreter's exit waits for saves still being written; Ctrl-C during that wait
    abandons them (their paths untouched) with a line on stderr and exit status 130.
    Ctrl-C during a blocking save raises ``KeyboardInterrupt`` at once; the save goes on
    in the background as a non-blocking one would (the path holds the old checkpoint or the
    new one, whole), and the exit waits for it the same way.

    Tensors on a device (blocking saves) stream into the file through a ring of pinned
    buffers — ``staging``: "auto" or "on" (3 × 32 MiB; with "auto", ordinary memory where
    pinned memory is refused), ``(chunk_bytes, depth)`` within the limits of
    :func:`to_host`, or "off" to copy them to host memory whole first — so host memory
    stays bounded by the ring whatever their size, and the device copies the next chunk
    while this one is written. ``stream`` is the producer's stream, as for :func:`to_host`:
    its queued work comes before the tensors are read.

    With ``progress=True`` a bar of the bytes written so far is drawn on stderr when
    ``tqdm`` is installed (nothing otherwise), every shard counted.

    >>> import os, tempfile, numpy as np, tensorferry as tf
    >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
    >>> tf.save({"model": {"layer.0.weight": np.ones((2, 2), np.float32)}, "step": 3}, p)
    >>> tf.load(p)["step"]
    3
    """
    _not_a_handle(obj, "save")
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise FormatError("metadata must be a dict of str to str")
        for text in (t for kv in metadata.items() for t in kv):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise FormatError(
                    f"metadata {text!r} is not valid Unicode (it holds a lone surrogate) and cannot be stored"
                ) from None
        reserved = [k for k in metadata if k.startswith(_RESERVED_PREFIX)]
        if reserved:
            raise FormatError(f"metadata keys starting with 'tensorferry' are reserved: {reserved}")
    shard_bytes = None if max_shard_size is None else _parse_size(max_shard_size)
    if non_blocking:
        _native.check_staging(staging)  # refused now, not in the background
        # Tensors given under several keys (tied weights) stay one tensor in the snapshot,
        # so the file stores them once, as a blocking save does; overlaps are refused.
        obj = _select.tie_shared(obj)
        # Leaves the engine cannot reach are copied by their frameworks (the pinned pool is the engine's).
        obj = _fallback.on_host_tree(obj)
        # The snapshot: every tensor copied now (device ones into the pinned pool).
        try:
            obj = to_host(obj, copy=True, pinned=True, stream=stream)
        except OutOfMemoryError:
            if staging not in ("auto", None):
                raise
            # "auto" and no pinned memory to be had: the snapshot goes to ordinary memory.
            obj = to_host(obj, copy=True)
    elif stream is not None:
        _sync_producer(stream, _native.collect_tensors(obj, fw.kind_of))
    tree, record = _native_tree(obj)
    meta = dict(metadata or {})
    if record is not None:
        meta[_FRAMEWORKS_KEY] = json.dumps(record, separators=(",", ":"))
        if record["default"] == fw.TORCH and not record["except"]:
            # Hugging Face's loaders (transformers 4.x) require the key in PyTorch files.
            meta.setdefault("format", "pt")
    write = _native.save
    if progress:
        total = sum(t.nbytes for _, t in _native.collect_tensors(tree, fw.kind_of))
        write = _progress.watched_save(path, total, _native.save)
    turn = _save_order.take(path)
    if non_blocking:
        what = f"tensorferry.save(..., non_blocking=True) to {os.fspath(path)!r}"
        return run_in_background(what, _saved, turn, write, tree, os.fspath(path), meta, fsync, shard_bytes)
    # Blocking, on a writer thread waited for in slices, so that Ctrl-C is answered at once:
    # the save goes on, and the path then holds the old checkpoint or the new one, whole.
    what = f"tensorferry.save to {os.fspath(path)!r} (interrupted)"
    run_in_background(what, _saved, turn, write, tree, os.fspath(path), meta, fsync, shard_bytes, staging).result()


def _saved(turn, write, *args):
    """A save in its turn (see :mod:`._save_order`), for the background: its result is None."""
    turn.run(write, *args)


_LIKE = (fw.NUMPY, fw.TORCH, fw.NATIVE, fw.JAX, fw.TENSORFLOW)


@gc_paused
def load(path, *, device="cpu", non_blocking=False, stream=None, staging="auto", like=None, mmap=True, direct=False,
         keys=None, dtype=None, out=None, progress=False, process_group=None, shard=None, read_stats=None):
    """Loads a safetensors file as plain containers (dict, list, tuple).

    ``path`` may also be a sharded checkpoint's ``*.safetensors.index.json``, or a folder
    holding one (or holding a single ``.safetensors`` file): every shard is read, in
    parallel, into one dictionary.

    Files written by tensorferry come back in the structure that was saved, each tensor
    in the framework it was saved from when that is importable; ``like="numpy" |
    "torch" | "tensorferry" | "jax" | "tensorflow"`` overrides. Files of other tools load as a
    flat dict whose keys keep their dots, in the framework their ``__metadata__["format"]``
    names by the Hugging Face convention ("pt": PyTorch, "tf", "flax", "np") when that is
    importable. Otherwise host tensors come back as NumPy arrays where
    NumPy can hold the dtype (bfloat16/float8 through ml_dtypes), else as
    ``tensorferry.Tensor``. With ``mmap=True`` tensors view the mapped file at a cost
    proportional to the header: NumPy arrays and ``tensorferry.Tensor`` read-only;
    PyTorch, TensorFlow and JAX tensors, which need writable memory, a private
    copy-on-write map of it (as ``safetensors`` does: writes stay in this process, never
    reach the file). As with any map, a file truncated or rewritten in place while its
    tensors live may crash the process (``SIGBUS``); tensorferry's own saves replace files
    by rename, which is safe.

    With ``device`` ("cuda:0", "emu:0", or any form :func:`to_device` takes) the file is
    mapped and streamed to the device through a ring of pinned buffers (``staging``:
    "auto" or "on" — 3 × 32 MiB, "auto" through ordinary memory where pinned memory is
    refused —, "off", or ``(chunk_bytes, depth)``), so host memory stays bounded by the
    ring whatever the file's size; the results are device tensors owned by their framework
    (PyTorch, JAX for files saved from them; ``tensorferry.Tensor`` otherwise).

    With ``non_blocking=True`` it returns a :class:`Transfer` at once and loads in the
    background: ``.result()`` gives what ``load`` gives, or raises its error (with
    ``process_group``, the group's collectives then run on that thread: issue no other
    collective on the group until it is done). ``stream``
    is the stream whose queued work on ``out``'s tensors must come before they are
    written (the caller waits for it); without ``out`` it has nothing to order.
    ``progress=True`` draws a bar of the bytes loaded on stderr when ``tqdm`` is
    installed: per tensor as each reaches a device; in one step for host memory, which a
    single native call maps or reads.

    With ``direct=True`` the data is read with ``O_DIRECT``, past the page cache, several
    reads in flight, into fresh memory (``direct`` wins over ``mmap``, which then has no
    effect). Use it for cold files larger than the free page cache that are read once (a
    checkpoint at start-up): the cache would only add a copy and evictions. Warm files
    (just written or read) load faster through the cache: keep the default for them. Where
    the filesystem refuses ``O_DIRECT`` the data is read through the page cache and a
    ``RuntimeWarning`` gives the reason (``TENSORFERRY_DIRECT_IO=0`` turns it off). With a
    ``device``, the file is read in chunks into the staging ring's pinned buffers, each
    copied to the device while the next is read, so host memory stays bounded by the ring
    (``staging`` sizes it, within the limits of :func:`to_host`; "on", "off" and "auto" all
    mean 3 × 32 MiB, "off" and "auto" in ordinary memory where pinned memory is refused).
    Ctrl-C stops such a load between two chunks and raises ``KeyboardInterrupt`` at once;
    the device memory is released once the chunks in flight have been copied. ``keys`` cannot
    be combined with ``direct=True`` (a subset is read from a map, touching only its
    bytes), nor ``out`` with ``direct=True`` and a device.

    ``keys`` loads a subset: dotted names ("model.layer.0.weight"), key-path tuples,
    prefixes of subtrees ("model.layer.0") or glob patterns ("model.layer.*.weight"); a
    pattern that matches nothing is a :class:`TensorferryKeyError`. ``dtype`` ("bfloat16",
    "float16", "float32", "float64", or a torch/NumPy dtype) casts every floating tensor,
    whatever the framework: on the host before the move when the cast narrows (half the
    bytes cross for float32 -> bfloat16), else on the device for PyTorch tensors (on the
    host for the emulated device); onto a device, a group of tensors at a time (see
    ``tensorferry._cast_load``), so host memory holds two groups of about 256 MiB and one
    cast, not the checkpoint (``direct=True`` reads the whole file first). ``out`` is a
    dictionary of existing tensors (a model's ``state_dict()``) to fill in place, after
    checking every name, shape, dtype and target and naming every problem; nothing is
    written unless all can be. Names of one tensor (tied weights) are filled once, and the
    file must hold equal values for them (or only one of them, as ``save_pretrained`` stores
    a tied head); overlapping views are refused. Its plain values (an epoch, a learning
    rate) take the file's where its dicts and lists hold them, as
    ``torch.distributed.checkpoint.load`` sets them (a tuple that would have to change is
    named first). It is returned.
    From object storage it is filled a group at a time, as a cast load reads (host memory
    holds two groups): a read that fails after the first group leaves the groups before it
    written, and its error says how many tensors were.

    >>> import os, tempfile, numpy as np, tensorferry as tf
    >>> p = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> tf.save({"x": np.arange(3)}, p)
    >>> tf.load(p, like="tensorferry")["x"].dtype
    'int64'
    >>> tf.load(p, non_blocking=True).result()["x"]
    array([0, 1, 2])

    With ``process_group`` (a ``torch.distributed`` group; every rank calls ``load`` with
    the same arguments) each byte is read from storage once: each rank reads a part of the
    tensors, balanced by bytes (``direct=True``: with ``O_DIRECT``, ``keys`` allowed), and the
    parts are broadcast over the group, so every rank gets what ``load`` gives (in fresh
    memory). ``shard={pattern: dim}`` (patterns as for ``keys``) gives each rank only
    ``torch.tensor_split(full, world, dim)[rank]`` of the tensors it matches, reading only
    that slice's byte runs (``{pattern: (dim, parts)}``: part ``rank % parts``; a size that
    does not divide is an error). A checkpoint in object storage (``s3://…``: an object, an
    index or a prefix) is read the same way, with ranged GETs. ``read_stats`` (a
    ``tensorferry.dcp.ReadStats``) counts the bytes this rank read. Every rank raises the
    same error, naming the failing rank. See ``tensorferry._fanout``.
    """
    args = dict(device=device, stream=stream, staging=staging, like=like, mmap=mmap, direct=direct, keys=keys,
                dtype=dtype, out=out, progress=progress, process_group=process_group, shard=shard,
                read_stats=read_stats)
    # Arguments are refused before the file is read, and not in the background.
    _check_staging(staging)
    _check_stream(stream)
    _devices.name_of(device)
    if non_blocking:
        _check_like(like)
        what = f"tensorferry.load({os.fspath(path)!r}, non_blocking=True)"
        return run_in_background(what, functools.partial(_load, path, **args))
    return _load(path, **args)


def _load(path, *, device, stream, staging, like, mmap, direct, keys, dtype, out, progress, process_group, shard,
          read_stats):
    """:func:`load`'s work, blocking (in the caller's thread or in the background)."""
    if stream is not None and out is not None:
        _sync_producer(stream, _native.collect_tensors(out, fw.kind_of), target=None)
    if process_group is not None or shard is not None or read_stats is not None:
        return _fanout.load(
            path, process_group=process_group, shard=shard, read_stats=read_stats, device=device, like=like,
            keys=keys, dtype=dtype, out=out, direct=direct, mmap=mmap, staging=staging, local_load=load,
            to_device=to_device,
        )
    _check_like(like)
    target = _devices.name_of(device)
    on_device = target != "cpu"
    patterns = None if keys is None else _select.patterns(keys)
    # Object storage (s3://, gs://, az://, http(s)://): read into host memory (or streamed
    # onto a device, below), a subset fetching only the byte ranges of its keys' tensors.
    url = isinstance(path, str) and _native.is_url(path)
    if url and direct:
        raise FormatError(f"direct=True reads local files past the page cache; {path!r} is in object storage")
    if url and out is not None:
        # A group of tensors at a time, every name, shape and dtype checked first: host
        # memory holds two groups, whatever the checkpoint's size.
        return _cast_load.into(out, path, dtype, keys, progress, load)
    # A cast onto a device goes a group of tensors at a time (host memory bounded by two
    # groups, whatever the checkpoint's size); from object storage, each group is fetched
    # alone (the subset too: it needs no names from here).
    grouped = on_device and dtype is not None and out is None and not direct
    only = pinned = None
    if url and patterns is not None and not grouped:
        # One object's header, read for its names, is not asked for again by the load.
        names, aliased, pinned = _native.object_names(path)
        if aliased:  # a tensor of two names (tied): its paths come from the tree record
            only = _cast_load.subset_names(path, keys, load)
        else:
            only = {n for n in names if any(_select._matches(n, p) for p in patterns)}
    if direct and keys is not None:
        raise FormatError(
            "keys= reads only the selected tensors' bytes, from a memory map; direct=True reads "
            "the whole file past the page cache: choose one"
        )
    if direct and on_device and out is not None:
        raise FormatError(
            f"out= fills existing tensors from the host; direct=True with device={device!r} "
            "streams the file onto the device: drop device= (out= decides where data goes)"
        )
    if on_device:
        _fallback.ensure_device(target)
        if like == fw.NUMPY or (like not in (None, fw.NATIVE) and target.startswith("emu")):
            raise FormatError(f"like={like!r} cannot hold memory of {target}")
    # NumPy (the common case) and tensorferry results are built natively in one pass;
    # tensors recorded from other frameworks come back pending, converted here. For a
    # device, the mapped file's views go there first, streamed through the staging ring
    # (host memory bounded by the ring, whatever the file's size), and only the device
    # tensors are handed to their framework: no host copy of the file is ever made.
    native_like = fw.NATIVE if on_device else (like if like in (None, fw.NUMPY, fw.NATIVE) else fw.NATIVE)
    # A subset is read from the mapping (only its bytes are touched), then copied when
    # fresh memory was asked for.
    mapped = (mmap and not direct) or on_device or keys is not None
    # A cast goes with the host's bytes (a device holds no kernels of tensorferry's own):
    # a file read past the page cache is cast on the host before its move. A whole
    # checkpoint in object storage, or a subset of it, streams onto the device through the
    # ring (ranged GETs into its buffers).
    streamed = on_device and dtype is None and (direct or url)
    # A whole object's tree comes before its last byte: its PyTorch tensors are made (views:
    # no byte is read) while the rest arrives, and nothing is handed out before it has.
    early = url and not on_device and keys is None and out is None and dtype is None and like in (None, fw.TORCH)
    if grouped and url:
        tree, meta = _cast_load.from_objects(path, dtype, target, staging, _onto_device, keys, progress, load)
        pending, fallback, arrival = False, None, None
    else:
        tree, meta, pending, fallback, arrival = _native.load(
            os.fspath(path),
            mapped,
            native_like,
            fw.importable("ml_dtypes"),
            direct,
            target if streamed else None,
            staging if streamed else None,
            # Frameworks that need writable memory (PyTorch) share a private, copy-on-write map.
            mapped and not on_device and like not in (fw.NUMPY, fw.NATIVE),
            only=only,
            early=early,
            pinned=pinned,
        )
    try:
        if fallback is not None:
            warnings.warn(f"tensorferry.load(direct=True): {fallback}", RuntimeWarning, stacklevel=4)
        if progress and (streamed or not on_device):
            # Read (or mapped) in the one native call above: the bar fills at once.
            total = sum(t.nbytes for _, t in _native.collect_tensors(tree, fw.kind_of))
            _progress.filled(total, _progress.named("load", path))
        if keys is not None:
            tree = _select.select(tree, patterns)
            if not (mmap or on_device or url):
                tree = to_host(tree, copy=True)
        if out is not None:
            return _select.fill(out, tree if dtype is None else _select.cast(tree, dtype))
        if on_device:
            # Narrowing casts before the bytes cross (half the traffic for float32 -> bfloat16);
            # on the emulated device every cast, since nothing there casts.
            if grouped and not url:
                tree = _cast_load.onto_device(tree, dtype, target, staging, _onto_device, progress and os.fspath(path))
            elif not (streamed or grouped):
                if dtype is not None:  # direct=True: the file was read whole
                    tree = _select.cast(tree, dtype, narrowing_only=not target.startswith("emu"))
                tree = _onto_device(tree, target, staging, progress and os.fspath(path))
            pending = not target.startswith("emu")  # no framework holds emulated memory
        result = tree
        if pending or (like not in (None, fw.NUMPY, fw.NATIVE) and not on_device):
            # The frameworks recorded at save time: the default, and {name: framework} for
            # the exceptions to it, read as the native load reads them.
            default, exceptions = _native.recorded_frameworks(meta.get(_FRAMEWORKS_KEY), meta.get("format"))
            # Only the frameworks the file names are imported (importing all three would cost a
            # process seconds on its first load).
            held = {}

            def holds(kind):
                if kind not in held:
                    held[kind] = kind in (fw.TORCH, fw.JAX, fw.TENSORFLOW) and fw.importable(kind)
                return held[kind]

            uniform = like or (default if not exceptions else None)
            if uniform is not None and not holds(uniform):
                uniform = None

            def convert(tensors, paths):
                # One framework for every tensor (the common case): no name to look up.
                # Else each tensor's own, or NumPy's, or it stays a tensorferry tensor.
                if uniform is not None:
                    kinds = [uniform] * len(tensors)
                else:
                    kinds, todo = [], []
                    for i, (p, t) in enumerate(zip(paths, tensors)):
                        kind = like or exceptions.get(dotted(p), default)
                        if holds(kind):
                            kinds.append(kind)
                            todo.append(i)
                        elif kind != fw.NATIVE and not on_device and numpy_can_hold(t.dtype):
                            kinds.append(fw.NUMPY)
                            todo.append(i)
                # PyTorch tensors of bytes still arriving are views made ahead of them; other
                # frameworks get the bytes once in.
                promised = arrival is not None and set(kinds) == {fw.TORCH}
                if arrival is not None and not promised:
                    arrival.wait()
                if uniform is not None:
                    return fw.from_native_many(tensors, kinds, paths, promised=promised)
                made = fw.from_native_many([tensors[i] for i in todo], kinds, [paths[i] for i in todo],
                                           promised=promised)
                for i, r in zip(todo, made):
                    tensors[i] = r
                return tensors

            # Paths are for looking names up, and for naming a tensor that fails to convert
            # one at a time; PyTorch's conversion of many takes none (it fails as a whole).
            result = _native.convert_native(tree, convert, uniform != fw.TORCH)
        if dtype is not None:
            result = _select.cast(result, dtype)
        if arrival is not None:
            arrival.wait()
    except BaseException as e:
        if arrival is not None:
            arrival.cancel()  # returns once nothing writes the memory any more
            # No view of bytes that did not all arrive is left to read, even through the
            # traceback's frames.
            tree = result = None
            traceback.clear_frames(e.__traceback__)
        raise
    return result


def _onto_device(tree, target, staging, progress_of=None):
    """``tree`` (a mapped file's tensors) on the device ``target``, streamed through the
    staging ring: "auto" as "on" does, through ordinary memory where pinned memory is
    refused. ``progress_of`` (the file's path) draws a bar advanced as each copy ends."""
    ring = "on" if staging == "auto" else staging
    try:
        if not progress_of:
            return to_device(tree, target, staging=ring)
        pending = to_device(tree, target, staging=ring, non_blocking=True)
        total = sum(t.nbytes for _, t in _native.collect_tensors(tree, fw.kind_of))
        progress = _progress.bar(total, _progress.named("load", progress_of))
        if progress is None:
            return pending.result()
        try:
            return pending._wait_each(progress.update)
        finally:
            progress.close()
    except OutOfMemoryError:
        if staging != "auto":
            raise
        return _onto_device(tree, target, "off", progress_of)


def metadata(path):
    """The user metadata (str -> str) stored in a safetensors checkpoint: a file, a
    sharded checkpoint's index (its first shard's metadata), or any path :func:`load`
    accepts for them (a folder, or the path a sharded save was given)."""
    meta = _native.read_metadata(os.fspath(path))
    return {k: v for k, v in meta.items() if not k.startswith(_RESERVED_PREFIX)}


def pinned_pool_stats(device):
    """Statistics of the pinned host pool that copies from ``device`` land in with
    ``pinned=True``: ``{"pinned_bytes", "cached_bytes", "hits", "misses"}``."""
    return _native.pinned_pool_stats(_devices.name_of(device))


def configure_emulated(index=0, **settings):
    """Sets up the emulated device ``emu:index``, a GPU stand-in in host memory with its
    own stream, for testing pipelines on machines without a GPU. Settings (all optional):
    ``capacity_bytes``, ``bandwidth_gbps``, ``latency_us``, ``fail_alloc`` (the Nth
    allocation from now fails), ``fail_copy`` (the Nth copy fails), ``fail_pin`` (the Nth
    buffer pinned from now is refused, as a locked-memory limit refuses it). The same keys are read
    from ``TENSORFERRY_EMU`` ("latency_us=20000,capacity_bytes=1000000") on first use.

    >>> import tensorferry as tf
    >>> tf.configure_emulated(0, latency_us=0)
    >>> tf.to_device({"x": [1.0, 2.0]}, "emu:0")["x"].device
    'emu:0'
    """
    text = ",".join(f"{k}={v}" for k, v in settings.items())
    _native.configure_emulated(int(index), text)


def devices():
    """The devices present, host first, e.g. ``["cpu"]`` or ``["cpu", "cuda:0"]``.

    >>> import tensorferry as tf
    >>> tf.devices()[0]
    'cpu'

    The emulated devices (``emu:0``, ``emu:1``) are always listed: they run the transfer
    engine in host memory.
    """
    return _native.devices()
