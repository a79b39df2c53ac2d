"""The ``tensorferry`` command of the Python package (``[project.scripts]`` in pyproject.toml).

Every subcommand but ``convert`` (and ``--help``, ``--version``) is the native command, the
very code of the binary that ``cargo install --path crates/tensorferry-cli`` installs, run
with the GIL released: same output, same errors, same exit status (0; 1 with one
``tensorferry: ...`` line on stderr; 2 for a command line it cannot parse).

``convert`` reads PyTorch pickles, which takes PyTorch, so it runs here::

    tensorferry convert pytorch_model.bin                      # -> model.safetensors beside it
    tensorferry convert ./gpt2 --max-shard-size 5GB            # a folder, sharded output
    tensorferry convert pytorch_model.bin.index.json out/      # sharded pickles in, one folder out

Pickles are read with ``torch.load(weights_only=True, map_location="cpu", mmap=True)``: no
code from the file runs, and tensors are read from the file as they are written out.
"""

import argparse
import json
import os
import signal
import sys
import threading

from . import _native, _select
from ._errors import TensorferryError
from ._progress import writes_watched
from ._tree import dotted

_PROG = "tensorferry"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_INDEX_SUFFIX = ".index.json"


def main(argv=None):
    """Runs the command line ``argv`` (``sys.argv`` by default) and returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv[1:])
    if args and args[0] == "convert":
        return _convert_main(args[1:])
    return _native_main(args)


def _native_main(args):
    # What Python buffered goes out before the native command writes to the same descriptors.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    # Ctrl-C ends the native command as it ends the binary: Python's handler would only set
    # a flag that nothing reads until the command returns.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    return _native.cli_main([_PROG, *args])


# -- convert ------------------------------------------------------------------------------


class _Refused(Exception):
    """A conversion that cannot be done, with the sentence that says why."""


def _convert_parser():
    p = argparse.ArgumentParser(
        prog=f"{_PROG} convert",
        description=(
            "Turn a PyTorch pickle checkpoint into safetensors, sharded or not, with progress. "
            "The pickle is read with torch.load(weights_only=True): no code from it runs. Tensors "
            "that share memory (tied weights) are stored once and load back shared; nesting and "
            "plain values (str, int, float, bool, None) are kept."
        ),
        epilog=(
            "Exit status: 0 when written; 1 for any failure, told in one line on stderr, the "
            "output left as it was; 2 for a command line it cannot parse; 130 on Ctrl-C."
        ),
    )
    p.add_argument(
        "input",
        help="a .bin/.pt/.pth/.ckpt file, a pytorch_model.bin.index.json of sharded pickles, "
        "or a folder holding one",
    )
    p.add_argument(
        "output",
        nargs="?",
        help="the safetensors file to write, or a folder (default: model.safetensors beside a "
        "pytorch_model.bin or in the input folder, else the input's name with .safetensors)",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="write shards of at most SIZE (5GB, 500MB, 2GiB, or bytes) and an index, as "
        "transformers does; a checkpoint that fits one shard is one file",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def _convert_main(args):
    parsed = _convert_parser().parse_args(args)
    try:
        summary = _convert(parsed.input, parsed.output, parsed.max_shard_size, parsed.overwrite)
    except KeyboardInterrupt:
        _say("interrupted: the output, written atomically, is as it was or complete, never in part")
        return 130
    except (_Refused, TensorferryError, OSError, ValueError, TypeError, RuntimeError, MemoryError) as e:
        # PyTorch's errors are among these built-ins; so are tensorferry's.
        _say(str(e) or type(e).__name__)
        return 1
    try:
        print(summary, flush=True)
    except BrokenPipeError:
        # The reader stopped early: nothing left to tell anyone, as the native command does.
        _quiet_stdout()
    return 0


def _convert(input_path, output, max_shard_size, overwrite):
    source, kind = _find_source(input_path)
    target = _target_of(source, output)
    if not overwrite:
        for existing in (target, target + _INDEX_SUFFIX):
            if os.path.exists(existing):
                raise _Refused(f"{existing} exists: pass --overwrite to replace it")
    try:
        import torch
    except ImportError:
        raise _Refused("convert reads PyTorch checkpoints, which takes PyTorch: pip install torch") from None
    from . import save

    # Reading maps the tensors (mmap), so it is quick but for legacy files; writing reads
    # them from the file and writes them out: the bar of bytes.
    reading = _native.CliProgress(1, "steps")
    try:
        if kind == "index":
            tree = _load_index(torch, source, reading)
        else:
            reading.set_message(f"reading {os.path.basename(source)}")
            tree = _torch_load(torch, source)
    finally:
        reading.finish()
    try:
        tree, stored, notes = _prepared(torch, tree)
    except _Refused as e:
        raise _Refused(f"{source}: {e}") from None
    total = sum(t.nbytes for t in stored)
    writing = _native.CliProgress(total, "bytes")
    writing.set_message(f"writing {os.path.basename(target)}")
    try:
        with writes_watched(target, writing.set_position):
            save(tree, target, max_shard_size=max_shard_size)
    finally:
        writing.finish()
    written = target + _INDEX_SUFFIX if os.path.exists(target + _INDEX_SUFFIX) else target
    count = f"{_count(len(stored), 'tensor')}, {total} bytes ({_native.human_bytes(total)})"
    return "\n".join([f"wrote {written}: {count}", *notes])


def _find_source(path):
    """The pickle (or index of pickles) to read at ``path``, and its kind."""
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        for preferred, kind in (("pytorch_model.bin" + _INDEX_SUFFIX, "index"), ("pytorch_model.bin", "file")):
            if preferred in names:
                return os.path.join(path, preferred), kind
        indexes = [n for n in names if n.endswith(".bin" + _INDEX_SUFFIX)]
        pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
        if len(indexes) == 1:
            return os.path.join(path, indexes[0]), "index"
        if not indexes and len(pickles) == 1:
            return os.path.join(path, pickles[0]), "file"
        found = indexes or pickles
        raise _Refused(
            f"{path} holds {len(found)} PyTorch checkpoints ({', '.join(found)}): name the one to convert"
            if found
            else f"{path} holds no PyTorch checkpoint (*.bin, *.pt, *.pth, *.ckpt, or a *.bin.index.json)"
        )
    if not os.path.exists(path):
        raise _Refused(f"{path}: no such file or folder")
    return path, "index" if path.endswith(_INDEX_SUFFIX) else "file"


def _target_of(source, output):
    """The safetensors path to write for ``source``: ``output``, or in ``output`` when it is
    a folder, or beside ``source``."""
    name = os.path.basename(source)
    if name.startswith("pytorch_model"):
        default = "model.safetensors"
    else:
        stem = name[: -len(_INDEX_SUFFIX)] if name.endswith(_INDEX_SUFFIX) else name
        for suffix in _PICKLE_SUFFIXES:
            if stem.endswith(suffix):
                stem = stem[: -len(suffix)]
                break
        default = stem + ".safetensors"
    if output is None:
        return os.path.join(os.path.dirname(source), default)
    if os.path.isdir(output) or output.endswith(os.sep):
        os.makedirs(output, exist_ok=True)
        return os.path.join(output, default)
    return output


def _torch_load(torch, path):
    """``path``'s object, its tensors mapped from the file where its format allows."""
    try:
        try:
            return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
            # The legacy format (before PyTorch 1.6), or no zip archive at all: read whole.
            return torch.load(path, weights_only=True, map_location="cpu")
    except (OSError, MemoryError):
        raise
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        unsupported = next((line for line in lines if "Unsupported global" in line), None)
        if unsupported is not None:
            what = unsupported.replace("WeightsUnpickler error: ", "").split(" was not an allowed global")[0]
            raise _Refused(
                f"{path}: torch.load(weights_only=True) refused it ({what}): convert never runs code "
                "from a pickle; save the state dict alone (torch.save(model.state_dict(), path)) "
                "and convert that"
            ) from None
        detail = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
        raise _Refused(
            f"{path}: not a PyTorch checkpoint that torch.load(weights_only=True) reads "
            f"({type(e).__name__}: {detail})"
        ) from None


def _load_index(torch, index_path, bar):
    """The tensors of sharded pickles, each from the file ``index_path`` names for it, in
    the files' order and each file's own order."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise _Refused(f"{index_path}: not an index of checkpoint shards ({e!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _Refused(f"{index_path}: not an index of checkpoint shards (its weight_map is no dict of file names)")
    folder = os.path.dirname(index_path)
    tree = {}
    files = sorted(set(weight_map.values()))
    bar.set_length(len(files))
    for done, file in enumerate(files):
        if os.path.basename(file) != file:
            raise _Refused(f"{index_path}: shard {file!r} is not a file name in the index's folder")
        bar.set_position(done)
        bar.set_message(f"reading {file}")
        shard = _torch_load(torch, os.path.join(folder, file))
        if not isinstance(shard, dict):
            raise _Refused(f"{file}: holds a {type(shard).__name__}, not a dict of tensors")
        for name, value in shard.items():
            if weight_map.get(name) == file:
                tree[name] = value
    missing = [name for name in weight_map if name not in tree]
    if missing:
        raise _Refused(
            f"{index_path}: {len(missing)} tensors are missing from the shards it names them in "
            f"(first: {missing[0]!r} in {weight_map[missing[0]]!r})"
        )
    return tree


def _prepared(torch, obj):
    """``obj`` as ``tensorferry.save`` takes it, the tensors it will store (each once), and
    notes on what was done for them.

    Containers become dict, list and tuple; plain values are kept; anything else is refused
    naming its key. Tensors are detached (parameters come back as plain tensors). A tensor
    given under several keys is stored once, and loads back as one tensor (tied weights);
    views that overlap otherwise (parts of one storage) cannot be stored as views, so each
    such view is written as a copy of its own."""
    tensors = []  # (dotted name, tensor) in tree order

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            return tensor(value, path)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise _Refused(
                        f"key {dotted(path + [repr(k)])!r}: a {type(k).__name__} key, which a "
                        "safetensors file cannot hold (str and int keys can be kept)"
                    )
                out[k] = walk(v, path + [str(k)])
            return out
        if isinstance(value, (list, tuple)):
            items = [walk(v, path + [str(i)]) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        raise _Refused(
            f"key {dotted(path)!r}: a {type(value).__module__}.{type(value).__qualname__}, which a "
            "safetensors file cannot hold (tensors, and str, int, float, bool and None in dicts, "
            "lists and tuples, are kept)"
        )

    def tensor(t, path):
        if t.layout != torch.strided or t.is_quantized:
            raise _Refused(
                f"key {dotted(path)!r}: a {'quantized' if t.is_quantized else t.layout} tensor; a "
                "safetensors file holds dense tensors only (convert it with .dequantize() or "
                ".to_dense() first)"
            )
        if t.device.type == "meta":
            raise _Refused(f"key {dotted(path)!r}: a tensor on the meta device holds no data")
        t = t.detach()
        tensors.append((dotted(path), t))
        return t

    tree = walk(obj, [])
    if not isinstance(tree, (dict, list, tuple)):
        raise _Refused(f"the checkpoint holds a {type(obj).__name__}, not a dict of tensors")
    tree, stored, notes = _untangled(tree, tensors)
    return tree, stored, notes


def _untangled(tree, tensors):
    """Tensors sharing memory: the same view under several keys stays shared (save stores
    it once, by its memory); a view overlapping another in any other way is replaced by a
    copy (and that copy's own ties by the same copy)."""
    first_of_view = {}  # view -> (name, tensor stored for it)
    spans = {}  # storage -> [(begin, end)] of the views stored from it
    stored, tied, copied, replace = [], [], [], {}
    for name, t in tensors:
        if t.numel() == 0:
            stored.append(t)
            continue
        view = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if view in first_of_view:
            first, kept = first_of_view[view]
            tied.append((name, first))
            if kept.data_ptr() != t.data_ptr():
                replace[id(t)] = kept
            continue
        begin, end, _ = _select._memory_of(t)
        kept = spans.setdefault(t.untyped_storage().data_ptr(), [])
        if any(b < end and begin < e for b, e in kept):
            copy = replace[id(t)] = t.clone()
            copied.append(name)
            first_of_view[view] = (name, copy)
            stored.append(copy)
            continue
        kept.append((begin, end))
        first_of_view[view] = (name, t)
        stored.append(t)
    if replace:
        tree = _native.rebuild(tree, replace)
    notes = []
    if tied:
        shown = ", ".join(f"{a} = {b}" for a, b in tied[:3]) + (", ..." if len(tied) > 3 else "")
        notes.append(f"  {_count(len(tied), 'tied tensor')} stored once, loaded back shared: {shown}")
    if copied:
        shown = ", ".join(copied[:3]) + (", ..." if len(copied) > 3 else "")
        notes.append(f"  {_count(len(copied), 'view')} overlapping another tensor's memory written as copies: {shown}")
    return tree, stored, notes


def _count(n, what):
    return f"{n} {what}{'' if n == 1 else 's'}"


def _say(what):
    """One line on stderr, as the native command says a failure."""
    line = str(what).replace("\n", " ")
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    try:
        print(f"{_PROG}: {line}", file=sys.stderr, flush=True)
    except OSError:
        pass


def _quiet_stdout():
    # Python flushes stdout again at exit, which would fail once more on the closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
