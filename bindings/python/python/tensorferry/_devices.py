"""A device, however the caller names it, as tensorferry's string ("cpu", "cuda:1",
"emu:0"): a string, an int (a CUDA GPU's index, as PyTorch takes it), a ``torch.device``,
a JAX device, or a CuPy device. Frameworks are never imported here: an object is judged
by the module its type comes from."""

from . import _native
from ._errors import TensorferryTypeError

_TAKES = 'a string ("cpu", "cuda:0", "emu:0"), a GPU index, a torch.device, a JAX or a CuPy device'


def name_of(device):
    """The canonical name of ``device`` (checked: a malformed string is an
    :class:`InvalidDeviceError`; an object of another kind a :class:`TensorferryTypeError`)."""
    if isinstance(device, str):
        return _native.parse_device(device)
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise TensorferryTypeError(f"device={device!r}: a GPU index is 0 or more")
        return f"cuda:{device}"
    module = type(device).__module__ or ""
    if module.startswith("torch"):
        index = device.index
        if device.type == "cuda" and index is None:
            import torch

            index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return _native.parse_device(device.type if index is None else f"{device.type}:{index}")
    if module.startswith(("jax", "jaxlib")) and hasattr(device, "platform"):
        platform = {"gpu": "cuda", "cuda": "cuda"}.get(device.platform, device.platform)
        return _native.parse_device("cpu" if platform == "cpu" else f"{platform}:{device.id}")
    if module.startswith("cupy") and hasattr(device, "id"):
        return f"cuda:{device.id}"
    raise TensorferryTypeError(f"device={device!r}: tensorferry takes {_TAKES}, not {type(device).__name__}")
