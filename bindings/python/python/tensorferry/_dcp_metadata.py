"""Reads a DCP checkpoint's metadata (``.metadata``: torch's ``Metadata``, pickled) without
running the pickle machine.

A checkpoint is downloaded from strangers, and Python's unpickler runs whatever a pickle
names: a restricted ``find_class`` still lets a crafted file call what it reaches, build
nested keys whose hashing overflows the C stack, or refer to one object a billion times.
This reader is a small interpreter of its own for the few opcodes Python's pickler writes
for a ``Metadata`` (protocols 2 to 5). It never imports or calls what a file names:

* a global is one of an exact list of (module, name) pairs — DCP's metadata dataclasses,
  tensorferry's ``StorageInfo``, ``torch.Size``, torch's dtypes, layouts and the memory
  format code — and anything else (a dotted name included) is refused;
* an object is made by ``object.__new__`` of an allowed class and filled, field by field,
  from a state whose every field is checked here (no ``__setstate__``, no ``__init__``);
  ``REDUCE`` builds only a ``torch.Size`` of integers, a layout or a memory-format code;
* every other opcode (``INST``, ``OBJ``, ``EXT*``, ``PERSID``, ``NEWOBJ_EX``, buffers, the
  text opcodes of protocol 0 …) is refused where it stands;
* the file is at most :data:`MAX_BYTES`, containers nest at most :data:`MAX_DEPTH` deep,
  no container or object is referred to twice but short tuples of numbers and strings (so
  walking the result costs about what the file holds, never more), and the memo and stack
  are bounded.

What comes out is then checked as a whole: a ``Metadata`` whose fields have the types DCP
gives them, each tensor tiled by its chunks exactly (inside it, no overlap, no gap), each
stored item in a rank file of this folder. Anything else is a
:class:`~tensorferry.FormatError` naming the file.
"""

import dataclasses
import itertools
import math
import re
import struct

from . import _dcp_io
from ._errors import FormatError

#: The largest metadata file read (bytes): a checkpoint of several million tensor chunks.
MAX_BYTES = 256 << 20
#: How deep containers may nest (DCP's metadata nests 6 levels).
MAX_DEPTH = 16
#: Longest string (characters) and longest tuple a metadata holds.
MAX_STR = 1 << 16
MAX_TUPLE = 1 << 10
#: Dimensions of a tensor.
MAX_DIMS = 64
#: Values on the stack at once (a pickler puts at most 1000 items under one MARK).
MAX_STACK = 1 << 16

RANK_FILE = re.compile(r"__(\d+)_([0-9a-f]+)\.safetensors")


class _Refused(Exception):
    """Why the bytes are not a metadata this reader accepts (becomes a FormatError)."""


@dataclasses.dataclass(frozen=True)
class _Global:
    """What an allowed global stands for on the stack: ``kind`` says what may be done with
    it (``"class"``: NEWOBJ; ``"size"``, ``"layout"``, ``"memfmt"``: REDUCE)."""

    kind: str
    value: object
    name: str


def _allowed_globals():
    """``{(module, name): _Global}``: every global a DCP metadata written by
    :class:`tensorferry.dcp.TensorferryWriter` names (enumerated from real saves: one and
    several ranks, FSDP2 and DTensor shards, optimizer state with byte items)."""
    import torch
    import torch.distributed.checkpoint.metadata as md

    allowed = {}
    for cls in (md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
                md.TensorProperties, md.StorageMeta, md.MetadataIndex):
        allowed[(md.__name__, cls.__name__)] = _Global("class", cls, cls.__name__)
    allowed[(_dcp_io.StorageInfo.__module__, "StorageInfo")] = _Global("class", _dcp_io.StorageInfo, "StorageInfo")
    allowed[("torch", "Size")] = _Global("size", torch.Size, "Size")
    allowed[("torch.serialization", "_get_layout")] = _Global("layout", None, "_get_layout")
    allowed[(md.__name__, "_MEM_FORMAT_ENCODING")] = _Global("memfmt", md._MEM_FORMAT_ENCODING, "_MEM_FORMAT_ENCODING")
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype) and not name.startswith("_"):
            allowed[("torch", name)] = _Global("value", value, name)
    return allowed


_CACHE = {}


def _context():
    """The allowed globals, layouts by name and the field checks, built once."""
    if not _CACHE:
        import torch

        _CACHE["globals"] = _allowed_globals()
        _CACHE["layouts"] = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
        _CACHE["fields"] = _field_checks()
        _CACHE["leaves"] = _leaf_types()
    return _CACHE


# ---- the interpreter --------------------------------------------------------------------

class _Reader:
    """One pass over the opcodes of ``data``; ``run()`` returns the top object."""

    def __init__(self, data):
        ctx = _context()
        self.data = data
        self.pos = 0
        self.stack = []
        self.marks = []
        self.fence = 0  # the stack's length at the last MARK
        self.memo = []
        self.globals = ctx["globals"]
        self.layouts = ctx["layouts"]
        self.fields = ctx["fields"]
        self.leaf_types = ctx["leaves"]
        self.max_memo = max(1024, len(data) // 2)
        # Non-leaf objects: id -> [object, nesting depth, placed in another, filled (objects)]
        self.nodes = {}

    # -- bytes

    def take(self, n):
        end = self.pos + n
        if end > len(self.data):
            raise _Refused(f"the file ends at byte {len(self.data)}, inside an opcode")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def uint(self, n):
        return int.from_bytes(self.take(n), "little")

    def text(self, n):
        if n > MAX_STR:
            raise _Refused(f"a string of {n} bytes (at most {MAX_STR})")
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise _Refused("a string that is not UTF-8") from None

    # -- the object graph

    def new(self, obj, depth):
        self.nodes[id(obj)] = [obj, depth, False, False]
        return obj

    def place(self, value):
        """Records that ``value`` goes into a container; returns its nesting depth."""
        if type(value) in self.leaf_types or (type(value) is tuple and not value):
            return 0
        node = self.nodes.get(id(value))
        if node is None:
            raise _Refused(f"a {type(value).__name__} used as a value")
        if node[1] == 1 and type(value) is tuple and len(value) <= MAX_DIMS:
            return 1  # a short tuple of leaves (strides) may be shared: it costs little to walk
        if node[2]:
            raise _Refused(f"one {type(value).__name__} referred to twice")
        if not node[3] and type(value) in self.fields:
            self.fill(value, node, {})  # no BUILD (an object of no fields): its defaults
        node[2] = True
        return node[1]

    def grow(self, container, depth):
        """``container`` (not yet placed) takes an item of nesting ``depth``."""
        node = self.nodes.get(id(container))
        if node is None or node[2]:
            raise _Refused(f"items added to a {type(container).__name__} that is not an open list or dict")
        if depth + 1 > node[1]:
            if depth + 1 > MAX_DEPTH:
                raise _Refused(f"containers nested more than {MAX_DEPTH} deep")
            node[1] = depth + 1

    def mark(self):
        if len(self.marks) >= MAX_DEPTH * 4:
            raise _Refused("MARKs nested too deep")
        self.marks.append(len(self.stack))
        self.fence = len(self.stack)

    def pop_mark(self):
        if not self.marks:
            raise _Refused("an opcode needs a MARK that is not there")
        at = self.marks.pop()
        self.fence = self.marks[-1] if self.marks else 0
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def pop(self):
        """The value on top of the stack; never one below the last MARK."""
        if len(self.stack) <= self.fence:
            raise _Refused("an opcode needs a value the stack does not hold")
        return self.stack.pop()

    def top(self, what):
        """The value on top of the stack (above the last MARK), which ``what`` changes."""
        if len(self.stack) <= self.fence:
            raise _Refused(f"{what} with nothing to change")
        return self.stack[-1]

    def push(self, value):
        self.stack.append(value)

    def tuple_of(self, items):
        if len(items) > MAX_TUPLE:
            raise _Refused(f"a tuple of {len(items)} items")
        depth, leaves = 0, self.leaf_types
        for item in items:
            if type(item) not in leaves:
                depth = max(depth, self.place(item))
        if depth + 1 > MAX_DEPTH:
            raise _Refused(f"containers nested more than {MAX_DEPTH} deep")
        value = tuple(items)
        if not value:
            return value  # the empty tuple is one shared object: a leaf
        return self.new(value, depth + 1)

    def set_items(self, target, items):
        if len(items) % 2:
            raise _Refused("SETITEMS with a key and no value")
        if type(target) is not dict:
            raise _Refused(f"SETITEMS on a {type(target).__name__}")
        leaves = self.leaf_types
        for i in range(0, len(items), 2):
            key, value = items[i], items[i + 1]
            if type(key) is str:
                depth = 0
            else:
                self.check_key(key)
                depth = self.place(key)
            if type(value) not in leaves:
                depth = max(depth, self.place(value))
            self.grow(target, depth)
            if key in target:
                raise _Refused(f"the key {key!r} twice in one dict")
            target[key] = value

    def check_key(self, key):
        """Keys are strings, integers or filled MetadataIndex objects: hashing them runs
        no code of the file's choosing and never recurses."""
        if type(key) in (str, int):
            return
        node = self.nodes.get(id(key))
        if node is not None and node[3] and type(key).__name__ == "MetadataIndex":
            return
        raise _Refused(f"a dict key of type {type(key).__name__}")

    def append(self, target, items):
        if type(target) is not list:
            raise _Refused(f"APPEND to a {type(target).__name__}")
        for item in items:
            self.grow(target, self.place(item))
            target.append(item)

    def memoize(self, index):
        if not self.stack:
            raise _Refused("MEMOIZE with nothing to remember")
        if index == len(self.memo):
            if len(self.memo) >= self.max_memo:
                raise _Refused(f"more than {self.max_memo} remembered objects")
            self.memo.append(self.stack[-1])
        elif index < len(self.memo):
            self.memo[index] = self.stack[-1]
        else:
            raise _Refused(f"memo slot {index} out of order")

    def recall(self, index):
        if index >= len(self.memo):
            raise _Refused(f"memo slot {index} was never filled")
        self.push(self.memo[index])

    def find(self, module, name):
        if "." in name:
            raise _Refused(f"the dotted name {module}:{name} (a DCP metadata names classes only by module and name)")
        found = self.globals.get((module, name))
        if found is None:
            raise _Refused(f"the global {module}.{name}, which a DCP metadata never holds")
        self.push(found.value if found.kind == "value" else found)

    def newobj(self):
        args, cls = self.pop(), self.pop()
        if not isinstance(cls, _Global) or cls.kind != "class":
            raise _Refused(f"NEWOBJ of {_what(cls)}")
        if type(args) is not tuple or args:
            raise _Refused(f"NEWOBJ of {cls.name} with arguments")
        self.push(self.new(object.__new__(cls.value), 1))

    def reduce(self):
        args, fn = self.pop(), self.pop()
        if not isinstance(fn, _Global) or fn.kind not in ("size", "layout", "memfmt"):
            raise _Refused(f"REDUCE calling {_what(fn)}")
        if type(args) is not tuple or len(args) != 1:
            raise _Refused(f"REDUCE of {fn.name} with arguments {_what(args)}")
        self.place(args)
        (arg,) = args
        if fn.kind == "size":
            if type(arg) is not tuple or len(arg) > MAX_DIMS or any(type(v) is not int or v < 0 for v in arg):
                raise _Refused(f"torch.Size of {_what(arg)}")
            self.push(fn.value(arg))
        elif fn.kind == "layout":
            if type(arg) is not str or arg not in self.layouts:
                raise _Refused(f"the layout {_what(arg)}")
            self.push(self.layouts[arg])
        else:
            if type(arg) is not int or arg not in {e.value for e in fn.value}:
                raise _Refused(f"the memory format code {_what(arg)}")
            self.push(fn.value(arg))

    def build(self):
        state = self.pop()
        obj = self.top("BUILD")
        node = self.nodes.get(id(obj))
        check = self.fields.get(type(obj))
        if node is None or check is None or node[3] or node[2]:
            raise _Refused(f"BUILD of {_what(obj)}")
        node[1] = max(node[1], self.place(state) + 1)
        if node[1] > MAX_DEPTH:
            raise _Refused(f"containers nested more than {MAX_DEPTH} deep")
        self.fill(obj, node, state)

    def fill(self, obj, node, state):
        """Sets the fields of ``obj`` from ``state``, each checked (see _field_checks)."""
        for field, value in self.fields[type(obj)](type(obj), state).items():
            object.__setattr__(obj, field, value)
        node[3] = True

    def run(self):
        """Runs the opcodes to STOP. The frequent ones (short strings, small integers, the
        memo, the empty tuple) are handled inline, the rest through ``_OPS``."""
        ops, data, stack, memo = _OPS, self.data, self.stack, self.memo
        end, count = len(data), 0
        while True:
            pos = self.pos
            if pos >= end:
                raise _Refused("the file ends before its STOP opcode")
            code = data[pos]
            count += 1
            if not count & 1023 and len(stack) > MAX_STACK:
                raise _Refused(f"more than {MAX_STACK} values on the stack")
            if code == 0x94:  # MEMOIZE
                if not stack or len(memo) >= self.max_memo:
                    raise _Refused("MEMOIZE with nothing to remember, or too many remembered objects")
                memo.append(stack[-1])
                self.pos = pos + 1
            elif code == 0x8C and pos + 1 < end and pos + 2 + data[pos + 1] <= end:  # SHORT_BINUNICODE
                n = data[pos + 1]
                try:
                    stack.append(str(data[pos + 2:pos + 2 + n], "utf-8"))
                except UnicodeDecodeError:
                    raise _Refused("a string that is not UTF-8") from None
                self.pos = pos + 2 + n
            elif code == 0x68 and pos + 1 < end:  # BINGET
                i = data[pos + 1]
                if i >= len(memo):
                    raise _Refused(f"memo slot {i} was never filled")
                stack.append(memo[i])
                self.pos = pos + 2
            elif code == 0x6A and pos + 4 < end:  # LONG_BINGET
                i = int.from_bytes(data[pos + 1:pos + 5], "little")
                if i >= len(memo):
                    raise _Refused(f"memo slot {i} was never filled")
                stack.append(memo[i])
                self.pos = pos + 5
            elif code == 0x4B and pos + 1 < end:  # BININT1
                stack.append(data[pos + 1])
                self.pos = pos + 2
            elif code == 0x4D and pos + 2 < end:  # BININT2
                stack.append(data[pos + 1] | data[pos + 2] << 8)
                self.pos = pos + 3
            elif code == 0x29:  # EMPTY_TUPLE
                stack.append(())
                self.pos = pos + 1
            else:
                self.pos = pos + 1
                op = ops.get(code)
                if op is None:
                    raise _Refused(f"the opcode {_opname(code)} at byte {pos}, which a DCP metadata never holds")
                if op(self):
                    break
        if self.pos != end:
            raise _Refused(f"{end - self.pos} bytes after the STOP opcode")
        if len(stack) != 1 or self.marks:
            raise _Refused("the stack does not end with one object")
        self.place(stack[0])
        return stack[0]


def _what(value):
    """A short description of a value, which runs no code of the value's class."""
    if isinstance(value, _Global):
        return value.name
    plain = type(value) in (str, int, bool, type(None)) or (
        type(value) is tuple and len(value) <= MAX_DIMS and all(type(v) in (str, int, bool, type(None)) for v in value))
    text = repr(value) if plain else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _opname(code):
    import pickletools

    for op in pickletools.opcodes:
        if op.code == chr(code):
            return op.name
    return f"0x{code:02x} (not an opcode)"


def _proto(r):
    version = r.uint(1)
    if not 2 <= version <= 5:
        raise _Refused(f"pickle protocol {version} (DCP's metadata is written with 2 to 5)")


def _frame(r):
    if r.uint(8) > len(r.data) - r.pos:
        raise _Refused("a FRAME longer than the file")


def _stop(r):
    return True


def _mark(r):
    r.mark()


def _long1(r):
    n = r.uint(1)
    if n > 8:
        raise _Refused(f"an integer of {n} bytes")
    r.push(int.from_bytes(r.take(n), "little", signed=True))


def _global(r):
    line = r.data.find(b"\n", r.pos, r.pos + 512)
    end = r.data.find(b"\n", line + 1, line + 513) if line >= 0 else -1
    if end < 0:
        raise _Refused("a GLOBAL without its two lines")
    module, name = r.data[r.pos:line], r.data[line + 1:end]
    r.pos = end + 1
    try:
        r.find(module.decode("ascii"), name.decode("ascii"))
    except UnicodeDecodeError:
        raise _Refused("a GLOBAL that is not ASCII") from None


def _stack_global(r):
    name, module = r.pop(), r.pop()
    if type(module) is not str or type(name) is not str:
        raise _Refused("STACK_GLOBAL of values that are not strings")
    r.find(module, name)


def _tuple_n(n):
    def op(r):
        items = [r.pop() for _ in range(n)][::-1]
        r.push(r.tuple_of(items))

    return op


def _container(make):
    def op(r):
        r.push(r.new(make(), 1))

    return op


def _setitem(r):
    value, key = r.pop(), r.pop()
    r.set_items(r.top("SETITEM"), [key, value])


def _setitems(r):
    items = r.pop_mark()
    r.set_items(r.top("SETITEMS"), items)


def _append(r):
    item = r.pop()
    r.append(r.top("APPEND"), [item])


def _appends(r):
    items = r.pop_mark()
    r.append(r.top("APPENDS"), items)


_OPS = {
    0x80: _proto,                                                      # PROTO
    0x95: _frame,                                                      # FRAME
    ord("."): _stop,                                                   # STOP
    ord("("): _mark,                                                   # MARK
    ord("N"): lambda r: r.push(None),                                  # NONE
    0x88: lambda r: r.push(True),                                      # NEWTRUE
    0x89: lambda r: r.push(False),                                     # NEWFALSE
    ord("K"): lambda r: r.push(r.uint(1)),                             # BININT1
    ord("M"): lambda r: r.push(r.uint(2)),                             # BININT2
    ord("J"): lambda r: r.push(struct.unpack("<i", r.take(4))[0]),     # BININT
    0x8A: _long1,                                                      # LONG1
    0x8C: lambda r: r.push(r.text(r.uint(1))),                         # SHORT_BINUNICODE
    ord("X"): lambda r: r.push(r.text(r.uint(4))),                     # BINUNICODE
    ord("q"): lambda r: r.memoize(r.uint(1)),                          # BINPUT
    ord("r"): lambda r: r.memoize(r.uint(4)),                          # LONG_BINPUT
    ord("h"): lambda r: r.recall(r.uint(1)),                           # BINGET
    ord("j"): lambda r: r.recall(r.uint(4)),                           # LONG_BINGET
    0x85: _tuple_n(1),                                                 # TUPLE1
    0x86: _tuple_n(2),                                                 # TUPLE2
    0x87: _tuple_n(3),                                                 # TUPLE3
    ord("t"): lambda r: r.push(r.tuple_of(r.pop_mark())),              # TUPLE
    ord("]"): _container(list),                                        # EMPTY_LIST
    ord("a"): _append,                                                 # APPEND
    ord("e"): _appends,                                                # APPENDS
    ord("}"): _container(dict),                                        # EMPTY_DICT
    ord("s"): _setitem,                                                # SETITEM
    ord("u"): _setitems,                                               # SETITEMS
    ord("c"): _global,                                                 # GLOBAL
    0x93: _stack_global,                                               # STACK_GLOBAL
    0x81: _Reader.newobj,                                              # NEWOBJ
    ord("R"): _Reader.reduce,                                          # REDUCE
    ord("b"): _Reader.build,                                           # BUILD
}


# ---- the fields of each class ----------------------------------------------------------

def _field_checks():
    """``{class: check(cls, state) -> {field: value}}`` for every class a metadata builds:
    the state a pickler writes for it, each field of the type DCP gives it."""
    import torch
    import torch.distributed.checkpoint.metadata as md

    def is_size(v):
        return type(v) is torch.Size

    def opt(check):
        return lambda v: v is None or check(v)

    def is_str(v):
        return type(v) is str

    def is_int(v):
        return type(v) is int

    def strides(v):
        return type(v) is tuple and len(v) <= MAX_DIMS and all(type(s) is int for s in v)

    def dataclass_state(types):
        """The check of a dataclass's state: a dict of its fields (the fields this torch
        defines; those DCP reads of the types it reads), missing ones at their default."""
        plan = []

        def check(cls, state):
            if not plan:
                plan.extend((f.name, f.default, f.default_factory, types.get(f.name)) for f in dataclasses.fields(cls))
            if type(state) is tuple and len(state) == 2 and state[0] is None and type(state[1]) is dict:
                state = state[1]  # (None, slots) from a dataclass with slots
            if type(state) is not dict:
                raise _Refused(f"the state of a {cls.__name__} is {_what(state)}, not a dict")
            out = {}
            for name, default, factory, is_valid in plan:
                if name in state:
                    value = state[name]
                elif default is not dataclasses.MISSING:
                    value = default
                elif factory is not dataclasses.MISSING:
                    value = factory()
                else:
                    raise _Refused(f"a {cls.__name__} without its field {name}")
                if is_valid is not None and not is_valid(value):
                    raise _Refused(f"{cls.__name__}.{name} is {_what(value)}")
                out[name] = value
            if len(out) != len(plan) or len(state) > len(out) or any(k not in out for k in state):
                raise _Refused(f"a {cls.__name__} with the fields {sorted(map(str, state))}")
            return out

        return check

    def properties(cls, state):
        if type(state) is not tuple or len(state) not in (5, 6):
            raise _Refused(f"the state of a TensorProperties is {_what(state)}")
        dtype, layout, requires_grad, memfmt, pin_memory = state[:5]
        stride = state[5] if len(state) == 6 else None
        codes = {
            md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
            md._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
            md._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
        }
        if (type(dtype) is not torch.dtype or type(layout) is not torch.layout or type(requires_grad) is not bool
                or type(memfmt) is not md._MEM_FORMAT_ENCODING or memfmt not in codes or type(pin_memory) is not bool or not (stride is None or strides(stride))):
            raise _Refused(f"the state of a TensorProperties is {_what(state)}")
        return {"dtype": dtype, "layout": layout, "requires_grad": requires_grad, "memory_format": codes[memfmt],
                "pin_memory": pin_memory, "strides": stride}

    known = {f.name for f in dataclasses.fields(md.Metadata)}
    metadata_types = {
        "state_dict_metadata": lambda v: type(v) is dict,
        "planner_data": lambda v: v is None or type(v) is dict,
        "storage_data": lambda v: v is None or type(v) is dict,
        "storage_meta": lambda v: v is None or type(v) is md.StorageMeta,
        "version": opt(is_str),
    }
    return {
        md.Metadata: dataclass_state({k: v for k, v in metadata_types.items() if k in known}),
        md.TensorStorageMetadata: dataclass_state({
            "properties": lambda v: type(v) is md.TensorProperties, "size": is_size, "chunks": lambda v: type(v) is list}),
        md.BytesStorageMetadata: dataclass_state({}),
        md.ChunkStorageMetadata: dataclass_state({"offsets": is_size, "sizes": is_size}),
        md.TensorProperties: properties,
        md.StorageMeta: dataclass_state({
            "checkpoint_id": opt(is_str), "save_id": opt(is_str), "load_id": opt(is_str),
            "modules": lambda v: type(v) is list and all(type(m) is str for m in v)}),
        md.MetadataIndex: dataclass_state({"fqn": is_str, "offset": opt(is_size), "index": opt(is_int)}),
        _dcp_io.StorageInfo: dataclass_state({"file": is_str, "name": is_str}),
    }


def _leaf_types():
    import torch
    import torch.distributed.checkpoint.metadata as md

    return frozenset((str, int, bool, type(None), torch.dtype, torch.layout, torch.Size, md._MEM_FORMAT_ENCODING))


# ---- the whole ----------------------------------------------------------------------------

def _validate(metadata):
    """Checks the structure DCP and this layer rely on; raises _Refused."""
    import torch.distributed.checkpoint.metadata as md

    if type(metadata) is not md.Metadata:
        raise _Refused(f"it holds a {_what(metadata)}, not a DCP Metadata")
    for fqn, item in metadata.state_dict_metadata.items():
        if type(fqn) is not str:
            raise _Refused(f"a state dict key {_what(fqn)}")
        if type(item) is md.BytesStorageMetadata:
            continue
        if type(item) is not md.TensorStorageMetadata:
            raise _Refused(f"{fqn} is described by a {_what(item)}")
        if len(item.size) > MAX_DIMS:
            raise _Refused(f"{fqn} has {len(item.size)} dimensions")
        if math.prod(item.size) >= 1 << 62:
            raise _Refused(f"{fqn} is {list(item.size)}, more elements than a tensor holds")
        for chunk in item.chunks:
            if type(chunk) is not md.ChunkStorageMetadata:
                raise _Refused(f"a chunk of {fqn} is a {_what(chunk)}")
            if len(chunk.offsets) != len(item.size) or len(chunk.sizes) != len(item.size):
                raise _Refused(
                    f"a chunk of {fqn} at {list(chunk.offsets)} of {list(chunk.sizes)} does not have the "
                    f"{len(item.size)} dimensions of the tensor {list(item.size)}")
            if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, item.size)):
                raise _Refused(f"a chunk of {fqn} at {list(chunk.offsets)} of {list(chunk.sizes)} reaches beyond "
                               f"the tensor {list(item.size)}")
        _check_cover(fqn, item.size, item.chunks)
    if metadata.planner_data is not None:
        for key, value in metadata.planner_data.items():
            if type(key) is not str or type(value) is not tuple or any(type(p) not in (str, int) for p in value):
                raise _Refused(f"the planner's entry {_what(key)}: {_what(value)}")
    if metadata.storage_data is not None:
        for key, where in metadata.storage_data.items():
            if type(key) is not md.MetadataIndex or type(where) is not _dcp_io.StorageInfo:
                raise _Refused(f"storage data {_what(key)}: {_what(where)}")
            if not RANK_FILE.fullmatch(where.file):
                raise _Refused(f"{key.fqn} is stored in {where.file!r}, not in a rank file of this folder")


def _check_cover(fqn, size, chunks):
    """The chunks (each inside the tensor) must tile it: no element in two chunks, none in
    no chunk. Checked on the grid the chunks' edges cut the tensor into, one mark per
    cell, so the work is that of the cells (about one per chunk for the row, column and
    block shards DCP writes), never that of the elements."""
    if any(d == 0 for d in size):
        return  # no element to cover
    if len(chunks) == 1 and not any(chunks[0].offsets) and chunks[0].sizes == size:
        return  # one chunk, the whole tensor: the usual case
    cuts = []
    for k, d in enumerate(size):
        edges = {0, d}
        for chunk in chunks:
            edges.add(chunk.offsets[k])
            edges.add(chunk.offsets[k] + chunk.sizes[k])
        cuts.append(sorted(edges))
    cells, strides = 1, []
    for edges in reversed(cuts):
        strides.append(cells)
        cells *= len(edges) - 1
    strides.reverse()
    if cells > max(1 << 20, 16 * len(chunks)):
        raise _Refused(f"the {len(chunks)} chunks of {fqn} cut it into {cells} blocks, not a grid of shards")
    where = [{edge: i for i, edge in enumerate(edges)} for edges in cuts]
    seen = bytearray(cells)
    for chunk in chunks:
        if any(n == 0 for n in chunk.sizes):
            continue
        spans = [range(where[k][o] * strides[k], where[k][o + n] * strides[k], strides[k])
                 for k, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes))]
        for cell in itertools.product(*spans):
            flat = sum(cell)
            if seen[flat]:
                raise _Refused(f"the chunks of {fqn} overlap (the chunk at {list(chunk.offsets)} of {list(chunk.sizes)} "
                               f"covers elements another chunk holds)")
            seen[flat] = 1
    if 0 in seen:
        flat = seen.index(0)
        corner = [cuts[k][(flat // strides[k]) % (len(cuts[k]) - 1)] for k in range(len(size))]
        raise _Refused(f"the chunks of {fqn} {list(size)} leave elements uncovered (from {corner})")


def parse(data, path="<bytes>"):
    """The ``Metadata`` pickled in ``data``; a FormatError naming ``path`` if ``data`` is
    not one this reader accepts (see the module's doc)."""
    try:
        metadata = _Reader(data).run()
        _validate(metadata)
    except _Refused as e:
        raise FormatError(f"{path}: not a DCP metadata file tensorferry reads: {e}") from None
    except RecursionError:
        raise FormatError(f"{path}: not a DCP metadata file tensorferry reads: nested too deep") from None
    return metadata



def load(path):
    """The ``Metadata`` in the file ``path``: refused at once unless a regular file of at
    most :data:`MAX_BYTES` (see :func:`parse`)."""
    return parse(_dcp_io.read_small_file(path, MAX_BYTES), path)
