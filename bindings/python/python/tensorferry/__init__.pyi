"""Type stubs of the tensorferry package."""

from collections.abc import Iterator, KeysView, Mapping
from os import PathLike
from typing import Any, Callable, Generator, Generic, Literal, Optional, TypeVar, Union, final, overload

import numpy as np

__version__: str

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

# Names of the stubs alone (private: the package has no such attributes at run time).
_T = TypeVar("_T")
# A device: a string ("cpu", "cuda:0", "emu:0"), a GPU index, a torch.device, a JAX or a
# CuPy device (the frameworks' types are not imported by the stub: Any).
_Device = Union[str, int, Any]
_Path = Union[str, PathLike[str]]

class TensorferryError(Exception): ...
class FormatError(TensorferryError, ValueError): ...
class DeviceUnavailableError(TensorferryError, RuntimeError): ...
class OutOfMemoryError(TensorferryError, MemoryError, RuntimeError): ...
class InvalidDeviceError(TensorferryError, ValueError): ...
class TensorferryKeyError(TensorferryError, KeyError): ...
class TensorferryIOError(TensorferryError, OSError): ...
class TensorferryOverflowError(TensorferryError, OverflowError): ...
class TensorferryTypeError(TensorferryError, TypeError): ...
class ProcessGroupError(TensorferryError, RuntimeError): ...
class TensorferryRuntimeError(TensorferryError, RuntimeError): ...
class TensorferryBufferError(TensorferryError, BufferError): ...

class CopyError(TensorferryError, RuntimeError):
    device: str
    cause: str
    key: Optional[str]
    index: Optional[int]
    def __init__(self, device: str, cause: str, key: Optional[str] = None) -> None: ...

@final
class Tensor:
    """A tensor in host or device memory, shared with its views."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def ndim(self) -> int: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def is_contiguous(self) -> bool: ...
    @property
    def is_read_only(self) -> bool: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def is_ready(self) -> bool: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface (version 3) of a tensor in CUDA memory; tensors
        elsewhere have none (``hasattr`` is false)."""
    def wait(self) -> Tensor: ...
    def numpy(self) -> np.ndarray: ...
    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def __len__(self) -> int: ...
    def copy(self) -> Tensor: ...
    def to(self, device: _Device, *, copy: bool = False) -> Tensor: ...
    @staticmethod
    def from_dlpack(obj: Any) -> Tensor: ...
    @staticmethod
    def from_numpy(array: np.ndarray) -> Tensor: ...

_Staging = Union[Literal["auto", "off", "on"], tuple[int, int]]

class Transfer(Generic[_T]):
    def done(self) -> bool: ...
    def wait(self, timeout: Optional[float] = None) -> bool: ...
    def result(self, timeout: Optional[float] = None) -> _T: ...
    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]: ...
    def then(self, fn: Callable[[_T], Any]) -> Transfer[Any]: ...
    def __await__(self) -> Generator[Any, None, _T]: ...

_Like = Optional[Literal["numpy", "torch", "tensorferry", "jax", "tensorflow"]]

@overload
def to_host(
    obj: _T,
    *,
    non_blocking: Literal[False] = False,
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    copy: bool = False,
    pinned: bool = False,
) -> _T: ...
@overload
def to_host(
    obj: _T,
    *,
    non_blocking: Literal[True],
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    copy: bool = False,
    pinned: bool = False,
) -> Transfer[_T]: ...
@overload
def to_host(
    obj: _T,
    *,
    non_blocking: bool,
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    copy: bool = False,
    pinned: bool = False,
) -> Union[_T, Transfer[_T]]: ...
def pinned_pool_stats(device: _Device) -> dict[str, int]: ...
@overload
def to_numpy(obj: _T, *, non_blocking: Literal[False] = False, stream: Any = None, staging: _Staging = "auto") -> _T: ...
@overload
def to_numpy(obj: _T, *, non_blocking: Literal[True], stream: Any = None, staging: _Staging = "auto") -> Transfer[_T]: ...
@overload
def to_numpy(obj: _T, *, non_blocking: bool, stream: Any = None, staging: _Staging = "auto") -> Union[_T, Transfer[_T]]: ...
@overload
def to_device(
    obj: _T,
    device: _Device,
    *,
    non_blocking: Literal[False] = False,
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    copy: bool = False,
) -> _T: ...
@overload
def to_device(
    obj: _T,
    device: _Device,
    *,
    non_blocking: Literal[True],
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    copy: bool = False,
) -> Transfer[_T]: ...
@overload
def to_device(
    obj: _T,
    device: _Device,
    *,
    non_blocking: bool,
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    copy: bool = False,
) -> Union[_T, Transfer[_T]]: ...
@overload
def save(
    obj: Any,
    path: _Path,
    *,
    non_blocking: Literal[False] = False,
    stream: Any = None,
    staging: _Staging = "auto",
    metadata: Optional[dict[str, str]] = None,
    fsync: bool = True,
    max_shard_size: Union[int, str, None] = None,
    progress: bool = False,
) -> None: ...
@overload
def save(
    obj: Any,
    path: _Path,
    *,
    non_blocking: Literal[True],
    stream: Any = None,
    staging: _Staging = "auto",
    metadata: Optional[dict[str, str]] = None,
    fsync: bool = True,
    max_shard_size: Union[int, str, None] = None,
    progress: bool = False,
) -> Transfer[None]: ...
@overload
def save(
    obj: Any,
    path: _Path,
    *,
    non_blocking: bool,
    stream: Any = None,
    staging: _Staging = "auto",
    metadata: Optional[dict[str, str]] = None,
    fsync: bool = True,
    max_shard_size: Union[int, str, None] = None,
    progress: bool = False,
) -> Optional[Transfer[None]]: ...
@overload
def load(
    path: _Path,
    *,
    device: _Device = "cpu",
    non_blocking: Literal[False] = False,
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    mmap: bool = True,
    direct: bool = False,
    keys: Union[str, tuple[Any, ...], list[Union[str, tuple[Any, ...]]], None] = None,
    dtype: Any = None,
    out: Any = None,
    progress: bool = False,
    process_group: Any = None,
    shard: Optional[dict[Union[str, tuple[Any, ...]], Union[int, tuple[int, int]]]] = None,
    read_stats: Any = None,
) -> Any: ...
@overload
def load(
    path: _Path,
    *,
    device: _Device = "cpu",
    non_blocking: Literal[True],
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    mmap: bool = True,
    direct: bool = False,
    keys: Union[str, tuple[Any, ...], list[Union[str, tuple[Any, ...]]], None] = None,
    dtype: Any = None,
    out: Any = None,
    progress: bool = False,
    process_group: Any = None,
    shard: Optional[dict[Union[str, tuple[Any, ...]], Union[int, tuple[int, int]]]] = None,
    read_stats: Any = None,
) -> Transfer[Any]: ...
@overload
def load(
    path: _Path,
    *,
    device: _Device = "cpu",
    non_blocking: bool,
    stream: Any = None,
    staging: _Staging = "auto",
    like: _Like = None,
    mmap: bool = True,
    direct: bool = False,
    keys: Union[str, tuple[Any, ...], list[Union[str, tuple[Any, ...]]], None] = None,
    dtype: Any = None,
    out: Any = None,
    progress: bool = False,
    process_group: Any = None,
    shard: Optional[dict[Union[str, tuple[Any, ...]], Union[int, tuple[int, int]]]] = None,
    read_stats: Any = None,
) -> Any: ...
def metadata(path: _Path) -> dict[str, str]: ...
def devices() -> list[str]: ...
def configure_emulated(
    index: int = 0,
    *,
    capacity_bytes: int = ...,
    bandwidth_gbps: float = ...,
    latency_us: int = ...,
    fail_alloc: int = ...,
    fail_copy: int = ...,
) -> None: ...

class TensorDict(Mapping[Any, Any]):
    """A nested dictionary of tensors and plain values with one-call moves."""

    __hash__: None  # type: ignore[assignment]
    def __init__(
        self,
        obj: Optional[Mapping[str, Any]] = None,
        /,
        *,
        batch_size: Union[int, list[int], tuple[int, ...], None] = None,
        **kwargs: Any,
    ) -> None: ...
    @property
    def batch_size(self) -> tuple[int, ...]: ...
    @batch_size.setter
    def batch_size(self, value: Union[int, list[int], tuple[int, ...]]) -> None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def batch_dims(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __getitem__(self, key: Union[str, tuple[Any, ...]]) -> Any: ...
    def __setitem__(self, key: Union[str, tuple[Any, ...]], value: Any) -> None: ...
    def __delitem__(self, key: Union[str, tuple[Any, ...]]) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[str]: ...
    @overload
    def keys(self) -> KeysView[str]: ...
    @overload
    def keys(self, nested: bool) -> Any: ...
    def values(self) -> list[Any]: ...  # type: ignore[override]
    def items(self) -> list[tuple[str, Any]]: ...  # type: ignore[override]
    def get(self, key: Any, default: Any = None) -> Any: ...
    @overload
    def to(self, device: _Device, *, non_blocking: Literal[False] = False, copy: bool = False) -> TensorDict: ...
    @overload
    def to(self, device: _Device, *, non_blocking: bool, copy: bool = False) -> Union[TensorDict, Transfer[TensorDict]]: ...
    @overload
    def cpu(self, *, non_blocking: Literal[False] = False, pinned: bool = False) -> TensorDict: ...
    @overload
    def cpu(self, *, non_blocking: bool, pinned: bool = False) -> Union[TensorDict, Transfer[TensorDict]]: ...
    @overload
    def cuda(self, index: int = 0, *, non_blocking: Literal[False] = False) -> TensorDict: ...
    @overload
    def cuda(self, index: int = 0, *, non_blocking: bool) -> Union[TensorDict, Transfer[TensorDict]]: ...
    @overload
    def numpy(self, *, non_blocking: Literal[False] = False, **kwargs: Any) -> dict[str, Any]: ...
    @overload
    def numpy(self, *, non_blocking: Literal[True], **kwargs: Any) -> Transfer[dict[str, Any]]: ...
    def to_dict(self) -> dict[str, Any]: ...
    def consolidate(self) -> TensorDict: ...
    @overload
    def save(self, path: _Path, *, non_blocking: Literal[False] = False, **kwargs: Any) -> None: ...
    @overload
    def save(self, path: _Path, *, non_blocking: Literal[True], **kwargs: Any) -> Transfer[None]: ...
    @classmethod
    @overload
    def load(cls, path: _Path, *, non_blocking: Literal[False] = False, **kwargs: Any) -> TensorDict: ...
    @classmethod
    @overload
    def load(cls, path: _Path, *, non_blocking: Literal[True], **kwargs: Any) -> Transfer[TensorDict]: ...
    def wait(self) -> TensorDict: ...
    def is_ready(self) -> bool: ...
    @property
    def device(self) -> Optional[str]: ...
    @property
    def nbytes(self) -> int: ...
