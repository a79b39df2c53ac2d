"""The cyclic garbage collector held off while a call builds a large tree.

A move of 20,000 leaves allocates several small objects per leaf, none in a cycle, but
their number triggers full collections mid-call (0.1–0.2 s each with a few hundred
thousand live objects): more than the move. A collector the caller disabled stays disabled.
"""

import functools
import gc


def gc_paused(fn):
    """``fn`` with the cyclic garbage collector held off while it runs."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return call
