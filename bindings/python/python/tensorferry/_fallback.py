"""Leaves on devices tensorferry's engine does not drive, moved by their framework's own copies.

tensorferry's engine copies between the host, CUDA GPUs and its emulated devices. A tensor
anywhere else — an AMD GPU under ROCm (which PyTorch's ROCm builds call "cuda"), Apple's MPS,
a TPU, an XLA, oneAPI (XPU) or Gaudi (HPU) device, any DLPack device type but CPU and CUDA —
is copied by the framework it belongs to, in the same call as the rest of its dictionary:

- PyTorch: ``Tensor.to(device)``; with ``non_blocking``, into pinned host memory where
  PyTorch can pin it, then the device's own synchronisation before the result is handed out.
- JAX: ``jax.device_put`` onto the host's CPU device (``jax.device_get`` where JAX has none),
  ``block_until_ready`` before the result is handed out.
- TensorFlow: ``tf.identity`` under ``tf.device("/CPU:0")``.
- CuPy: ``ndarray.get()`` (a ROCm build of CuPy reports kDLROCM).
- Any other DLPack producer: the DLPack 1.0 cross-device copy,
  ``__dlpack__(dl_device=(kDLCPU, 0), copy=True, max_version=(1, 0))`` (what
  ``numpy.from_dlpack(x, device="cpu", copy=True)`` asks for), whose producer synchronises
  before it returns; the capsule becomes a host ``tensorferry.Tensor``.

The tree's rules are the engine's: results are copies (such a leaf is never already where
it goes: targets are the engine's devices), in the leaf's framework; a tensor under several
keys is copied once; errors name the key and the device. What only the engine has — its
pinned pool (``pinned=True``) and its staging ring (``staging="on"`` or a size) — is refused
for such leaves with a :class:`DeviceUnavailableError` that names the fallback. Results on an
engine device other than the host (``to_device(d, "emu:0")`` of a TPU leaf) cross the host:
the framework's copy first, then the engine's. Moving leaves onto devices the engine does
not drive (``to_device(d, "mps")``) is the frameworks' own business: tensorferry's device
names are the engine's.

None of this has run on ROCm, MPS, TPU, XLA or oneAPI hardware: the tests use stand-ins that
report those devices as the real producers do (``tests/test_other_devices.py``).
"""

import sys

import numpy as np

from . import _frameworks as fw
from . import _native
from ._errors import DeviceUnavailableError, FormatError
from ._tree import shown


def off_engine(leaf, kind):
    """The device of ``leaf`` when the engine does not drive it, else None. A meta tensor
    holds no memory: it is left to the engine, which names it."""
    if kind is None or kind == fw.NUMPY or kind == fw.NATIVE:
        return None
    device = fw.device_of(leaf, kind)
    if fw.engine_drives(device) or device.startswith("meta:"):
        return None
    return device


def split(leaves):
    """``(the engine's [(path, leaf)], the fallback's [(path, leaf, kind, device)])``. The
    common leaves (NumPy arrays, tensorferry tensors, PyTorch tensors on the host or on
    CUDA) are told by their exact type, at tens of nanoseconds each."""
    torch = sys.modules.get("torch")
    torch_tensor, parameter = (torch.Tensor, torch.nn.Parameter) if torch is not None else (None, None)
    rocm = torch is not None and fw._torch_is_rocm()
    ndarray, native = np.ndarray, fw.Tensor
    other = []
    for path, leaf in leaves:
        t = type(leaf)
        if t is torch_tensor or t is parameter:
            if leaf.is_cpu or (leaf.is_cuda and not rocm):
                continue
        elif t is ndarray or t is native:
            continue
        kind = fw.kind_of(leaf)
        device = off_engine(leaf, kind)
        if device is not None:
            other.append((path, leaf, kind, device))
    if not other:
        return leaves, []
    taken = {id(leaf) for _, leaf, _, _ in other}
    return [(p, x) for p, x in leaves if id(x) not in taken], other


def start(leaves, target, non_blocking, pinned=False, staging=None):
    """Takes the leaves of ``[(path, leaf)]`` the engine cannot move and starts their
    frameworks' copies to ``target`` (an engine device, never theirs: the results are
    always copies): ``(the engine's leaves, Started or None)``."""
    leaves, other = split(leaves)
    if not other:
        return leaves, None
    _refuse_engine_options(other, pinned, staging)
    return leaves, Started(other, target, non_blocking)


def _refuse_engine_options(other, pinned, staging):
    """A :class:`DeviceUnavailableError` for what only the engine gives (its pinned pool, a
    staging ring asked for), naming the first such leaf, its device and the fallback."""
    path, _, kind, device = other[0]
    where = f"the value at {shown(path)!r} lives on {device}, which tensorferry's engine does not drive"
    how = f"it moves through {_NAMES.get(kind, kind)}'s own copies instead (tensorferry's fallback)"
    if pinned:
        raise DeviceUnavailableError(
            f"pinned=True asks for tensorferry's pinned pool, which only its engine fills (cpu, cuda, emu); "
            f"{where}: {how}. Drop pinned=True for it"
        )
    if staging not in (None, "auto", "off"):
        raise DeviceUnavailableError(
            f"staging={staging!r} asks for tensorferry's staging ring, which only its engine runs (cpu, cuda, "
            f"emu); {where}: {how}. Use staging='auto' or 'off' for it"
        )


_NAMES = {
    fw.TORCH: "PyTorch", fw.JAX: "JAX", fw.TENSORFLOW: "TensorFlow", fw.CUPY: "CuPy", fw.DLPACK: "its DLPack producer",
}


class Started:
    """The frameworks' copies of some leaves to one target, started: copies a framework
    makes asynchronously are queued, the others made. :meth:`results` hands them out once
    the frameworks say they have finished, so that nothing reads them early."""

    def __init__(self, items, target, non_blocking):
        self.leaves = [leaf for _, leaf, _, _ in items]
        self._target = target
        self._waits = {}  # what to wait for before the results exist: (path, device, kind, wait)
        self._results = {}
        hop = []  # (leaf, path, kind, host result): crosses to an engine device after the wait
        seen = set()
        for path, leaf, kind, device in items:
            if id(leaf) in seen:
                continue  # one tensor under several keys: one copy, as the engine makes
            seen.add(id(leaf))
            result, wait = _framework_call(path, device, kind, lambda: _to_host(leaf, kind, device, non_blocking))
            if wait is not None:
                # PyTorch waits once per device; JAX once per array.
                self._waits.setdefault(device if kind == fw.TORCH else id(result), (path, device, kind, wait))
            if target == "cpu":
                self._results[id(leaf)] = result
            else:
                hop.append((leaf, path, kind, result))
        self._hop = hop

    def results(self):
        """``{id(leaf): result}``, after every framework copy has finished."""
        for path, device, kind, wait in self._waits.values():
            _framework_call(path, device, kind, wait)
        self._waits = {}
        if self._hop:
            self._results.update(_onto_engine_device(self._hop, self._target))
            self._hop = []
        return self._results


def _framework_call(path, device, kind, call):
    """``call()``, a framework's failure raised as a :class:`DeviceUnavailableError` naming
    the key, the device and the framework."""
    try:
        return call()
    except (FormatError, DeviceUnavailableError):
        raise
    except Exception as e:
        raise DeviceUnavailableError(
            f"cannot move the value at {shown(path)!r} from {device}: {_NAMES.get(kind, kind)} "
            f"refused the copy ({type(e).__name__}: {e})"
        ) from e


def _to_host(leaf, kind, device, non_blocking):
    """``(a host copy of leaf in its framework, None or what waits for it)``: NumPy for
    CuPy leaves, ``tensorferry.Tensor`` for other DLPack producers."""
    if kind == fw.TORCH:
        return _torch_to_host(leaf, device, non_blocking)
    if kind == fw.JAX:
        return _jax_to_host(leaf)
    if kind == fw.TENSORFLOW:
        import tensorflow as tf

        with tf.device("/CPU:0"):
            return tf.identity(leaf), None
    if kind == fw.CUPY:
        return leaf.get(), None  # waits for CuPy's current stream
    return _dlpack_to_host(leaf), None  # the producer synchronised


def _torch_to_host(leaf, device, non_blocking):
    torch = sys.modules["torch"]
    with torch.no_grad():
        if not non_blocking:
            return leaf.to("cpu"), None
        try:
            # Pinned memory, where PyTorch can pin (ROCm, CUDA builds): the copy runs
            # asynchronously from it.
            out = torch.empty(tuple(leaf.shape), dtype=leaf.dtype, pin_memory=True)
            out.copy_(leaf, non_blocking=True)
        except (RuntimeError, TypeError):
            out = leaf.to("cpu", non_blocking=True)
    return out, lambda: _torch_synchronize(torch, device)


def _torch_synchronize(torch, device):
    """Waits for the work PyTorch queued on ``device`` ("rocm:0" — ``torch.cuda`` in a ROCm
    build —, "mps:0", "xpu:1", …)."""
    kind, _, index = device.partition(":")
    module = getattr(torch, "cuda" if kind == "rocm" else kind, None)
    sync = getattr(module, "synchronize", None)
    if sync is None:
        return  # a backend without one (XLA) copies to the host synchronously
    try:
        sync(int(index or 0))
    except TypeError:
        sync()  # torch.mps.synchronize takes no device


def _jax_to_host(leaf):
    jax = sys.modules["jax"]
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        return jax.device_get(leaf), None  # no CPU backend in this process: a NumPy array
    try:
        out = jax.device_put(leaf, cpu, may_alias=False)
    except TypeError:  # JAX before may_alias
        out = jax.device_put(leaf, cpu)
    return out, out.block_until_ready


# DLPack's kDLCPU, as a (device type, index) pair for ``__dlpack__(dl_device=…)``.
_DL_CPU = (1, 0)


def _dlpack_to_host(leaf):
    """The DLPack 1.0 cross-device copy: the producer copies to the host and synchronises
    before it returns the capsule (the array API's ``__dlpack__`` with ``dl_device``)."""
    capsule = leaf.__dlpack__(dl_device=_DL_CPU, copy=True, max_version=(1, 0))
    return _native.from_dlpack_capsules([capsule])[0]


def _onto_engine_device(hop, target):
    """The host results of ``hop`` (``[(leaf, path, kind, host result)]``) moved to the
    engine device ``target``, in their frameworks where those hold its memory."""
    host = [r for _, _, _, r in hop]
    kinds = [fw.kind_of(r) for r in host]
    paths = [p for _, p, _, _ in hop]
    moved = _native.move_tensors(fw.to_native_many(host, kinds, paths), target, True, False, False, "off")
    if target.startswith("emu"):
        kinds = [fw.NATIVE] * len(kinds)  # no framework holds emulated memory
    else:
        kinds = [fw.NATIVE if k in (fw.NUMPY, fw.DLPACK, fw.CAI) else k for k in kinds]
    return {id(leaf): r for (leaf, _, _, _), r in zip(hop, fw.from_native_many(moved, kinds, paths))}


def on_host(tensors, kinds, paths):
    """``(tensors, kinds)`` with every leaf off the engine's devices replaced by a host copy
    from its framework (and that copy's kind), for a writer that reads host and engine
    memory only."""
    other = split(list(zip(paths, tensors)))[1]
    if not other:
        return tensors, kinds
    hosted = Started(other, "cpu", False).results()
    copies = [hosted.get(id(t), t) for t in tensors]
    return copies, [fw.kind_of(c) if c is not t else k for c, t, k in zip(copies, tensors, kinds)]


def on_host_tree(obj):
    """``obj`` with every leaf off the engine's devices replaced by a host copy from its
    framework (``obj`` itself when there is none)."""
    other = split(_native.collect_tensors(obj, fw.kind_of))[1]
    if not other:
        return obj
    return _native.rebuild(obj, Started(other, "cpu", False).results(), False)


def ensure_device(target):
    """``_native.ensure_device(target)``; where PyTorch is a ROCm build, the error for an
    absent CUDA GPU says that its "cuda" GPUs are AMD GPUs, which only the fallback reaches
    (and only to move tensors off them)."""
    try:
        return _native.ensure_device(target)
    except DeviceUnavailableError as e:
        if not (target.startswith("cuda") and fw._torch_is_rocm()):
            raise
        raise DeviceUnavailableError(
            f"{e}. PyTorch here is a ROCm build: its \"cuda\" GPUs are AMD GPUs, which tensorferry's engine "
            "does not drive (it drives CUDA). Its fallback moves tensors off them through PyTorch's own copies "
            "(to_host, to_numpy, save); to put tensors on them, use PyTorch (tensor.to('cuda'))"
        ) from None
