"""``TensorDict``: the object form of a nested tensor dictionary, tensordict-style."""

import operator
import os
from collections.abc import Mapping

import numpy as np

from . import _api
from . import _frameworks as fw
from . import _native
from ._errors import FormatError, TensorferryKeyError, TensorferryTypeError, naming_key
from ._transfer import Transfer
from ._tree import shown


class TensorDict:
    """A nested dictionary of tensors and plain values with one-call moves.

    Keys are strings (``"layer.0.weight"`` is one key) or integers (the parameter indices
    of an optimizer's state); a tuple key is a path into nested dicts. Values keep their
    framework.

    ``batch_size`` (keyword-only, as in tensordict) is the leading dimensions every tensor
    shares, checked when the dictionary is made and at every ``td[key] = value``: a
    :class:`FormatError` names the first tensor whose shape does not start with it. It
    is kept by every move (:meth:`to`, :meth:`cpu`, :meth:`consolidate`) and by nested
    dictionaries read with ``td[key]``. The default, ``[]``, checks nothing (or, from a
    TensorDict, keeps its batch size).

    Unlike tensordict's, ``len()``, ``iter()`` and ``in`` are those of a mapping (top-level
    keys), not of the first batch dimension, and ``==`` is a single ``bool`` (see
    :meth:`__eq__`).

    >>> import numpy as np, tensorferry as tf
    >>> td = tf.TensorDict({"model": {"w": np.ones(2, np.float32)}, "step": 1})
    >>> td["model", "w"]
    array([1., 1.], dtype=float32)
    >>> len(td), td.nbytes, td.device
    (2, 8, 'cpu')
    >>> batch = tf.TensorDict({"obs": np.zeros((4, 3)), "reward": np.zeros(4)}, batch_size=[4])
    >>> batch.batch_size
    (4,)
    >>> batch.cpu() == batch
    True
    """

    __slots__ = ("_data", "_batch_size")
    __hash__ = None  # mutable, and == compares contents

    def __init__(self, obj=None, /, *, batch_size=None, **kwargs):
        if isinstance(obj, TensorDict):
            if batch_size is None:
                batch_size = obj._batch_size
            obj = obj._data
        if obj is not None and not isinstance(obj, Mapping):
            raise TensorferryTypeError(f"TensorDict takes a mapping (a dict of tensors), not a {type(obj).__name__}")
        data = dict(obj) if obj is not None else {}
        data.update(kwargs)
        self._data = data
        self._batch_size = ()
        self.batch_size = () if batch_size is None else batch_size

    @classmethod
    def _wrap(cls, data, batch_size=()):
        """A TensorDict over ``data`` as it is (no copy, no check)."""
        td = cls.__new__(cls)
        td._data = data
        td._batch_size = batch_size
        return td

    def __tensorferry_rebuild__(self, items):
        """The TensorDict that tensorferry's functions return for this one, of ``items``
        (the same keys, each value moved or converted): it keeps the batch size."""
        return type(self)._wrap(items, self._batch_size)

    # -- batch size -------------------------------------------------------------
    @property
    def batch_size(self):
        """The leading dimensions every tensor shares, a tuple of ints (``()``: none).
        Setting it checks every tensor."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value):
        size = _as_batch_size(value)
        _check_batch(self._data, size, ())
        self._batch_size = size

    @property
    def shape(self):
        """The batch size (tensordict's other name for it)."""
        return self._batch_size

    @property
    def batch_dims(self):
        """The number of batch dimensions: ``len(batch_size)``."""
        return len(self._batch_size)

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
            return TensorDict._wrap(value, self._batch_size)
        return value

    def __setitem__(self, key, value):
        if isinstance(value, TensorDict):
            value = value._data
        path = key if isinstance(key, tuple) else (key,)
        _check_batch(value, self._batch_size, path)
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
        return _native.nested_keys(self._data)  # bounded: no cycle, no deeper than MAX_DEPTH

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
    def _moved(self, result):
        """A move's result as a TensorDict of this batch size; a :class:`Transfer` (a
        non-blocking move) as a Transfer whose ``result()`` is that TensorDict."""
        if isinstance(result, Transfer):
            return result.then(self._moved)
        return TensorDict._wrap(result, self._batch_size)

    def to(self, device, *, non_blocking=False, copy=False):
        """A new TensorDict with every tensor on ``device``, of the same batch size. With
        ``non_blocking=True``, what :func:`tensorferry.to_device` returns: a
        :class:`Transfer` gives the TensorDict from its ``result()``."""
        return self._moved(_api.to_device(self._data, device, non_blocking=non_blocking, copy=copy))

    def cpu(self, *, non_blocking=False, pinned=False):
        """A new TensorDict with every tensor in host memory (``pinned``: in the pool), of
        the same batch size; with ``non_blocking=True``, as :meth:`to`."""
        return self._moved(_api.to_host(self._data, non_blocking=non_blocking, pinned=pinned))

    def cuda(self, index=0, *, non_blocking=False):
        """A new TensorDict with every tensor on CUDA device ``index``."""
        return self.to(f"cuda:{index}", non_blocking=non_blocking)

    def numpy(self, **kwargs):
        """Plain nested containers whose tensors are NumPy arrays (see
        :func:`tensorferry.to_numpy`, whose options it takes: ``non_blocking=True`` gives a
        :class:`Transfer`)."""
        return _api.to_numpy(self._data, **kwargs)

    def to_dict(self):
        """Plain nested containers (dict, list, tuple) of the values as they are."""
        return _native.rebuild(self._data, {}, True)

    def consolidate(self):
        """A new TensorDict whose host tensors all live in one 64-byte-aligned buffer."""
        return TensorDict._wrap(_api.to_host(self._data, copy=True, _packed=True), self._batch_size)

    def save(self, path, **kwargs):
        """Saves to a safetensors file, or a sharded checkpoint (see :func:`tensorferry.save`,
        whose options it takes: ``non_blocking=True`` gives a :class:`Transfer`)."""
        return _api.save(self._data, path, **kwargs)

    @classmethod
    def load(cls, path, **kwargs):
        """Loads a safetensors file saved from a dict (see :func:`tensorferry.load`, whose
        options it takes); with ``non_blocking=True``, a :class:`Transfer` of the
        TensorDict."""

        def wrap(loaded):
            if not isinstance(loaded, Mapping):
                raise FormatError(
                    f"{os.fspath(path)!r} holds a {type(loaded).__name__}, not a dict: load it with "
                    "tensorferry.load"
                )
            return cls._wrap(loaded)

        loaded = _api.load(path, **kwargs)
        if isinstance(loaded, Transfer):
            return loaded.then(wrap)
        return wrap(loaded)

    def wait(self):
        """Waits for every copy into this dictionary's tensors (``non_blocking`` moves
        return before they finish); raises the first copy's error, a :class:`CopyError`
        naming the key of the tensor it was filling. Returns self."""
        for path, t in _native.collect_tensors(self._data, fw.kind_of):
            if type(t) is fw.Tensor:
                try:
                    t.wait()
                except Exception as e:
                    named = naming_key(e, shown(path))
                    if named is e:
                        raise
                    raise named from None
        return self

    def is_ready(self):
        """True when no copy into this dictionary's tensors is still running."""
        return all(t.is_ready for t in self._tensors() if type(t) is fw.Tensor)

    # -- facts ------------------------------------------------------------------
    def _tensors(self):
        return [leaf for _, leaf in _native.collect_tensors(self._data, fw.kind_of)]

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
        """True when ``other`` (a TensorDict or any mapping) holds the same: the same keys
        at every level, every tensor of the same shape, dtype and values (NaN equals
        nothing, as with ``==``) whatever its device or framework, every other leaf
        ``==``; and, for a TensorDict, the same batch size. Tensors on a device are read
        to compare them. ``!=`` is its negation; anything but a mapping is unequal.

        tensordict's ``==`` gives a TensorDict of boolean tensors, leaf by leaf; here it
        is one ``bool``, as for a ``dict`` (this class is a mapping, and compares equal to
        a dict of the same contents): ``td == td.cpu()`` is simply true.

        >>> import numpy as np, tensorferry as tf
        >>> a = tf.TensorDict({"w": np.arange(3.0), "step": 1})
        >>> a == {"w": np.arange(3.0), "step": 1}, a != a.to("emu:0"), a == {"w": np.arange(3), "step": 1}
        (True, False, False)
        """
        if isinstance(other, TensorDict):
            if other._batch_size != self._batch_size:
                return False
            other = other._data
        elif not isinstance(other, Mapping):
            return NotImplemented
        if self._data is other:
            return True
        return _same(_api.to_numpy(self._data), _api.to_numpy(other))

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __repr__(self):
        tensors = self._tensors()
        size = f", batch_size={list(self._batch_size)}" if self._batch_size else ""
        return f"TensorDict(keys={list(self._data)}, tensors={len(tensors)}, device={self.device}{size})"


def _as_batch_size(value):
    """``batch_size=`` as a tuple of non-negative ints (an int is one dimension)."""
    try:
        dims = (operator.index(value),) if not hasattr(value, "__iter__") else tuple(operator.index(d) for d in value)
    except TypeError:
        raise TensorferryTypeError(
            f"batch_size must be a sequence of ints (such as [4] or torch.Size([4, 2])), not {value!r}"
        ) from None
    if any(d < 0 for d in dims):
        raise FormatError(f"batch_size {list(dims)}: dimensions cannot be negative")
    return dims


def _shape(tensor):
    return tuple(int(d) for d in tensor.shape)


def _check_batch(value, batch_size, prefix):
    """A :class:`FormatError` naming the first tensor in ``value`` (at key path ``prefix``)
    whose leading dimensions are not ``batch_size``."""
    if not batch_size:
        return
    n = len(batch_size)
    for path, t in _native.collect_tensors(value, fw.kind_of, False, None, prefix):
        shape = _shape(t)
        if shape[:n] != batch_size:
            raise FormatError(
                f"batch_size {list(batch_size)} does not fit the tensor at {shown(path)!r}, of shape "
                f"{list(shape)}: every tensor's leading dimensions must be {list(batch_size)}"
            )


def _same(a, b):
    """Whether two plain structures of NumPy arrays and other leaves are equal (see
    :meth:`TensorDict.__eq__`)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(np.array_equal(a, b))
        )
    kind = _native.container_kind(a)
    if kind in ("dict", "mapping"):
        if _native.container_kind(b) not in ("dict", "mapping") or len(a) != len(b):
            return False
        try:
            return all(_same(v, b[k]) for k, v in a.items())
        except (KeyError, TypeError):
            return False
    if kind is not None:
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if _native.container_kind(b) is not None:
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an == that does not answer with a truth value
        return False


Mapping.register(TensorDict)
assert _native.container_kind(TensorDict()) == "mapping"
