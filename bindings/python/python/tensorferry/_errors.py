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
