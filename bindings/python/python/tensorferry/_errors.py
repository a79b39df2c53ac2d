"""The exception classes of tensorferry, one base and one class per kind of failure.

Each class also derives from the built-in exception it refines, so code that catches
``ValueError`` or ``MemoryError`` keeps working.
"""


class TensorferryError(Exception):
    """Base class of every error tensorferry raises."""


class FormatError(TensorferryError, ValueError):
    """A file or a value that breaks the rules: a damaged safetensors file, a ragged
    list, a value that cannot be saved, a dtype the operation cannot hold."""


class DeviceUnavailableError(TensorferryError, RuntimeError):
    """A device that is absent or unusable here; the message says why."""


class OutOfMemoryError(TensorferryError, MemoryError):
    """An allocation failed; the message gives the bytes asked and free."""


class InvalidDeviceError(TensorferryError, ValueError):
    """A device string that is not one of the accepted forms."""


class TensorferryKeyError(TensorferryError, KeyError):
    """A key path that is not in the dictionary."""


class TensorferryIOError(TensorferryError, OSError):
    """An operating-system error while reading or writing a file."""


class TensorferryOverflowError(TensorferryError, OverflowError):
    """A number that does not fit the type it must become: an integer beyond int64, a
    finite float beyond float32's range."""


_IO_CLASSES = {}


def io_error(errno, strerror, filename):
    """The exception for an operating-system error: a :class:`TensorferryIOError` that is
    also the built-in ``OSError`` subclass Python picks for ``errno``
    (``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``, …), with
    ``errno``, ``strerror`` and ``filename`` set.

    >>> from tensorferry._errors import io_error
    >>> e = io_error(2, "open: No such file or directory", "/nowhere")
    >>> isinstance(e, FileNotFoundError), isinstance(e, TensorferryError), e.errno, e.filename
    (True, True, 2, '/nowhere')
    """
    builtin = type(OSError(errno, strerror)) if errno else OSError
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
    return cls(errno, strerror, filename) if errno else cls(strerror, filename)
