#!/usr/bin/env python3
"""Fuzzes tensorferry's Python surface with arbitrary nested trees built from the
fuzzer's bytes: containers of every supported kind (and cycles, and deep nesting), keys
that are hard to store, and leaves of every sort (NumPy arrays of odd dtypes, layouts and
byte orders, huge integers, NaN, bytes, ragged lists of numbers).

Each input goes through ``to_host(copy=True)``, ``to_numpy``, ``to_device(x, "cpu")``,
``TensorDict`` (for dicts) and a ``save``/``load`` round trip. Every call must succeed
with exactly the right result (values NaN-aware, dtypes, shapes, structure, the very same
non-tensor leaves) or raise ``tf.TensorferryError``, ``TypeError``, ``ValueError`` or
``OverflowError`` with a message. Anything else is a finding: another exception type
(``SystemError``, ``RecursionError``, ``AttributeError``, a Rust panic), a wrong result, a
crash, a hang (``-timeout``).

    .venv/bin/python fuzz/python/fuzz_tree.py fuzz/python/corpus -max_total_time=600 -timeout=30

With ``TF_FUZZ_FINDINGS=<folder>`` findings are written there (the input, and the
traceback, one file pair per kind of finding) and fuzzing goes on; without it the first
finding stops the run, as libFuzzer does. ``--replay FILE...`` runs inputs once without
atheris and prints what each did. Without atheris installed the same checks run on inputs
from Python's ``random`` (``--random SECONDS``).
"""

import collections
import hashlib
import math
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Mapping

try:
    import atheris
except ImportError:  # the random driver below still works
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["tensorferry"]):
        import tensorferry as tf
else:
    import tensorferry as tf

import numpy as np

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

ALLOWED = (tf.TensorferryError, TypeError, ValueError, OverflowError)
MAX_NODES = 200
DEEP = 3000

Point = collections.namedtuple("Point", "x y")
Record = collections.namedtuple("Record", "a b c")

DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "longdouble",
    "object", "U3", "S2", "M8[s]", "m8[ms]", [("a", "i4"), ("b", "f2")], "V3",
]  # fmt: skip
LOW_FLOATS = ()
if ml_dtypes is not None:
    LOW_FLOATS = tuple(np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
    DTYPES += list(LOW_FLOATS)

SPECIAL_KEYS = [
    "", ".", "..", "a.b", "a", "b", "__metadata__", "tensorferry.frameworks", "tensorferry",
    "\ud800", "x\udcff", "é", "\x00", "/", "a/b", "0", "1", "x" * 5000,
]  # fmt: skip
SPECIAL_FLOATS = [
    float("nan"), -float("nan"), float("inf"), -float("inf"), 1e39, -1e39, 3.4e38, -0.0, 0.0,
    5e-324, 1.7976931348623157e308, 1e-46,
]  # fmt: skip
SPECIAL_INTS = [0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**63, 2**64, -(2**63) - 1, 10**40, 2**1000]


class Finding(Exception):
    """A result that is wrong: neither right nor an allowed error."""


# -- building a tree from the fuzzer's bytes -----------------------------------------------
class Builder:
    """Turns the fuzzer's bytes into a tree; records whether it holds a cycle."""

    def __init__(self, fdp):
        self.fdp = fdp
        self.nodes = 0
        self.cyclic = False
        self.containers = []  # mutable containers, for cycles and shared subtrees

    def pick(self, n):
        return self.fdp.ConsumeIntInRange(0, n - 1)

    def key(self):
        k = self.pick(8)
        if k == 0:
            return self.fdp.PickValueInList(SPECIAL_KEYS)
        if k == 1:
            return self.fdp.ConsumeIntInRange(-3, 3)
        if k == 2:
            return (self.fdp.ConsumeUnicode(3), self.pick(3))
        if k == 3:
            return self.fdp.ConsumeUnicode(self.pick(12))
        return self.fdp.ConsumeUnicodeNoSurrogates(self.pick(12)) or "k"

    def array(self):
        fdp = self.fdp
        dtype = np.dtype(fdp.PickValueInList(DTYPES))
        shape = tuple(self.pick(5) for _ in range(self.pick(4)))
        count = int(np.prod(shape, dtype=np.int64))
        if dtype.kind == "O":
            arr = np.empty(shape, dtype=object)
            arr.fill(self.pick(3))
        else:
            raw = fdp.ConsumeBytes(count * dtype.itemsize)
            raw = raw + bytes(count * dtype.itemsize - len(raw))
            arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        return self.layout(arr)

    def layout(self, arr):
        """The same values in a layout that is not the plain one, now and then."""
        k = self.pick(9)
        if k == 0 and arr.ndim >= 2:
            return arr.T
        if k == 1 and arr.ndim >= 1:
            return arr[::-1]
        if k == 2 and arr.ndim >= 1:
            return np.concatenate([arr, arr], axis=-1)[..., ::2] if arr.shape[-1] else arr
        if k == 3 and arr.dtype.kind not in "OV" and arr.dtype.fields is None:
            return arr.astype(arr.dtype.newbyteorder("S"))  # the same values, byte-swapped
        if k == 4:
            arr.flags.writeable = False
            return arr
        if k == 5 and arr.ndim >= 1:
            return np.broadcast_to(arr[:1], (3,) + arr.shape[1:]) if arr.shape[0] else arr
        if k == 6 and arr.dtype.kind not in "O":
            # Misaligned: the data one byte into a buffer.
            buf = np.zeros(arr.nbytes + 1, np.uint8)
            out = buf[1:].view(arr.dtype).reshape(arr.shape)
            out[...] = arr
            return out
        return arr

    def number_list(self, depth=0):
        """A (perhaps ragged, perhaps nested) list or tuple of Python numbers."""
        n = self.pick(4) + (depth == 0)
        items = []
        for _ in range(n):
            k = self.pick(6)
            if k == 0 and depth < 3:
                items.append(self.number_list(depth + 1))
            elif k == 1:
                items.append(self.fdp.PickValueInList(SPECIAL_INTS))
            elif k == 2:
                items.append(self.fdp.PickValueInList(SPECIAL_FLOATS))
            elif k == 3:
                items.append(self.fdp.ConsumeBool())
            else:
                items.append(self.fdp.ConsumeIntInRange(-1000, 1000))
        return items if self.fdp.ConsumeBool() else tuple(items)

    def leaf(self):
        fdp = self.fdp
        k = self.pick(14)
        if k <= 3:
            return self.array()
        if k == 4:
            arr = self.array()
            try:
                return tf.Tensor.from_numpy(np.ascontiguousarray(arr))
            except ALLOWED:
                return arr  # a dtype tensorferry does not hold
        if k == 5:
            if fdp.ConsumeBool():
                return fdp.PickValueInList(SPECIAL_INTS)
            return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 24))
        if k == 6:
            return fdp.PickValueInList(SPECIAL_FLOATS) if fdp.ConsumeBool() else fdp.ConsumeFloat()
        if k == 7:
            return fdp.ConsumeBool()
        if k == 8:
            return None
        if k == 9:
            return fdp.ConsumeUnicode(self.pick(20))
        if k == 10:
            return fdp.ConsumeBytes(self.pick(8))
        if k == 11:
            return self.number_list()
        if k == 12:
            return fdp.PickValueInList([np.float32(1.5), np.int64(3), complex(1, 2), 1e39, Ellipsis, object()])
        return []

    def node(self, depth):
        self.nodes += 1
        k = self.pick(12)
        if depth > 6 or self.nodes > MAX_NODES or k < 5:
            return self.leaf()
        if k == 5 and self.containers:
            return self.fdp.PickValueInList(self.containers)  # the same subtree twice
        if k == 6:
            return self.deep()
        n = self.pick(5)
        kind = self.pick(7)
        if kind == 0:
            return [self.node(depth + 1) for _ in range(n)]
        if kind == 1:
            return tuple(self.node(depth + 1) for _ in range(n))
        if kind == 2:
            return Point(self.node(depth + 1), self.node(depth + 1))
        if kind == 3:
            return Record(self.node(depth + 1), self.node(depth + 1), self.node(depth + 1))
        d = (dict, dict, collections.OrderedDict, lambda: collections.defaultdict(list))[kind - 3]()
        for _ in range(n):
            d[self.key()] = self.node(depth + 1)
        self.containers.append(d)
        return d

    def deep(self):
        """A leaf under many levels of dicts and lists: some within the walk's limit, some past."""
        limit = tf._tree.MAX_DEPTH
        levels = self.fdp.PickValueInList([limit - 2, limit, limit + 1, self.pick(DEEP)])
        node = self.leaf()
        as_list = self.fdp.ConsumeBool()
        for _ in range(levels):
            node = [node] if as_list else {"d": node}
        return node

    def tree(self):
        root = {}
        for _ in range(self.pick(6)):
            root[self.key()] = self.node(1)
        if self.containers and self.pick(16) == 0:
            # A container that holds itself (or the root) somewhere below.
            where = self.fdp.PickValueInList(self.containers)
            where[self.key()] = self.fdp.PickValueInList([root, where])
        if self.pick(8) == 0:
            root = [root] if self.fdp.ConsumeBool() else (root,)
        self.cyclic = contains_itself(root)
        return root


def contains_itself(root):
    """True when a container of ``root`` holds itself somewhere below (iteratively: trees
    can be thousands of levels deep; a subtree met twice on different paths is no cycle)."""
    on_path, done = set(), set()
    stack = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            done.add(id(node))
            continue
        if id(node) in on_path:
            return True
        if id(node) in done or kind_of(node) not in ("mapping", "sequence"):
            continue
        on_path.add(id(node))
        stack.append((node, True))
        children = node.values() if isinstance(node, Mapping) else node
        stack.extend((c, False) for c in children)
    return False


# -- what a right result is ------------------------------------------------------------------
def is_tensor(x):
    return isinstance(x, (np.ndarray, tf.Tensor))


def kind_of(x):
    if is_tensor(x):
        return "tensor"
    if isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, (list, tuple)):
        return "sequence"
    return "leaf"


def is_number_data(x, depth=0):
    """What ``to_device`` makes a tensor of: a non-empty list of numbers, nested lists (a
    tuple is a record, never data)."""
    if type(x) is not list or not x or depth >= tf._tree.MAX_DEPTH:
        return False
    return all(
        (isinstance(v, (int, float)) and not isinstance(v, np.generic)) or is_number_data(v, depth + 1) for v in x
    )


def as_values(arr):
    """An array as NumPy values in native byte order (bfloat16 and float8 through ml_dtypes)."""
    arr = np.asarray(arr)
    if arr.dtype.byteorder not in "=|":
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return np.ascontiguousarray(arr)


def same_values(got, want):
    """Bit for bit, except that NaNs match NaNs (any payload) and bools match as truth values."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.tobytes() == want.tobytes():
        return True
    if got.dtype.kind == "b":
        return bool(np.array_equal(got.view(np.uint8) != 0, want.view(np.uint8) != 0))
    if got.dtype.kind in "fc" or got.dtype in LOW_FLOATS:
        g, w = got.astype(np.complex128 if got.dtype.kind == "c" else np.float64), want.astype(
            np.complex128 if want.dtype.kind == "c" else np.float64
        )
        parts = [(g.real, w.real), (g.imag, w.imag)] if g.dtype.kind == "c" else [(g, w)]
        for a, b in parts:
            nan = np.isnan(a)
            if not np.array_equal(nan, np.isnan(b)):
                return False
            if not np.array_equal(a[~nan], b[~nan]) or not np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan])):
                return False
        return True
    return False


def check_tensor(got, src, where, *, numpy_only=False, fresh=False):
    if numpy_only and type(got) is not np.ndarray:
        raise Finding(f"{where}: to_numpy gave a {type(got).__name__}, not numpy.ndarray")
    if not is_tensor(got):
        raise Finding(f"{where}: a {type(got).__name__} where a tensor was expected")
    if isinstance(got, tf.Tensor) and got.device != "cpu":
        raise Finding(f"{where}: on {got.device}, expected the host")
    g, w = as_values(got), as_values(src)
    if not same_values(g, w):
        raise Finding(
            f"{where}: {g.dtype}{list(g.shape)} {g!r:.200} but the source holds {w.dtype}{list(w.shape)} {w!r:.200}"
        )
    if fresh and isinstance(got, np.ndarray) and isinstance(src, np.ndarray) and np.shares_memory(got, src):
        raise Finding(f"{where}: copy=True result shares memory with the source")


def same_plain(got, want):
    if type(got) is not type(want):
        return False
    if isinstance(want, float):
        if math.isnan(want):
            return math.isnan(got)
        return got == want and math.copysign(1, got) == math.copysign(1, want)
    return got == want


def check_tree(got, src, *, mode, numpy_only=False, fresh=False):
    """Raises :class:`Finding` unless ``got`` is ``src`` after the operation ``mode``:
    "move" (same container types, the very same non-tensor leaves), "device" (also number
    lists become tensors), or "load" (plain containers, equal plain leaves). Iterative:
    trees may be thousands of levels deep."""
    stack = [(got, src, "root")]
    while stack:
        g, s, where = stack.pop()
        if is_tensor(s):
            check_tensor(g, s, where, numpy_only=numpy_only, fresh=fresh)
        elif mode == "device" and is_number_data(s):
            check_number_data(g, s, where)
        elif isinstance(s, Mapping):
            want = dict if mode == "load" else type(s)
            if type(g) is not want:
                raise Finding(f"{where}: a {type(g).__name__}, expected a {want.__name__}")
            if list(g.keys()) != list(s.keys()):
                raise Finding(f"{where}: keys {list(g.keys())!r:.200}, expected {list(s.keys())!r:.200}")
            for k in s:
                stack.append((g[k], s[k], f"{where}/{k!r:.40}"))
        elif isinstance(s, (list, tuple)):
            want = (list if isinstance(s, list) else tuple) if mode == "load" else type(s)
            if type(g) is not want or len(g) != len(s):
                raise Finding(f"{where}: a {type(g).__name__} of {len(g)}, expected a {want.__name__} of {len(s)}")
            stack.extend((a, b, f"{where}/{i}") for i, (a, b) in enumerate(zip(g, s)))
        elif mode == "load":
            if not same_plain(g, s):
                raise Finding(f"{where}: {g!r:.100} ({type(g).__name__}), expected {s!r:.100} ({type(s).__name__})")
        elif g is not s:
            raise Finding(f"{where}: {g!r:.100} is not the very same object as {s!r:.100}")


def check_number_data(got, data, where):
    if type(got) is not tf.Tensor or got.device != "cpu":
        raise Finding(f"{where}: a list of numbers became a {type(got).__name__}, expected a host tensorferry.Tensor")
    arr = np.asarray(data)
    standard = {"f": "float32", "i": "int64", "b": "bool"}.get(arr.dtype.kind)
    if got.dtype != standard:
        raise Finding(f"{where}: a list of {arr.dtype} became {got.dtype}, expected {standard}")
    with np.errstate(over="ignore", invalid="ignore"):
        want = arr.astype(standard)
    if not same_values(as_values(got.numpy()), want):
        raise Finding(f"{where}: {got.numpy()!r:.200} made of {data!r:.200}")


# -- the operations --------------------------------------------------------------------------
def allowed(e):
    """An error the caller may see: an allowed class with a message."""
    return isinstance(e, ALLOWED) and not isinstance(e, RecursionError) and str(e).strip() != ""


def attempt(name, fn, cyclic):
    """``(result,)`` from ``fn``, or None after an allowed error. Any other exception is a
    finding, and so is a success on a tree that contains itself."""
    try:
        out = fn()
    except (Finding, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - anything else is the finding
        if allowed(e):
            return None
        raise Finding(f"{name} raised {type(e).__module__}.{type(e).__name__}: {e!s:.500}") from e
    if cyclic:
        raise Finding(f"{name} accepted a tree that contains itself")
    return (out,)


FOLDER = tempfile.mkdtemp(prefix="tensorferry-fuzz-")
PATH = os.path.join(FOLDER, "f.safetensors")


def exercise(x, cyclic, fdp_bool):
    """Every operation on ``x``, each checked."""
    r = attempt("to_host(copy=True)", lambda: tf.to_host(x, copy=True), cyclic)
    if r:
        check_tree(r[0], x, mode="move", fresh=True)
    r = attempt("to_numpy", lambda: tf.to_numpy(x), cyclic)
    if r:
        check_tree(r[0], x, mode="move", numpy_only=True)
    r = attempt('to_device("cpu")', lambda: tf.to_device(x, "cpu"), cyclic)
    if r:
        check_tree(r[0], x, mode="device")
    if isinstance(x, dict):
        r = attempt("TensorDict", lambda: exercise_tensordict(x), cyclic)
        if r:
            check_tree(r[0], x, mode="move", numpy_only=True)
        r = attempt("TensorDict.keys(nested=True)", lambda: tf.TensorDict(x).keys(nested=True), False)
    exercise_save_load(x, cyclic, fdp_bool)


def exercise_tensordict(x):
    td = tf.TensorDict(x)
    len(td), td.nbytes, td.device, repr(td)  # noqa: B018 - must not fail
    td.cpu()
    return td.numpy()


def exercise_save_load(x, cyclic, mmap):
    before = open(PATH, "rb").read() if os.path.exists(PATH) else None
    r = attempt("save", lambda: tf.save(x, PATH, fsync=False), cyclic)
    if r is None:
        after = open(PATH, "rb").read() if os.path.exists(PATH) else None
        if after != before:
            raise Finding("a failed save changed the file that was there")
        leftovers = [f for f in os.listdir(FOLDER) if f != "f.safetensors"]
        if leftovers:
            raise Finding(f"a failed save left files behind: {leftovers}")
        return
    r = attempt("load", lambda: tf.load(PATH, mmap=mmap), False)
    if r is None:
        raise Finding("load refused a file that save wrote")
    check_tree(r[0], x, mode="load")


# -- drivers -----------------------------------------------------------------------------------
def test_one_input(data):
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp)
    x = builder.tree()
    try:
        exercise(x, builder.cyclic, fdp.ConsumeBool())
    except Finding as f:
        report(data, f)


def report(data, finding):
    """Writes the finding to ``TF_FUZZ_FINDINGS`` and goes on, or raises it."""
    folder = os.environ.get("TF_FUZZ_FINDINGS")
    if not folder:
        raise finding
    text = "".join(traceback.format_exception(finding))
    signature = re.sub(r"0x[0-9a-f]+|\d+", "N", str(finding).split(":")[0] + type(finding.__cause__).__name__)
    name = hashlib.sha1(signature.encode()).hexdigest()[:12]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if not os.path.exists(path + ".txt"):
        sys.stderr.write(f"\nFINDING {name}: {str(finding)[:300]}\n")
        with open(path + ".txt", "w") as f:
            f.write(text)
        with open(path + ".input", "wb") as f:
            f.write(data)


class RandomProvider:
    """The few FuzzedDataProvider methods the builder uses, from Python's ``random``."""

    def __init__(self, rng):
        self.rng = rng

    def ConsumeIntInRange(self, lo, hi):  # noqa: N802 - atheris' names
        return self.rng.randint(lo, hi)

    def ConsumeBool(self):  # noqa: N802
        return self.rng.random() < 0.5

    def ConsumeInt(self, nbytes):  # noqa: N802
        return self.rng.randint(-(2 ** (8 * nbytes - 1)), 2 ** (8 * nbytes - 1) - 1)

    def ConsumeFloat(self):  # noqa: N802
        return self.rng.choice([self.rng.uniform(-1e308, 1e308), self.rng.random(), float("nan")])

    def ConsumeBytes(self, n):  # noqa: N802
        return self.rng.randbytes(n)

    def ConsumeUnicode(self, n):  # noqa: N802
        r = self.rng
        return "".join(chr(r.choice([r.randint(0, 0x10FFFF), r.randint(0xD800, 0xDFFF), 46])) for _ in range(n))

    def ConsumeUnicodeNoSurrogates(self, n):  # noqa: N802
        return "".join(chr(self.rng.choice([self.rng.randint(0x20, 0xD7FF), 46])) for _ in range(n))

    def PickValueInList(self, values):  # noqa: N802
        return self.rng.choice(values)


def random_driver(seconds, seed=0):
    """Without atheris: random trees for ``seconds``; prints the count and any findings."""
    import random
    import time

    rng = random.Random(seed)
    end, runs, findings = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        builder = Builder(RandomProvider(rng))
        x = builder.tree()
        try:
            exercise(x, builder.cyclic, rng.random() < 0.5)
        except Finding as f:
            findings += 1
            sys.stderr.write(f"FINDING: {str(f)[:300]}\n")
        runs += 1
    print(f"random driver: {runs} inputs in {seconds:.0f} s, {findings} findings")
    return 1 if findings else 0


def replay(paths):
    """Runs each input once, saying what it did; 1 when any is a finding."""
    findings = 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        builder = Builder(atheris.FuzzedDataProvider(data))
        x = builder.tree()
        try:
            exercise(x, builder.cyclic, False)
            print(f"{p}: ok")
        except Finding as e:
            findings += 1
            print(f"{p}: FINDING: {e}")
            traceback.print_exception(e)
    return 1 if findings else 0


def main():
    if "--random" in sys.argv:
        return random_driver(float(sys.argv[sys.argv.index("--random") + 1]))
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris, or run with --random SECONDS")
    if "--replay" in sys.argv:
        return replay(sys.argv[sys.argv.index("--replay") + 1 :])
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    sys.exit(main())
