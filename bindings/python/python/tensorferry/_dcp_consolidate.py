"""Consolidation of a DCP checkpoint written by :class:`tensorferry.dcp.TensorferryWriter`
into one Hugging Face style safetensors checkpoint (see :func:`consolidate`)."""

import json
import math
import os
import re

from . import _dcp_io, _native
from ._errors import FormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: The largest index of an earlier consolidation read (to remove its shards).
_MAX_INDEX_BYTES = 64 << 20


def _shard_name(i, n):
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def consolidate(dcp_dir, out_dir, *, max_shard_size=None, prefix=None, fsync=True):
    """Turns the sharded DCP checkpoint in ``dcp_dir`` (written by
    :class:`~tensorferry.dcp.TensorferryWriter`, on any number of ranks) into one Hugging
    Face style checkpoint in ``out_dir``: every tensor whole (DTensor/FSDP shards stitched
    back by the offsets DCP recorded), in ``model.safetensors``, or, past
    ``max_shard_size`` (bytes, or "5GB"/"2GiB"), in ``model-0000i-of-0000n.safetensors``
    files with a ``model.safetensors.index.json`` (``metadata.total_size`` and
    ``weight_map``) — files the ``safetensors`` package, transformers and
    :func:`tensorferry.load` read.

    ``prefix`` keeps only the tensors whose name starts with it and strips it (``"model."``
    turns DCP's ``model.lm_head.weight`` into ``lm_head.weight``). Non-tensor items (an
    optimizer's step counters, learning rates) have no place in such a checkpoint and are
    left out. Each output file is built in memory (at most ``max_shard_size`` of tensors,
    or one tensor larger than it) and written atomically, the index last. Once all are
    written, what an earlier consolidation left in ``out_dir`` and this one did not write
    again is removed — ``model.safetensors``, ``model.safetensors.index.json`` and the
    ``model-0000i-of-0000n.safetensors`` files its index named — and nothing else in the
    folder. Returns the paths written.

    Chunks that overlap, leave a gap or lie outside their tensor, a chunk missing, a rank
    file of another save, or a damaged file is a :class:`~tensorferry.FormatError` naming
    the file. Needs PyTorch (for DCP's metadata classes).

    >>> from tensorferry.dcp import consolidate                 # doctest: +SKIP
    >>> consolidate("ckpt/step-100", "hf/step-100", max_shard_size="5GB", prefix="model.")  # doctest: +SKIP
    """
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from . import _api, _cast_load, _dcp_metadata

    dcp_dir, out_dir = os.fspath(dcp_dir), os.fspath(out_dir)
    metadata = _dcp_metadata.load(os.path.join(dcp_dir, _dcp_io.METADATA_FILE))
    limit = None if max_shard_size is None else _api._parse_size(max_shard_size)
    wanted = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or (prefix and not fqn.startswith(prefix)):
            continue
        name = fqn[len(prefix):] if prefix else fqn
        nbytes = md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
        wanted.append((name, nbytes, fqn, md))
    if not wanted:
        raise FormatError(f"{dcp_dir}: no tensor to consolidate" + (f" under the prefix {prefix!r}" if prefix else ""))

    os.makedirs(out_dir, exist_ok=True)
    earlier = _earlier_output(out_dir)
    save_id = metadata.storage_meta.save_id if metadata.storage_meta is not None else None
    # Shards of at most ``limit`` bytes (a larger tensor alone), in order, as transformers cuts them.
    shards = _cast_load._groups(wanted, math.inf if limit is None else limit, nbytes=lambda t: t[1])
    headers, written, weight_map = {}, [], {}
    try:
        for i, shard in enumerate(shards):
            tensors = {}
            for name, _, fqn, md in shard:
                # Every chunk found in its rank's file, its shape as the metadata says, before
                # the tensor's memory is taken (the metadata may claim any size).
                stored = []
                for index, chunk in enumerate(md.chunks):
                    info = (metadata.storage_data or {}).get(MetadataIndex(fqn, chunk.offsets, index))
                    if info is None:
                        raise FormatError(f"{os.path.join(dcp_dir, _dcp_io.METADATA_FILE)}: names no file for {fqn} at "
                                          f"{list(chunk.offsets)}")
                    path = os.path.join(dcp_dir, info.file)
                    stored.append((path, chunk, _chunk_entry(path, info.name, chunk, headers, save_id)))
                # The metadata reader checked that the chunks tile the tensor exactly: every
                # element of ``full`` is read once.
                full = torch.empty(md.size, dtype=md.properties.dtype)
                for path, chunk, (fd, entry) in stored:
                    _read_chunk(fd, path, entry, chunk, full)
                tensors[name] = full
            file = SINGLE_FILE if len(shards) == 1 else _shard_name(i, len(shards))
            path = os.path.join(out_dir, file)
            _api.save(tensors, path, metadata={"format": "pt"}, fsync=fsync)
            written.append(path)
            weight_map.update({name: file for name in tensors})
    finally:
        for fd, _ in headers.values():
            _dcp_io.close(fd)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t[1] for t in wanted)}, "weight_map": weight_map}
        path = os.path.join(out_dir, INDEX_FILE)
        _native.put(path, json.dumps(index, indent=2).encode(), fsync)
        written.append(path)
    for name in earlier - {os.path.basename(p) for p in written}:
        try:
            os.remove(os.path.join(out_dir, name))
        except FileNotFoundError:
            pass
    return written


def _earlier_output(out_dir):
    """The files of an earlier consolidation in ``out_dir``: its single file, its index
    and the shards that index names (names of consolidate's pattern only)."""
    found = {name for name in (SINGLE_FILE, INDEX_FILE) if os.path.isfile(os.path.join(out_dir, name))}
    if INDEX_FILE in found:
        try:
            index = json.loads(_dcp_io.read_small_file(os.path.join(out_dir, INDEX_FILE), _MAX_INDEX_BYTES))
            names = set(index["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            names = set()  # not an index of ours: its shards are left alone
        found |= {n for n in names if isinstance(n, str) and _SHARD.fullmatch(n)}
    return found


def _chunk_entry(path, name, chunk, headers, save_id):
    """``(fd, entry)`` of the stored chunk ``name`` of ``path``, its shape checked against
    ``chunk``'s (``headers`` keeps each file open and its header read once)."""
    if path not in headers:
        fd = _dcp_io.open_read(path)
        try:
            headers[path] = (fd, _dcp_io.read_header(fd, path, save_id=save_id))
        except BaseException:
            _dcp_io.close(fd)
            raise
    fd, entries = headers[path]
    entry = entries.get(name)
    if entry is None:
        raise FormatError(f"{path}: holds no tensor {name!r}, which the checkpoint's metadata names")
    if entry.shape != tuple(chunk.sizes):
        raise FormatError(f"{path}: {name} is {list(entry.shape)} in the file, the metadata says {list(chunk.sizes)}")
    return fd, entry


def _read_chunk(fd, path, entry, chunk, full):
    """Reads the stored chunk ``entry`` of ``path`` (open as ``fd``) into its place in ``full``."""
    import torch

    place = full
    for dim, (offset, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
        place = place.narrow(dim, offset, length)
    dest = place if place.is_contiguous() else torch.empty(tuple(chunk.sizes), dtype=full.dtype)
    if dest.numel():
        _dcp_io.read_runs(fd, path, entry, [(0, entry.end - entry.begin)], _dcp_io.byte_view(dest))
    if dest is not place:
        place.copy_(dest)
