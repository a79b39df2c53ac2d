"""``Transfer``: the one handle every call with ``non_blocking=True`` returns.

A future in the style of ``concurrent.futures.Future`` (``result``, ``wait``, ``done``,
``exception``, ``await``) whose result exists only once every copy it stands for has
finished. Moves hand it the native tensors being filled; saves and loads run on a background
thread. A failure nobody awaited is a ``RuntimeWarning`` once the last handle is collected,
or at exit; the exit waits for running jobs, and Ctrl-C during that wait abandons them
(a line on stderr naming each, exit status 130).
"""

import asyncio
import atexit
import concurrent.futures
import os
import queue
import sys
import threading
import time
import warnings

from . import _native
from ._errors import CopyError, naming_key

_UNSET = object()


class Transfer:
    """A call in flight (``non_blocking=True``). Its result exists once every copy has
    finished, so nothing can read it early; waits can be interrupted with Ctrl-C (the
    copies go on).

    >>> import numpy as np, tensorferry as tf
    >>> on_device = tf.to_device({"w": np.arange(3.0), "step": 7}, "emu:0")
    >>> pending = tf.to_numpy(on_device, non_blocking=True)   # returns at once
    >>> pending.result()                                     # waits, then converts
    {'w': array([0., 1., 2.]), 'step': 7}
    >>> pending.done()
    True
    """

    __slots__ = ("_pending", "_keys", "_finish", "_background", "_lock", "_value", "_error", "_watch")

    def __init__(self, pending, finish, background=None, watch=None, keys=None):
        self._pending = list(pending)
        self._keys = keys  # the key paths of the pending tensors, in order, for a failed copy's error
        self._finish = finish
        self._background = background  # a concurrent.futures.Future doing the rest, if any
        self._lock = threading.Lock()
        self._value = _UNSET
        self._error = None
        self._watch = watch  # a _Watch of the background job, reporting a failure nobody saw
        if watch is not None:
            watch.hold()

    def __del__(self):
        watch = getattr(self, "_watch", None)
        if watch is not None:
            try:
                watch.release()
            except Exception:  # the interpreter is shutting down: _at_exit reported already
                pass

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
        try:
            if not _native.wait_tensors(self._pending, timeout):
                return False
        except CopyError as e:
            if not self._keys:
                raise
            raise naming_key(e, self._keys) from None
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
                    if self._watch is not None:
                        self._watch.seen()
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

    def _wait_each(self, report):
        """Waits for the copies one by one, calling ``report(nbytes)`` after each (a
        progress bar's), then gives :meth:`result`."""
        for t in list(self._pending):
            _native.wait_tensors([t], None)
            report(t.nbytes)
        return self.result()

    def then(self, fn):
        """A ``Transfer`` of ``fn(result)``, once this one's copies have finished."""
        return Transfer(self._pending, lambda: fn(self.result()), self._background, self._watch)

    def __await__(self):
        return self._result_async().__await__()

    async def _result_async(self):
        if not self.done():
            # The wait releases the GIL: a worker thread holds no interpreter time.
            await asyncio.get_running_loop().run_in_executor(None, self.wait)
        return self.result()

    def __repr__(self):
        state = "done" if self.done() else "running"
        what = "in the background" if self._background is not None else f"of {len(self._pending)} tensors"
        return f"<tensorferry.Transfer {what}, {state}>"


class _Watch:
    """What became of one background job (a non-blocking save or load), watched so that a failure
    reaches someone: the caller through its :class:`Transfer`, or — once every handle is
    gone, or at interpreter exit — a ``RuntimeWarning`` on stderr. Never lost silently."""

    __slots__ = ("future", "what", "where", "_lock", "_handles", "_seen", "_reported")

    def __init__(self, future, what):
        self.future = future
        self.what = what
        self.where = _caller()
        self._lock = threading.Lock()
        self._handles = 0
        self._seen = False
        self._reported = False
        _WATCHED.add(self)
        future.add_done_callback(self._finished)

    def hold(self):
        with self._lock:
            self._handles += 1

    def release(self):
        """A handle went away; the last one reports a failure nobody saw."""
        with self._lock:
            self._handles -= 1
        self._report_if_lost()

    def seen(self):
        """The failure reached the caller."""
        with self._lock:
            self._seen = True
        _WATCHED.discard(self)

    def _finished(self, future):
        if future.cancelled() or future.exception() is None:
            _WATCHED.discard(self)
        else:
            self._report_if_lost()

    def _report_if_lost(self, at_exit=False):
        with self._lock:
            lost = (
                not (self._seen or self._reported)
                and (self._handles <= 0 or at_exit)
                and self.future.done()
                and not self.future.cancelled()
                and self.future.exception() is not None
            )
            if lost:
                self._reported = True
        if lost:
            _WATCHED.discard(self)
            error = self.future.exception()
            how = "at interpreter exit" if at_exit else "when its last handle was collected"
            filename, lineno, module = self.where
            # Attributed to the caller's line that started the job.
            warnings.warn_explicit(
                f"{self.what} failed and its Transfer was never awaited (reported {how}): "
                f"{type(error).__name__}: {error}",
                RuntimeWarning,
                filename,
                lineno,
                module,
            )


def _caller():
    """``(filename, line, module)`` of the first frame outside tensorferry on the stack."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "tensorferry":
        frame = frame.f_back
    if frame is None:
        return ("<unknown>", 0, "tensorferry")
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", "<unknown>"))


# Watches of background jobs not known to be over (unfinished, or failed unseen).
_WATCHED = set()


class _Writers:
    """Two daemon threads that run background jobs (non-blocking saves and loads), started on first
    use. Daemon, so that the interpreter's exit waits for them through :func:`_at_exit`,
    which Ctrl-C can interrupt loudly, not through a silent join."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._threads = []
        self._lock = threading.Lock()

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        with self._lock:
            if len(self._threads) < 2:
                t = threading.Thread(target=self._serve, name="tensorferry-background", daemon=True)
                t.start()
                self._threads.append(t)
        self._jobs.put((future, fn, args))
        return future

    def _serve(self):
        while True:
            job = list(self._jobs.get())  # [future, fn, args]
            if not job[0].set_running_or_notify_cancel():
                continue
            outcome = []
            try:
                outcome.append(job[1](*job[2]))
                settle = job[0].set_result
            except BaseException as e:  # the caller's to see, through the future
                outcome.append(e)
                settle = job[0].set_exception
            # The job's inputs go before its caller is woken. One of them may hold the last
            # reference to another framework's tensor (a save's tree, as native views of
            # PyTorch memory): freed once the caller went on and the interpreter began to
            # exit, its deleter would take the GIL on a thread the exit tears down, and
            # PyTorch's deleter then aborts the process. The result passes straight into the
            # future, which holds it from then on.
            del job[:]
            settle(outcome.pop())
            del settle


_WRITERS = None
_WRITERS_LOCK = threading.Lock()


def run_in_background(what, fn, *args):
    """A :class:`Transfer` of ``fn(*args)`` run on a writer thread (GIL released by ``fn``
    where it is native). ``what`` names the job in the warning that reports a failure
    nobody awaited. The interpreter's exit waits for every job (see :func:`_at_exit`)."""
    global _WRITERS
    with _WRITERS_LOCK:
        if _WRITERS is None:
            _WRITERS = _Writers()
    future = _WRITERS.submit(fn, *args)
    return Transfer([], future.result, future, _Watch(future, what))


def _at_exit():
    """Waits for the background jobs still running, then reports every failure nobody saw.
    Ctrl-C during the wait abandons them loudly: a line on stderr naming each, and exit
    status 130 (as for Ctrl-C anywhere else), never a silent 0."""
    watched = list(_WATCHED)
    try:
        for w in watched:
            while not w.future.done():
                concurrent.futures.wait([w.future], timeout=0.1)  # in slices: Ctrl-C is noticed
    except KeyboardInterrupt:
        left = [w.what for w in watched if not w.future.done()]
        try:
            sys.stdout.flush()
        except Exception:
            pass
        sys.stderr.write(
            f"tensorferry: interrupted at exit while {len(left)} non-blocking save(s) or load(s) were "
            "still running; they were abandoned (nothing replaced their paths): " + "; ".join(left) + "\n"
        )
        sys.stderr.flush()
        os._exit(130)
    for w in watched:
        w._report_if_lost(at_exit=True)


def _forget_in_child():
    """A forked child has none of its parent's writer threads: its saves start afresh, and
    the parent's jobs in flight are the parent's to wait for."""
    global _WRITERS, _WRITERS_LOCK
    _WRITERS = None
    _WRITERS_LOCK = threading.Lock()
    _WATCHED.clear()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
