"""Leaves on devices tensorferry's engine does not drive, moved by their framework's own copies.

A tensor on a ROCm GPU (PyTorch's ROCm builds call it "cuda"), MPS, TPU, XLA, XPU, HPU or any
DLPack device but CPU and CUDA is copied by its framework, in the same call as the rest of
its dictionary: PyTorch ``Tensor.to`` (pinned where it can pin, with ``non_blocking``), JAX
``jax.device_put``/``jax.device_get`` and ``block_until_ready``, TensorFlow ``tf.identity``
under ``tf.device``, CuPy ``ndarray.get()``, any other producer DLPack 1.0's
``__dlpack__(dl_device=(kDLCPU, 0), copy=True)``. Each result is synchronised before it is
handed out. The tree's rules are the engine's: results are copies in the leaf's framework, a
tensor under several keys is copied once, errors name the key and the device; ``pinned=True``
and the staging ring are refused for such leaves with a :class:`DeviceUnavailableError`.
Results bound for another engine device cross the host.

:func:`onto` puts a dictionary onto such a device for ``to_device``: "mps", "xpu:N",
"xla:N", "hpu:N" and "rocm:N" through PyTorch, "tpu:N" through JAX (TensorFlow leaves through
``tf.identity``); leaves of other frameworks cross into the owning one on the host first.

None of this has run on such hardware: the tests use stand-ins that report those devices as
the real producers do (``tests/test_other_devices.py``).
"""

import sys

import numpy as np

from . import _frameworks as fw
from . import _native
from ._data import data_to_tensor, numeric_data
from ._errors import DeviceUnavailableError, FormatError
from ._transfer import Transfer
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
    _refuse(pinned, staging, where, how)


def _refuse(pinned, staging, where, how):
    """The refusal of :func:`_refuse_engine_options`, ``where`` saying which device the
    engine does not drive and ``how`` what moves the tensors instead."""
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


def _framework_call(path, device, kind, call, direction="from"):
    """``call()``, a framework's failure raised as a :class:`DeviceUnavailableError` naming
    the key, the device (the copy's source, or with ``direction="onto"`` its target) and
    the framework."""
    try:
        return call()
    except (FormatError, DeviceUnavailableError):
        raise
    except Exception as e:
        raise DeviceUnavailableError(
            f"cannot move the value at {shown(path)!r} {direction} {device}: {_NAMES.get(kind, kind)} "
            f"refused the copy ({type(e).__name__}: {_first_line(e)})"
        ) from e


def _first_line(error):
    """The first line of a framework's message (PyTorch's dispatcher errors run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else text


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
    if kind == "xla" and "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # XLA's: waits for every device's pending work
        return
    module = getattr(torch, "cuda" if kind == "rocm" else kind, None)
    sync = getattr(module, "synchronize", None)
    if sync is None:
        return  # a backend without one copies synchronously
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
    (as "rocm:N" for ``to_device``)."""
    try:
        return _native.ensure_device(target)
    except DeviceUnavailableError as e:
        if not (target.startswith("cuda") and fw._torch_is_rocm()):
            raise
        raise DeviceUnavailableError(
            f"{e}. PyTorch here is a ROCm build: its \"cuda\" GPUs are AMD GPUs, which tensorferry's engine "
            "does not drive (it drives CUDA). Its fallback moves tensors off them through PyTorch's own copies "
            f"(to_host, to_numpy, save), and onto them with to_device(obj, \"rocm:{target.partition(':')[2] or 0}\")"
        ) from None


# -- onto a device only its framework drives (to_device) ----------------------------------

# The framework that owns each such device: PyTorch's backends, and JAX's TPUs.
_OWNERS = {"mps": fw.TORCH, "xpu": fw.TORCH, "xla": fw.TORCH, "hpu": fw.TORCH, "rocm": fw.TORCH, "tpu": fw.JAX}


def owner_of(target):
    """The framework that owns the device ``target`` ("mps:0", "tpu:1", …; see
    ``_devices.FRAMEWORK_DEVICES``), or None for the engine's devices."""
    return _OWNERS.get(target.partition(":")[0])


def onto(obj, target, *, non_blocking, like, copy, staging):
    """``to_device(obj, target)`` onto a device only its framework drives: every tensor
    leaf and list of numbers uploaded by that framework (TensorFlow leaves onto a TPU by
    TensorFlow, unless ``like="jax"``), non-tensors kept as the very objects. Leaves
    already there are kept unless ``copy``. With ``non_blocking``, a :class:`Transfer`
    whose result comes after the framework's own completion."""
    owner = owner_of(target)
    if like not in (None, owner):
        raise FormatError(
            f"like={like!r} cannot hold memory of {target}: tensors there are {_NAMES[owner]}'s "
            f"(like=None or like={owner!r})"
        )
    how = f"tensors move onto it through {_NAMES[owner]}'s own copies instead (tensorferry's fallback)"
    _refuse(False, staging, f"{target} is a device tensorferry's engine does not drive", how)
    if not fw.importable(owner):
        raise DeviceUnavailableError(f"{target} is {_NAMES[owner]}'s device, and {_NAMES[owner]} is not installed")
    upload = _Upload(target, owner, non_blocking, copy, like)
    leaves = _native.collect_tensors(obj, fw.kind_of, False, lambda x, _: fw.kind_of(x) is not None or numeric_data(x))
    tree = _native.rebuild(obj, upload.run(leaves), False, fw.kind_of)
    if not non_blocking:
        upload.wait()
        return tree

    def finish():
        upload.wait()
        return tree

    return Transfer([], finish)


class _Upload:
    """The uploads of one ``to_device`` onto ``target``, and what waits for them."""

    def __init__(self, target, owner, non_blocking, copy, like):
        self.target, self.owner = target, owner
        self.non_blocking, self.copy, self.like = non_blocking, copy, like
        self._waits = {}  # (path, framework, wait) by what it waits for
        self._sources = []  # host copies the frameworks may still read until the waits
        self._crossed = set()  # their ids
        self._devices = {}  # framework: its device object of the target

    def run(self, leaves):
        """``{id(leaf): result}`` for ``[(path, leaf)]`` (one upload per distinct leaf)."""
        direct, crossing, seen = [], [], set()
        for path, leaf in leaves:
            if id(leaf) in seen:
                continue  # one tensor under several keys: one copy
            seen.add(id(leaf))
            kind = fw.kind_of(leaf)
            if kind == self.owner or (kind == fw.TENSORFLOW and self.owner == fw.JAX and self.like is None):
                direct.append((path, leaf, kind, leaf))
            else:
                crossing.append((path, leaf))
        return {id(leaf): self._one(path, kind, tensor) for path, leaf, kind, tensor in direct + self._cross(crossing)}

    def _cross(self, leaves):
        """``[(path, leaf, owner, host tensor of the owner)]`` for leaves of other frameworks
        and lists of numbers: host copies from their frameworks where the engine does not
        drive their device, the engine's host copies of emulated ones, DLPack to the owner."""
        if not leaves:
            return []
        paths = [p for p, _ in leaves]
        tensors = [data_to_tensor(x, p) if fw.kind_of(x) is None else x for p, x in leaves]
        kinds = [fw.kind_of(t) for t in tensors]
        tensors, kinds = on_host(tensors, kinds, paths)
        natives = fw.to_native_many(tensors, kinds, paths)
        host = _native.move_tensors(natives, "cpu", False, False, False, "off")
        owned = fw.from_native_many(host, [self.owner] * len(host), paths)
        self._sources += owned
        self._crossed.update(id(t) for t in owned)
        return [(p, leaf, self.owner, t) for (p, leaf), t in zip(leaves, owned)]

    def _one(self, path, kind, tensor):
        """The upload of one tensor of framework ``kind``, its wait recorded."""
        result = _framework_call(path, self.target, kind, lambda: self._put(kind, tensor), "onto")
        if kind == fw.JAX:
            self._waits[id(result)] = (path, kind, result.block_until_ready)  # JAX waits per array
        elif kind == fw.TORCH:
            torch = sys.modules["torch"]
            self._waits.setdefault(kind, (path, kind, lambda: _torch_synchronize(torch, self.target)))
        else:
            self._waits.setdefault(kind, (path, kind, _tf_sync_devices))
        return result

    def _put(self, kind, tensor):
        if kind == fw.TORCH:
            return _torch_onto(tensor, self._device(kind), self.non_blocking, self.copy)
        if kind == fw.JAX:
            # Tensors crossed from other frameworks are temporaries: never aliased.
            return _jax_onto(tensor, self._device(kind), not (self.copy or id(tensor) in self._crossed))
        return _tf_onto(tensor, self.target)

    def _device(self, kind):
        """The framework's device object of the target, found once."""
        if kind not in self._devices:
            self._devices[kind] = _torch_device(self.target) if kind == fw.TORCH else _jax_device_of(self.target)
        return self._devices[kind]

    def wait(self):
        """Waits for every upload by its framework's own completion."""
        for path, kind, wait in self._waits.values():
            if kind != fw.TORCH or self.non_blocking:  # PyTorch's blocking uploads have read their source
                _framework_call(path, self.target, kind, wait, "onto")
        self._waits, self._sources, self._crossed = {}, [], set()


def _torch_device(target):
    """The ``torch.device`` of ``target``: "rocm:N" is "cuda:N" in PyTorch's ROCm build."""
    torch = sys.modules["torch"]
    kind, _, index = target.partition(":")
    if kind == "rocm":
        if not fw._torch_is_rocm():
            raise DeviceUnavailableError(
                f"{target} is an AMD GPU, which PyTorch reaches in its ROCm build; this PyTorch "
                f"({torch.__version__}) is not one (torch.version.hip is None)"
            )
        kind = "cuda"
    return torch.device(kind, int(index))


def _torch_onto(tensor, device, non_blocking, copy):
    """``tensor.to(device)``; with ``non_blocking``, a host tensor is first copied into
    pinned memory where PyTorch can pin (ROCm, XPU), from which the upload runs
    asynchronously."""
    torch = sys.modules["torch"]
    with torch.no_grad():
        if non_blocking and tensor.is_cpu:
            try:
                tensor = tensor.pin_memory()
            except RuntimeError:
                pass  # no pinned memory for this backend (MPS, XLA): PyTorch's own rules
        return tensor.to(device, non_blocking=non_blocking, copy=copy)


def _jax_device_of(target):
    """JAX's device of ``target`` ("tpu:N": the TPU whose id is N)."""
    jax = sys.modules.get("jax") or __import__("jax")
    platform, _, index = target.partition(":")
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise DeviceUnavailableError(f"{target}: JAX has no {platform} backend in this process ({e})") from None
    for device in devices:
        if device.id == int(index):
            return device
    raise DeviceUnavailableError(
        f"{target}: JAX has no {platform} device {index} (its {platform} devices: {[d.id for d in devices]})"
    )


def _jax_onto(array, device, may_alias):
    jax = sys.modules["jax"]
    try:
        return jax.device_put(array, device, may_alias=None if may_alias else False)
    except TypeError:  # JAX before may_alias
        return jax.device_put(array, device)


def _tf_onto(tensor, target):
    import tensorflow as tf

    platform, _, index = target.partition(":")
    with tf.device(f"/{platform.upper()}:{index}"):
        return tf.identity(tensor)


def _tf_sync_devices():
    import tensorflow as tf

    tf.test.experimental.sync_devices()
