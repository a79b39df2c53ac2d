"""The cyclic garbage collector held off while a call builds a large tree.

Moving a dictionary of 20,000 leaves allocates several small objects per leaf (key paths,
results, the new containers). None of them forms a reference cycle, but their number
triggers full collections of the collector's oldest generation mid-call, each one a walk
over every object of the process (0.1–0.2 s with a few hundred thousand live objects):
more than the whole move costs. :func:`gc_paused` holds the collector off for the call;
the temporaries are freed by reference counting as usual, and the collector runs again
afterwards, when only the results survive. A collector the caller has disabled stays
disabled.
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
