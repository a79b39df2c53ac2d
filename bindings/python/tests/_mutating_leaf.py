"""A tensor leaf that changes the structure it lives in, for the tests of the walker's
strict check (test_hostile, test_walker)."""

import numpy as np


class AddsATensorWhenAsked:
    """A DLPack leaf whose device query adds a tensor to the mapping it lives in, as
    another thread could between collecting the leaves and rebuilding the result."""

    def __init__(self, parent):
        self.parent = parent
        self.array = np.ones(2, np.float32)

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        self.parent["late"] = np.zeros(3)
        return (1, 0)
