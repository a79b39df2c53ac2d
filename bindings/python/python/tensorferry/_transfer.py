"""``Transfer``: the handle of a non-blocking move whose results cannot wait by themselves.

A ``tensorferry.Tensor`` waits for its copy on every read, so non-blocking moves that give
tensorferry tensors (to a device, or of tensorferry tensors) return the structure at
once. PyTorch CPU tensors, NumPy arrays, JAX and TensorFlow host arrays cannot wait: a
non-blocking move that gives those returns a ``Transfer``, a future in the style of
``concurrent.futures.Future``, and the tensors exist only once their copies have finished.
"""

import asyncio
import concurrent.futures
import threading
import time

from . import _native

_UNSET = object()


class Transfer:
    """A move in flight. Its results exist once every copy has finished, so nothing can
    read them early; waits can be interrupted with Ctrl-C (the copies go on).

    >>> import numpy as np, tensorferry as tf
    >>> on_device = tf.to_device({"w": np.arange(3.0), "step": 7}, "emu:0")
    >>> pending = tf.to_numpy(on_device, non_blocking=True)   # returns at once
    >>> pending.result()                                     # waits, then converts
    {'w': array([0., 1., 2.]), 'step': 7}
    >>> pending.done()
    True
    """

    __slots__ = ("_pending", "_finish", "_background", "_lock", "_value", "_error")

    def __init__(self, pending, finish, background=None):
        self._pending = list(pending)
        self._finish = finish
        self._background = background  # a concurrent.futures.Future doing the rest, if any
        self._lock = threading.Lock()
        self._value = _UNSET
        self._error = None

    def done(self):
        """True when every copy has finished, successfully or not (never blocks)."""
        if self._value is not _UNSET or self._error is not None:
            return True
        return all(t.is_ready for t in self._pending) and (self._background is None or self._background.done())

    def wait(self, timeout=None):
        """Waits for the copies (at most ``timeout`` seconds); True when they have
        finished. A failed copy raises its error here, as in :meth:`result`."""
        if self._error is not None:
            raise self._error
        start = time.monotonic()
        if not _native.wait_tensors(self._pending, timeout):
            return False
        if self._background is not None:
            # In slices, so that Ctrl-C is noticed between them.
            while True:
                left = None if timeout is None else timeout - (time.monotonic() - start)
                if left is not None and left <= 0 and not self._background.done():
                    return False
                try:
                    error = self._background.exception(0.05 if left is None else min(0.05, max(left, 0)))
                except concurrent.futures.TimeoutError:
                    continue
                if error is not None:
                    raise error
                break
        return True

    def result(self, timeout=None):
        """The moved structure, after waiting for the copies (raises ``TimeoutError`` if
        they have not finished within ``timeout`` seconds, and a failed copy's error)."""
        if self._value is not _UNSET:
            return self._value
        if self._error is not None:
            raise self._error
        try:
            finished = self.wait(timeout)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            self._error = e
            raise
        if not finished:
            raise TimeoutError(f"the copies did not finish within {timeout} s (they go on)")
        with self._lock:
            if self._value is _UNSET and self._error is None:
                try:
                    self._value = self._finish()
                except BaseException as e:
                    self._error = e
            if self._error is not None:
                raise self._error
            self._pending = []
            return self._value

    def exception(self, timeout=None):
        """The error the transfer failed with, or None once it succeeded (waits first)."""
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except Exception as e:
            return e
        return None

    def then(self, fn):
        """A ``Transfer`` of ``fn(result)``, once this one's copies have finished."""
        return Transfer(self._pending, lambda: fn(self.result()), self._background)

    def __await__(self):
        return self._result_async().__await__()

    async def _result_async(self):
        if not self.done():
            # The wait releases the GIL: a worker thread holds no interpreter time.
            await asyncio.get_running_loop().run_in_executor(None, self.wait)
        return self.result()

    def __repr__(self):
        state = "done" if self.done() else "running"
        return f"<tensorferry.Transfer of {len(self._pending)} tensors, {state}>"
