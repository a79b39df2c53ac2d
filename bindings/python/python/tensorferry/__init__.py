"""tensorferry: move whole dictionaries of tensors between GPU memory, host memory and
safetensors files, fast, safely, whatever framework made the tensors.

>>> import numpy as np, tensorferry as tf
>>> state = {"model": {"layer.0.weight": np.ones((2, 2), np.float32)}, "step": 10, "tag": "run-1"}
>>> host = tf.to_host(state, copy=True)
>>> host["tag"] is state["tag"]
True
"""

from . import _native
from ._api import (
    configure_emulated,
    devices,
    load,
    metadata,
    pinned_pool_stats,
    save,
    to_device,
    to_host,
    to_numpy,
)
from ._errors import (
    CopyError,
    DeviceUnavailableError,
    FormatError,
    InvalidDeviceError,
    OutOfMemoryError,
    ProcessGroupError,
    TensorferryError,
    TensorferryIOError,
    TensorferryBufferError,
    TensorferryKeyError,
    TensorferryOverflowError,
    TensorferryRuntimeError,
    TensorferryTypeError,
)
from ._tensordict import TensorDict
from ._transfer import Transfer

Tensor = _native.Tensor
__version__ = _native.__version__

__all__ = [
    "CopyError",
    "DeviceUnavailableError",
    "FormatError",
    "InvalidDeviceError",
    "OutOfMemoryError",
    "ProcessGroupError",
    "Tensor",
    "TensorDict",
    "TensorferryBufferError",
    "TensorferryError",
    "TensorferryIOError",
    "TensorferryKeyError",
    "TensorferryOverflowError",
    "TensorferryRuntimeError",
    "TensorferryTypeError",
    "Transfer",
    "__version__",
    "configure_emulated",
    "devices",
    "load",
    "metadata",
    "pinned_pool_stats",
    "save",
    "to_device",
    "to_host",
    "to_numpy",
]
