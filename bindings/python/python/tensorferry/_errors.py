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


class TensorferryOverflowError(TensorferryError, OverflowError):
    """A number that does not fit the type it must become: an integer beyond int64, a
    finite float beyond float32's range."""


_IO_CLASSES = {}


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
    # Always the three-argument form: with two, OSError reads them as (errno, strerror).
    return cls(errno, strerror, filename)
