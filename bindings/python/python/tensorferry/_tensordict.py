"""``TensorDict``: the object form of a nested tensor dictionary, tensordict-style."""

from collections.abc import Mapping

from . import _api
from . import _frameworks as fw
from ._errors import TensorferryKeyError
from ._tree import _enter, collect, container_kind, _DICT, _MAPPING, _LEAF


class TensorDict:
    """A nested dictionary of tensors and plain values with one-call moves.

    Keys are strings (``"layer.0.weight"`` is one key) or integers (the parameter indices
    of an optimizer's state); a tuple key is a path into nested dicts. Values keep their
    framework.

    >>> import numpy as np, tensorferry as tf
    >>> td = tf.TensorDict({"model": {"w": np.ones(2, np.float32)}, "step": 1})
    >>> td["model", "w"]
    array([1., 1.], dtype=float32)
    >>> len(td), td.nbytes, td.device
    (2, 8, 'cpu')
    """

    __slots__ = ("_data",)

    def __init__(self, obj=None, /, **kwargs):
        if isinstance(obj, TensorDict):
            obj = obj._data
        data = dict(obj) if obj is not None else {}
        data.update(kwargs)
        self._data = data

    # -- mapping protocol -------------------------------------------------------
    def _resolve(self, key):
        path = key if isinstance(key, tuple) else (key,)
        if not path:
            raise TensorferryKeyError(key)
        node = self._data
        for depth, k in enumerate(path):
            try:
                node = node[k]
            except (KeyError, IndexError, TypeError):
                raise TensorferryKeyError("/".join(map(str, path[: depth + 1]))) from None
        return node

    def __getitem__(self, key):
        value = self._resolve(key)
        if type(value) is dict:
            return TensorDict._wrap(value)
        return value

    @classmethod
    def _wrap(cls, data):
        td = cls.__new__(cls)
        td._data = data
        return td

    def __setitem__(self, key, value):
        if isinstance(value, TensorDict):
            value = value._data
        path = key if isinstance(key, tuple) else (key,)
        node = self._data
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value

    def __delitem__(self, key):
        path = key if isinstance(key, tuple) else (key,)
        parent = self._resolve(path[:-1]) if len(path) > 1 else self._data
        try:
            del parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            raise TensorferryKeyError("/".join(map(str, path))) from None

    def __contains__(self, key):
        try:
            self._resolve(key)
            return True
        except TensorferryKeyError:
            return False

    def __len__(self):
        return len(self._data)

    def __iter__(self):
        return iter(self._data)

    def keys(self, nested=False):
        """Top-level keys; with ``nested=True``, also the tuple path of every nested entry."""
        if not nested:
            return self._data.keys()
        out = []

        def walk(d, prefix, ancestors):
            ancestors = _enter(d, prefix, ancestors)  # bounded: no cycle, no deeper than MAX_DEPTH
            for k, v in d.items():
                path = prefix + (k,)
                out.append(path if prefix else k)
                if container_kind(v) in (_DICT, _MAPPING):
                    walk(v, path, ancestors)

        walk(self._data, (), ())
        return out

    def values(self):
        """Top-level values (nested dicts as TensorDicts)."""
        return [self[k] for k in self._data]

    def items(self):
        """Top-level (key, value) pairs (nested dicts as TensorDicts)."""
        return [(k, self[k]) for k in self._data]

    def get(self, key, default=None):
        """The value at ``key`` (or path), or ``default``."""
        try:
            return self[key]
        except TensorferryKeyError:
            return default

    # -- moves ------------------------------------------------------------------
    def to(self, device, *, non_blocking=False, copy=False):
        """A new TensorDict with every tensor on ``device``."""
        return TensorDict._wrap(_api.to_device(self._data, device, non_blocking=non_blocking, copy=copy))

    def cpu(self, *, non_blocking=False, pinned=False):
        """A new TensorDict with every tensor in host memory (``pinned``: in the pool)."""
        return TensorDict._wrap(_api.to_host(self._data, non_blocking=non_blocking, pinned=pinned))

    def cuda(self, index=0, *, non_blocking=False):
        """A new TensorDict with every tensor on CUDA device ``index``."""
        return self.to(f"cuda:{index}", non_blocking=non_blocking)

    def numpy(self):
        """Plain nested containers whose tensors are NumPy arrays."""
        return _api.to_numpy(self._data)

    def to_dict(self):
        """Plain nested containers (dict, list, tuple) of the values as they are."""
        from ._tree import rebuild

        return rebuild(self._data, {}, plain=True)

    def consolidate(self):
        """A new TensorDict whose host tensors all live in one 64-byte-aligned buffer."""
        return TensorDict._wrap(_api.to_host(self._data, copy=True, _packed=True))

    def save(self, path, *, metadata=None):
        """Saves to a safetensors file (see :func:`tensorferry.save`)."""
        _api.save(self._data, path, metadata=metadata)

    @classmethod
    def load(cls, path, **kwargs):
        """Loads a safetensors file saved from a dict."""
        return cls._wrap(_api.load(path, **kwargs))

    def wait(self):
        """Waits for every copy into this dictionary's tensors (``non_blocking`` moves
        return before they finish); raises the first copy's error. Returns self."""
        for t in self._tensors():
            if type(t) is fw.Tensor:
                t.wait()
        return self

    def is_ready(self):
        """True when no copy into this dictionary's tensors is still running."""
        return all(t.is_ready for t in self._tensors() if type(t) is fw.Tensor)

    # -- facts ------------------------------------------------------------------
    def _tensors(self):
        return [leaf for _, leaf in collect(self._data, lambda x, p: fw.kind_of(x) is not None)]

    @property
    def device(self):
        """The device all tensors share, or None when mixed (or no tensor)."""
        devices = {fw.device_of(t, fw.kind_of(t)) for t in self._tensors()}
        return devices.pop() if len(devices) == 1 else None

    @property
    def nbytes(self):
        """Bytes of all tensors."""
        return sum(int(t.nbytes) for t in self._tensors())

    def __eq__(self, other):
        return NotImplemented

    def __repr__(self):
        tensors = self._tensors()
        return f"TensorDict(keys={list(self._data)}, tensors={len(tensors)}, device={self.device})"


Mapping.register(TensorDict)
assert container_kind(TensorDict()) != _LEAF
