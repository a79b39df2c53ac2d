"""Progress bars for ``save(progress=True)`` and ``load(progress=True)``.

tqdm's bars, in bytes, on stderr when tqdm is installed (it is not a dependency), counting
what can be seen without slowing the work: a save, the sizes of its files (temporary names
included) polled a few times a second; a load onto a device, each tensor as its copy ends;
a load into host memory, all at once when the one native call returns.
"""

import contextlib
import os
import threading

#: Seconds between two looks at the files a save is writing.
POLL_SECONDS = 0.2


def bar(total, what):
    """A tqdm bar of ``total`` bytes named ``what``, or None when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def named(verb, path):
    """A bar's name: ``verb`` and the last part of ``path`` (a folder's or a prefix's own
    name when it ends with a slash: "load ckpt" for "s3://bucket/ckpt/")."""
    return f"{verb} {os.path.basename(os.path.normpath(os.fspath(path)))}"


def advance_to(progress, n):
    """Moves ``progress`` forward to ``n`` bytes (never back)."""
    n = min(n, progress.total)
    if n > progress.n:
        progress.update(n - progress.n)


def _folder_of(path):
    """The folder the native writer puts ``path``'s files in (symlinks followed)."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        return os.path.realpath(path)
    return os.path.dirname(os.path.realpath(path))


def _temp_sizes(folder, prefix, before):
    """``{name: bytes}`` of this process's temporary files in ``folder``, but ``before``."""
    sizes = {}
    try:
        with os.scandir(folder) as entries:
            for e in entries:
                if e.name.startswith(prefix) and e.name.endswith(".tmp") and e.name not in before:
                    try:
                        sizes[e.name] = e.stat().st_size
                    except OSError:
                        pass  # renamed into place meanwhile
    except OSError:
        pass  # a folder the save itself will create or report on
    return sizes


@contextlib.contextmanager
def writes_watched(path, report):
    """Calls ``report(bytes)`` with the bytes written so far into the files of a save to
    ``path``, a few times a second, while the block runs (the command's ``convert`` draws
    its own bar with it)."""
    folder = _folder_of(path)
    prefix = f".tf-{os.getpid()}-"
    before = set(_temp_sizes(folder, prefix, ()))
    stop = threading.Event()

    def watch():
        finished, last = 0, {}
        while not stop.wait(POLL_SECONDS):
            now = _temp_sizes(folder, prefix, before)
            # A file gone since the last look was renamed into place: complete.
            finished += sum(size for n, size in last.items() if n not in now)
            last = now
            report(finished + sum(now.values()))

    watcher = threading.Thread(target=watch, name="tensorferry-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def watched_save(path, total, save):
    """``save`` (a callable writing ``path``) wrapped to draw a bar of the bytes written,
    or ``save`` itself when tqdm is not installed."""
    def run(*args):
        progress = bar(total, named("save", path))
        if progress is None:
            return save(*args)
        try:
            with writes_watched(path, lambda n: advance_to(progress, n)):
                result = save(*args)
            advance_to(progress, total)  # what was written since the last look
            return result
        finally:
            progress.close()

    return run


def filled(total, what):
    """A bar of ``total`` bytes drawn full at once (work observed only as a whole)."""
    progress = bar(total, what)
    if progress is not None:
        advance_to(progress, total)
        progress.close()
