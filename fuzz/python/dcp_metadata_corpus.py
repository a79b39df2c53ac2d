#!/usr/bin/env python3
"""Writes the DCP metadata corpus (``corpus-dcp-metadata/``): real ``.metadata`` files of
tensorferry's DCP layer, and hostile pickles of the kinds people publish against
``pickle.load``. Each hostile file would, if run by an unpickler, create the file
``PWNED`` in the current folder (``touch PWNED`` or ``open('PWNED', 'w')``), crash the
interpreter, or make a loader's work explode; tensorferry's metadata reader must refuse
every one with a ``FormatError``.

    .venv/bin/python fuzz/python/dcp_metadata_corpus.py            # rewrites the corpus
    .venv/bin/python fuzz/python/dcp_metadata_corpus.py --seeds    # only the real files

The real seeds come from ``dcp.save`` with ``TensorferryWriter`` on one process (a model
and an AdamW state: tensors of several dtypes and layouts, byte items); ``real-2ranks-fsdp2``
was saved on two gloo ranks (FSDP2 row shards, a DTensor by columns, a replicated one).
"""

import os
import pickle
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus-dcp-metadata")

MD = "torch.distributed.checkpoint.metadata"
SHELL = "touch PWNED"
PYTHON = "open('PWNED', 'w').close()"


# ---- a small pickle assembler ------------------------------------------------------------

def s(text):
    """SHORT_BINUNICODE or BINUNICODE."""
    raw = text.encode()
    return (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))) + raw


def stack_global(module, name):
    return s(module) + s(name) + b"\x93"


def global_(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


P4 = b"\x80\x04"
P2 = b"\x80\x02"
TUPLE1, TUPLE2, REDUCE, STOP, MARK = b"\x85", b"\x86", b"R", b".", b"("
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
NEWOBJ, BUILD, SETITEMS, SETITEM, APPEND = b"\x81", b"b", b"u", b"s", b"a"


def call(fn, *args):
    """``fn(*args)`` with REDUCE, args as strings."""
    return fn + b"".join(s(a) for a in args) + (TUPLE1 if len(args) == 1 else TUPLE2) + REDUCE


def obj(cls_name, fields):
    """NEWOBJ of a metadata class and BUILD with a dict of already-encoded values."""
    out = stack_global(MD, cls_name) + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK
    for k, v in fields.items():
        out += s(k) + v
    return out + SETITEMS + BUILD


def integer(v):
    """BININT1, or LONG1 of 8 bytes."""
    return b"K" + bytes([v]) if v < 256 else b"\x8a\x08" + v.to_bytes(8, "little", signed=True)


def size(*dims):
    ints = b"".join(integer(d) for d in dims)
    return stack_global("torch", "Size") + MARK + ints + b"t" + TUPLE1 + REDUCE


def hostile():
    """``{name: bytes}`` of the hostile files."""
    files = {}
    files["dotted-os-system"] = P4 + call(stack_global(MD, "os.system"), SHELL) + STOP
    files["dotted-os-system-global-opcode"] = P2 + call(global_(MD, "os.system"), SHELL) + STOP
    files["dotted-planner-os-system"] = P4 + call(stack_global("torch.distributed.checkpoint.planner", "os.system"), SHELL) + STOP
    files["dotted-torch-os-system"] = P4 + call(stack_global("torch", "os.system"), SHELL) + STOP
    files["dotted-dataclass-globals"] = P4 + call(
        stack_global(MD, "Metadata.__init__.__globals__"), "x") + STOP
    files["builtins-eval"] = P2 + call(global_("builtins", "eval"), PYTHON) + STOP
    files["builtins-exec"] = P4 + call(stack_global("builtins", "exec"), PYTHON) + STOP
    files["subprocess-popen"] = P4 + stack_global("subprocess", "Popen") + EMPTY_LIST + MARK + s("touch") + s("PWNED") + \
        b"e" + TUPLE1 + REDUCE + STOP
    files["posix-system"] = P4 + call(stack_global("posix", "system"), SHELL) + STOP
    files["os-system"] = P2 + call(global_("os", "system"), SHELL) + STOP
    # EXT1 240: resolved through copyreg's extension registry (a loader that registered
    # ("os", "system") as 240 would run it).
    files["ext1-os-system"] = P2 + b"\x82\xf0" + s(SHELL) + TUPLE1 + REDUCE + STOP
    files["ext2-os-system"] = P2 + b"\x83\xf0\x00" + s(SHELL) + TUPLE1 + REDUCE + STOP
    files["inst-os-system"] = P2 + MARK + s(SHELL) + b"ios\nsystem\n" + STOP
    files["obj-os-system"] = P2 + MARK + global_("os", "system") + s(SHELL) + b"o" + STOP
    files["obj-metadata-class"] = P2 + MARK + global_(MD, "Metadata") + EMPTY_DICT + b"o" + STOP
    files["persid"] = b"P" + SHELL.encode() + b"\n" + STOP
    files["binpersid"] = P2 + s(SHELL) + b"Q" + STOP
    files["newobj-ex"] = P4 + stack_global(MD, "Metadata") + EMPTY_TUPLE + EMPTY_DICT + b"\x92" + STOP
    # A BUILD that plants __setstate__ on an object, then a second BUILD that calls it.
    files["build-setstate"] = P4 + stack_global(MD, "StorageMeta") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + \
        s("__setstate__") + stack_global(MD, "os.system") + SETITEM + BUILD + s(SHELL) + BUILD + STOP
    files["build-setstate-eval"] = P2 + global_(MD, "StorageMeta") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + \
        s("__setstate__") + global_("builtins", "eval") + SETITEM + BUILD + s(PYTHON) + BUILD + STOP
    # A reduce whose callable is an allowed class, not one of the allowed functions.
    files["reduce-allowed-class"] = P4 + stack_global(MD, "Metadata") + EMPTY_DICT + TUPLE1 + REDUCE + STOP
    # Nesting: a tuple 500,000 deep used as a dict key overflows the C stack of
    # pickle's hashing (the C unpickler crashes); lists 500,000 deep.
    files["deep-tuple-key"] = P4 + EMPTY_DICT + b"K\x01" + TUPLE1 * 500_000 + b"K\x02" + SETITEM + STOP
    files["deep-lists"] = P4 + EMPTY_LIST * 500_000 + APPEND * 499_999 + STOP
    # Billion laughs: ten references to a list of ten references to ..., nine levels.
    laughs = P4 + EMPTY_LIST + b"\x94" + MARK + s("lol") * 10 + b"e"
    for level in range(1, 10):
        laughs += b"\x94" + EMPTY_LIST + MARK + (b"h" + bytes([level - 1])) * 10 + b"e"
    files["billion-laughs"] = laughs + STOP
    # A well-typed Metadata whose 10,000 tensors share one list of 10,000 references to
    # one chunk: 10^8 chunks for whatever walks it.
    chunk = obj("ChunkStorageMetadata", {"offsets": size(0), "sizes": size(1)})
    props = stack_global(MD, "TensorProperties") + EMPTY_TUPLE + NEWOBJ + MARK + stack_global("torch", "float32") + \
        call(stack_global("torch.serialization", "_get_layout"), "torch.strided") + b"\x89" + \
        stack_global(MD, "_MEM_FORMAT_ENCODING") + b"K\x00" + TUPLE1 + REDUCE + b"\x89" + b"t" + BUILD
    shared = EMPTY_LIST + b"\x94" + chunk + b"\x94" + APPEND + (b"j" + struct.pack("<I", 1) + APPEND) * 9_999
    tensor = obj("TensorStorageMetadata", {"properties": props, "size": size(1), "chunks": shared})
    entries = b"".join(s(f"t{i}") + (tensor + b"\x94" if i == 0 else b"j" + struct.pack("<I", 0)) for i in range(10_000))
    files["shared-chunks"] = P4 + stack_global(MD, "Metadata") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + s("state_dict_metadata") + \
        EMPTY_DICT + MARK + entries + SETITEMS + SETITEM + BUILD + STOP
    # A well-typed Metadata of a tensor of 2^80 elements (one chunk, the whole of it):
    # a consolidation would ask for that much memory.
    huge = obj("ChunkStorageMetadata", {"offsets": size(0, 0), "sizes": size(1 << 40, 1 << 40)})
    tensor = obj("TensorStorageMetadata", {"properties": props, "size": size(1 << 40, 1 << 40),
                                           "chunks": EMPTY_LIST + huge + APPEND})
    files["huge-tensor"] = P4 + obj("Metadata", {"state_dict_metadata": EMPTY_DICT + s("w") + tensor + SETITEM}) + STOP
    # The C unpickler sizes its memo by the largest index it is given: 2^32 - 16 slots.
    files["memo-huge-index"] = P2 + b"N" + b"r" + struct.pack("<I", 0xFFFFFFF0) + STOP
    # Not a Metadata at all; a Metadata of the wrong shape.
    files["not-metadata-int"] = P4 + b"K\x05" + STOP
    files["metadata-wrong-field-type"] = P4 + obj("Metadata", {"state_dict_metadata": b"K\x05"}) + STOP
    files["metadata-unknown-field"] = P4 + obj("Metadata", {"state_dict_metadata": EMPTY_DICT, "__class__": b"K\x05"}) + STOP
    files["truncated"] = P4 + stack_global(MD, "Metadata")[:-5]
    return files


def _seed_single(folder):
    import torch
    import torch.distributed.checkpoint as dcp

    from tensorferry.dcp import TensorferryWriter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    state = {
        "model": model.state_dict(), "optim": optim.state_dict(), "step": 3, "name": "run-1",
        "x": {"bf16": torch.ones(2, dtype=torch.bfloat16), "empty": torch.empty(0, 3), "scalar": torch.tensor(1.5),
              "mask": torch.tensor([True]), "cl": torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last)},
    }
    dcp.save(state, storage_writer=TensorferryWriter(folder), no_dist=True)
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        return f.read()


def main(argv):
    import tempfile

    os.makedirs(CORPUS, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = {"real-1rank-model-adamw": _seed_single(tmp)}
    if "--seeds" not in argv:
        files.update({f"hostile-{k}": v for k, v in hostile().items()})
    for name, data in files.items():
        with open(os.path.join(CORPUS, name), "wb") as f:
            f.write(data)
    print(f"{len(files)} files in {CORPUS}")


if __name__ == "__main__":
    main(sys.argv[1:])
