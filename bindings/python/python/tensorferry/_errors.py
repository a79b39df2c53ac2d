"""The exception classes of tensorferry, one base and one class per kind of failure.

Each class also derives from the built-in exception it refines, so code that catches
``ValueError`` or ``MemoryError`` keeps working.
"""

import builtins


class TensorferryError(Exception):
    """Base class of every error tensorferry raises."""


class FormatError(TensorferryError, ValueError):
    """A file or a value that breaks the rules: a damaged safetensors file, a ragged
    list, a value that cannot be saved, a dtype the operation cannot hold."""


class DeviceUnavailableError(TensorferryError, RuntimeError):
    """A device that is absent or unusable here; the message says why."""


class CopyError(TensorferryError, RuntimeError):
    """A copy that failed on a device that is there (an injected fault, a driver error on
    the copy, a crash of the thread that ran it): not :class:`DeviceUnavailableError`, the
    device exists and other copies may well succeed. ``device`` is the device whose work
    failed (``"cuda:1"``, ``"emu:0"``), ``cause`` what went wrong, ``key`` the key path of a
    tensor the failed copy was filling, when the caller knows it (else ``None``). A copy
    fails as a batch: ``key`` names the tensor whose wait met the failure, and others
    filled by the same batch have failed too. ``index``, set by the native waits, is the
    position of that tensor among those waited for (``None`` otherwise).

    >>> from tensorferry import CopyError
    >>> e = CopyError("emu:0", "injected fault", key="model/w")
    >>> str(e)
    "a copy on emu:0 failed (filling 'model/w'): injected fault"
    >>> isinstance(e, RuntimeError), e.device, e.cause
    (True, 'emu:0', 'injected fault')
    """

    index = None

    def __init__(self, device, cause, key=None):
        super().__init__(device, cause, key)
        self.device = device
        self.cause = cause
        self.key = key

    def __str__(self):
        where = f" (filling {self.key!r})" if self.key is not None else ""
        return f"a copy on {self.device} failed{where}: {self.cause}"

    def __reduce__(self):
        return (type(self), (self.device, self.cause, self.key))


def naming_key(error, key):
    """``error`` (a :class:`CopyError` that names no key yet) as the same failure naming
    ``key``, the path of the tensor whose copy the caller waited for; any other error as it
    is. ``key`` may also be a sequence of the key paths of the tensors waited for, in
    order: the error's ``index`` picks one. Raise the result ``from None`` (the original
    says nothing more).

    >>> from tensorferry._errors import CopyError, naming_key
    >>> e = CopyError("emu:0", "injected fault")
    >>> e.index = 1
    >>> str(naming_key(e, ["a", "model/w"]))
    "a copy on emu:0 failed (filling 'model/w'): injected fault"
    """
    if not isinstance(error, CopyError) or error.key is not None:
        return error
    if not isinstance(key, str):
        if error.index is None or not 0 <= error.index < len(key):
            return error
        key = key[error.index]
    named = CopyError(error.device, error.cause, key)
    named.index = error.index
    named.__traceback__ = error.__traceback__
    return named


class OutOfMemoryError(TensorferryError, MemoryError, RuntimeError):
    """An allocation failed; the message gives the bytes asked and free. Also a
    ``RuntimeError``, as PyTorch's ``torch.OutOfMemoryError`` is: code written to catch a
    GPU running out of memory in PyTorch catches it too."""


class InvalidDeviceError(TensorferryError, ValueError):
    """A device string that is not one of the accepted forms."""


class TensorferryKeyError(TensorferryError, KeyError):
    """A key path that is not in the dictionary."""


class TensorferryIOError(TensorferryError, OSError):
    """An operating-system error while reading or writing a file: ``errno`` (an int, or
    ``None`` when the system gave no number, e.g. for a FIFO refused or a short read),
    ``strerror`` (what was done and what went wrong) and ``filename`` (the path)."""

    def __str__(self):
        # OSError would say "[Errno None] …" when there is no number.
        if self.errno is None and self.strerror is not None:
            if self.filename is None:
                return str(self.strerror)
            return f"{self.strerror}: {self.filename!r}"
        return super().__str__()


class ProcessGroupError(TensorferryError, RuntimeError):
    """A collective of a process-group load failed: a rank died, or the group timed out."""


class TensorferryTypeError(TensorferryError, TypeError):
    """An argument of the wrong type; the message names the argument and what it takes."""


class TensorferryRuntimeError(TensorferryError, RuntimeError):
    """A failure of the run rather than of its inputs: a structure another thread changed
    during a call, a thread the system would not start, an internal error (please report
    it)."""


class TensorferryBufferError(TensorferryError, BufferError):
    """Memory that cannot be lent or read as asked: a tensor whose memory the buffer
    protocol cannot describe, a writable view of read-only memory."""


class TensorferryOverflowError(TensorferryError, OverflowError):
    """A number that does not fit the type it must become: an integer beyond int64, a
    finite float beyond float32's range."""


_IO_CLASSES = {}


def _io_class(builtin):
    """The :class:`TensorferryIOError` that is also ``builtin`` (an ``OSError``
    subclass), made once."""
    cls = _IO_CLASSES.get(builtin)
    if cls is None:
        if builtin is OSError:
            cls = TensorferryIOError
        else:
            cls = type(
                f"Tensorferry{builtin.__name__}",
                (TensorferryIOError, builtin),
                {"__doc__": f"A {builtin.__name__} raised by tensorferry.", "__module__": __name__},
            )
        _IO_CLASSES[builtin] = cls
    return cls


def __getattr__(name):
    # ``tensorferry._errors.TensorferryFileExistsError`` and its kin, made on first use:
    # pickle finds them by name (an error sent between processes, as DCP gathers them).
    builtin = getattr(builtins, name.removeprefix("Tensorferry"), None) if name.startswith("Tensorferry") else None
    if isinstance(builtin, type) and issubclass(builtin, OSError) and builtin is not OSError:
        return _io_class(builtin)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def io_error(errno, strerror, filename):
    """The exception for an operating-system error: a :class:`TensorferryIOError` that is
    also the built-in ``OSError`` subclass Python picks for ``errno``
    (``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``, …), with
    ``errno``, ``strerror`` and ``filename`` set. ``errno`` is ``None`` for a failure
    the system did not number: a plain ``TensorferryIOError``, the attributes the same.

    >>> from tensorferry._errors import io_error
    >>> e = io_error(2, "open: No such file or directory", "/nowhere")
    >>> isinstance(e, FileNotFoundError), isinstance(e, TensorferryError), e.errno, e.filename
    (True, True, 2, '/nowhere')
    >>> e = io_error(None, "open: is a FIFO, not a regular file", "/tmp/pipe")
    >>> e.errno, e.strerror, e.filename
    (None, 'open: is a FIFO, not a regular file', '/tmp/pipe')
    >>> str(e)
    "open: is a FIFO, not a regular file: '/tmp/pipe'"
    """
    builtin = type(OSError(errno, strerror)) if errno is not None else OSError
    cls = _io_class(builtin)
    # Always the three-argument form: with two, OSError reads them as (errno, strerror).
    return cls(errno, strerror, filename)
