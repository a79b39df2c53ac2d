"""Saves to one checkpoint land in the order they were called, the last call winning.

A non-blocking save writes on a background thread, so an earlier, larger save could
otherwise finish after a later one and replace it. Every save (blocking or not) takes a
turn for its checkpoint when it is called and writes only once the saves to that
checkpoint called before it have finished. Other processes are kept apart by the folder
lock the native save takes.
"""

import os
import threading

_LOCK = threading.Lock()
_LATEST = {}


def _key(path):
    """One key per checkpoint: ``ckpt/`` and ``ckpt/model.safetensors`` are the same."""
    try:
        path = os.fsdecode(path)
        if os.path.isdir(path) or path.endswith(("/", os.sep)):
            path = os.path.join(path, "model.safetensors")
        return os.path.realpath(path)
    except (OSError, ValueError, TypeError):
        return path  # The save itself reports what is wrong with the path.


class Turn:
    """A save's place in the queue of its checkpoint."""

    def __init__(self, key, before):
        self._key = key
        self._before = before
        self._done = threading.Event()

    def run(self, save, *args):
        """Waits for the saves called before this one, then runs ``save(*args)``."""
        try:
            before, self._before = self._before, None
            if before is not None:
                before._done.wait()
            return save(*args)
        finally:
            self._done.set()
            with _LOCK:
                if _LATEST.get(self._key) is self:
                    del _LATEST[self._key]


def take(path):
    """The turn of a save to ``path`` called now: after every save to it called before."""
    key = _key(path)
    with _LOCK:
        turn = Turn(key, _LATEST.get(key))
        _LATEST[key] = turn
    return turn
