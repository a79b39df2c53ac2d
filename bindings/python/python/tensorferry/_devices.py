"""A device, however the caller names it, as tensorferry's string ("cpu", "cuda:1",
"emu:0"): a string, an int (a CUDA GPU's index, as PyTorch takes it), a ``torch.device``,
a JAX device, or a CuPy device. Frameworks are never imported here: an object is judged
by the module its type comes from.

With ``frameworks=True`` (``to_device``), devices that only their framework drives are
named too: "mps:0", "xpu:1", "xla:0", "hpu:0", "tpu:0", "rocm:0" (strings, or the
``torch.device`` and JAX device objects of those types); ``_fallback`` moves tensors onto
them through that framework's own copies."""

import re

from . import _native
from ._errors import InvalidDeviceError, TensorferryTypeError

_TAKES = 'a string ("cpu", "cuda:0", "emu:0"), a GPU index, a torch.device, a JAX or a CuPy device'


# The devices only a framework drives that ``to_device`` takes as targets.
FRAMEWORK_DEVICES = ("mps", "xpu", "xla", "hpu", "tpu", "rocm")
_FRAMEWORK_LIST = ", ".join(f'"{d}"' for d in FRAMEWORK_DEVICES)
_FRAMEWORK_NAME = re.compile(rf"({'|'.join(FRAMEWORK_DEVICES)})(?::(0|[1-9][0-9]{{0,8}}))?")


def name_of(device, frameworks=False):
    """The canonical name of ``device`` (checked: a malformed string is an
    :class:`InvalidDeviceError`; an object of another kind a :class:`TensorferryTypeError`).
    With ``frameworks``, a device only its framework drives ("mps" is "mps:0") is named too."""
    if isinstance(device, str):
        return _parse(device, frameworks)
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise TensorferryTypeError(f"device={device!r}: a GPU index is 0 or more")
        return f"cuda:{device}"
    module = type(device).__module__ or ""
    if module.startswith("torch"):
        index = device.index
        if device.type in ("cuda", "xpu") and index is None:  # PyTorch's current device there
            import torch

            backend = getattr(torch, device.type)
            index = backend.current_device() if backend.is_initialized() else 0
        return _parse(device.type if index is None else f"{device.type}:{index}", frameworks)
    if module.startswith(("jax", "jaxlib")) and hasattr(device, "platform"):
        platform = {"gpu": "cuda", "cuda": "cuda"}.get(device.platform, device.platform)
        return _parse("cpu" if platform == "cpu" else f"{platform}:{device.id}", frameworks)
    if module.startswith("cupy") and hasattr(device, "id"):
        return f"cuda:{device.id}"
    raise TensorferryTypeError(f"device={device!r}: tensorferry takes {_TAKES}, not {type(device).__name__}")


def _parse(name, frameworks):
    """``_native.parse_device(name)``; with ``frameworks``, a device only its framework
    drives is named too, and the error for a malformed name lists them."""
    try:
        return _native.parse_device(name)
    except InvalidDeviceError:
        if not frameworks:
            raise
    match = _FRAMEWORK_NAME.fullmatch(name)
    if match is None:
        raise InvalidDeviceError(
            f"invalid device \"{name}\": expected one of tensorferry's \"cpu\" (or \"cpu:0\"), \"cuda\", \"cuda:N\", \"emu\", "
            f"\"emu:N\", or a framework's {_FRAMEWORK_LIST} (each also as \"…:N\"; "
            "N = 0, 1, …)"
        )
    return f"{match.group(1)}:{match.group(2) or 0}"
