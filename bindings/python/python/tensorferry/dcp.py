"""tensorferry as the storage layer of PyTorch's distributed checkpoint (DCP).

``torch.distributed.checkpoint`` plans what every rank saves and loads; a storage layer
decides where the bytes go. This module's layer writes each rank's items as ONE safetensors
file (``__{rank}_{save id}.safetensors``) through :func:`tensorferry.save` — atomic, readable by
``safetensors`` and every tool that reads it — and DCP's metadata (``.metadata``) beside
it. Loading reads each needed file's header once, then only the byte runs of the chunks
the rank's plan asks for (tensorferry's native positioned reads at their offsets, straight
into the planner's tensor when it is contiguous host memory), whatever the number of ranks that saved; the reader
counts what it read in ``reader.read_stats``.

>>> import torch, torch.distributed.checkpoint as dcp            # doctest: +SKIP
>>> from tensorferry.dcp import TensorferryWriter, TensorferryReader  # doctest: +SKIP
>>> dcp.save(state, storage_writer=TensorferryWriter("ckpt/step-100"))  # doctest: +SKIP
>>> dcp.load(state, storage_reader=TensorferryReader("ckpt/step-100"))  # doctest: +SKIP

Failures: every save — a writer used again without a ``checkpoint_id`` included — gets a
new save id (the coordinator's, for all ranks), writes files of new names that carry it,
and commits by writing ``.metadata`` last (atomically), so a save that fails or is killed
on any rank leaves the previous checkpoint in the folder loadable; once committed, it
removes the rank files the replaced ``.metadata`` named, and no other file (those of a
save that failed stay, never read). An exception on one rank fails ``dcp.save`` on every
rank (DCP gathers it); ``TensorferryWriter(..., overwrite=False)`` refuses an existing
checkpoint. On load, a missing rank file is a ``FileNotFoundError`` naming it, a damaged
one or one of another save (its ``DCP_SAVE_ID`` is not the metadata's) a
:class:`tensorferry.FormatError` naming it; anything but a regular file is refused at once.

``.metadata`` is read without ``pickle`` (see ``_dcp_metadata``): a checkpoint from a
stranger cannot run code, and metadata that is not what a DCP save writes is a
:class:`tensorferry.FormatError` naming it. Non-tensor items (byte items), which DCP's
planner unpickles, are first read by ``torch.load(weights_only=True)``: one whose pickle
would load more than plain values and tensors is a :class:`tensorferry.FormatError` naming
it, and nothing of it runs.

:func:`consolidate` turns such a checkpoint (saved on any number of ranks) into one Hugging
Face style checkpoint: whole tensors in ``model.safetensors`` or in
``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json``.

Importing this module does not import PyTorch: the classes are built on first access
(``from tensorferry.dcp import TensorferryWriter``), so ``import tensorferry.dcp`` works
where torch is absent and only using the classes needs it.

In each rank file a tensor chunk is named by its fully qualified name (``model.w``); a
second chunk of the same name on one rank gets ``@`` and its offsets (``model.w@4_0``).
Non-tensor items (DCP pickles them into bytes: an optimizer's ``step``, ``lr``) are stored
as uint8 tensors under their name. The header's ``DCP_SHARDING_INFO`` metadata, in the
spelling of DCP's Hugging Face layer, gives each tensor's fqn, offsets in the full tensor
and whether it holds bytes; ``DCP_SAVE_ID`` names the save that wrote the file.
"""

import dataclasses
import errno
import io
import json
import os
import pickle
import uuid

from ._dcp_consolidate import consolidate
from ._dcp_io import METADATA_FILE, ReadStats, StorageInfo, byte_view

__all__ = ["TensorferryWriter", "TensorferryReader", "TensorferryStager", "ReadStats", "consolidate"]

SUFFIX = ".safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
#: The key, in a rank file's safetensors metadata, of the id of the save that wrote it.
SAVE_ID_KEY = "DCP_SAVE_ID"


@dataclasses.dataclass(frozen=True)
class _RankTarget:
    """What a save's plan tells a rank: the file it writes and the save's id (the
    coordinator's, so that every rank of one save names the same save)."""

    file: str
    save_id: str


def _check_plain_pickle(raw, path, fqn):
    """Refuses a byte item (a non-tensor value DCP pickled: an optimizer's ``step``, a
    list) whose pickle would load anything but plain values and tensors.

    DCP's planners unpickle byte items with ``torch.load(weights_only=False)``, which runs
    whatever a crafted pickle asks. The same bytes are first read with
    ``torch.load(weights_only=True)``, PyTorch's restricted unpickler: a pickle it accepts
    names only the globals it allows (plain containers, numbers, strings, tensors, and the
    types a user allowed with ``torch.serialization.add_safe_globals``), so the planner's
    full unpickling of it runs nothing else.
    """
    import torch

    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # the restricted unpickler's refusal (UnpicklingError, ...)
        from ._errors import FormatError

        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormatError(
            f"{path}: the value {fqn!r} is a pickle that loads more than plain values and tensors "
            f"(torch.load(weights_only=True) refused it: {reason}); tensorferry never unpickles such "
            "an item. A type of your own that you trust can be allowed with "
            "torch.serialization.add_safe_globals([...])"
        ) from None


def _rank_target(rank, save_id):
    """The file of one rank in one save: a name of its own for every save, so that a save
    into a folder that holds a checkpoint never touches that checkpoint's files until the
    new metadata is committed (a rank killed mid-save leaves the previous one loadable)."""
    return _RankTarget(f"__{rank}_{save_id}{SUFFIX}", save_id)


def _files_named_by(path):
    """The rank files the metadata at ``path`` names; none if there is no readable one."""
    from . import _dcp_metadata

    try:
        metadata = _dcp_metadata.load(path)
    except (OSError, ValueError):
        return set()
    return {info.file for info in (metadata.storage_data or {}).values()}


def _remove_files(folder, names):
    """Removes the files ``names`` (rank files a replaced checkpoint named) from
    ``folder`` (a local folder or an object-storage URL). Best effort: a file that stays
    is never read."""
    from . import _native

    for name in names:
        try:
            if _native.is_url(folder):
                _native.object_delete(os.path.join(folder, name))
            else:
                os.remove(os.path.join(folder, name))
        except OSError:
            pass


def _exists(path):
    """Whether the file, or the object at that URL, exists."""
    from . import _native

    if not _native.is_url(path):
        return os.path.exists(path)
    try:
        _native.object_head(path)
    except FileNotFoundError:
        return False
    return True


def _metadata_file(rank=None):
    return METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"


def _build():
    """The classes, which subclass torch's and so need it: built once, on first access."""
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.futures import Future

    from . import _api, _dcp_io, _dcp_metadata, _native
    from . import _frameworks as fw
    from ._errors import FormatError, io_error

    def done(value):
        fut = Future()
        fut.set_result(value)
        return fut

    # Unsigned 16, 32 and 64-bit ints only where this torch has them.
    dtypes = {code: getattr(torch, name) for code, name in _dcp_io.TORCH_NAMES.items() if hasattr(torch, name)}

    class TensorferryWriter(StorageWriter):
        """Writes a DCP checkpoint into the folder ``path``: one safetensors file per rank,
        written atomically by :func:`tensorferry.save`, and ``.metadata`` (written last,
        atomically, by the coordinator) that makes it a checkpoint.

        ``sync_files=False`` skips fsync (faster; a crash may then leave a checkpoint whose
        metadata names data that never reached the disk). ``overwrite=False`` refuses to
        save into a folder that already holds a checkpoint (a ``FileExistsError`` on every
        rank, as DCP's ``FileSystemWriter(overwrite=False)``); with the default ``True`` a
        new save replaces it safely: every save (a writer used again included) gets a new
        id, agreed by all ranks through the coordinator's plan, and files of new names that
        carry it; once the new metadata is committed, the files the replaced metadata named
        are removed, and no other file.

        ``path`` may be an object-storage folder (``s3://bucket/ckpt``): rank files are
        uploaded as :func:`tensorferry.save` uploads them, and ``.metadata`` is one PUT,
        last, which commits the checkpoint as the rename does for files.
        """

        def __init__(self, path, *, sync_files=True, overwrite=True):
            super().__init__()
            self.path = os.fspath(path)
            self.sync_files = sync_files
            self.overwrite = overwrite
            self.rank = None
            self.use_collectives = True
            self.save_id = uuid.uuid4().hex

        def reset(self, checkpoint_id=None):
            if checkpoint_id:
                self.path = os.fspath(checkpoint_id)
            self.save_id = uuid.uuid4().hex

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            try:
                os.fspath(checkpoint_id)
            except TypeError:
                return False
            return True

        @property
        def checkpoint_id(self):
            return self.path

        def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
            # Called by every save on every rank, reset() only when a checkpoint_id is
            # passed: a new save id here. The coordinator's is the one all ranks use.
            self.save_id = uuid.uuid4().hex
            self.is_coordinator = is_coordinator
            self.rank = kwargs.get("rank")
            self.use_collectives = kwargs.get("use_collectives", True)

        def storage_meta(self):
            return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            if not _native.is_url(self.path):  # object storage has no folders to make
                os.makedirs(self.path, exist_ok=True)
            if not self.overwrite:
                rank = self.rank if not self.use_collectives and self.rank is not None else None
                existing = os.path.join(self.path, _metadata_file(rank))
                if _exists(existing):
                    raise io_error(errno.EEXIST, "a checkpoint exists there and overwrite=False", existing)
            if self.rank is not None and not self.use_collectives:
                # No global plan: every rank names its own file.
                plan = dataclasses.replace(plan, storage_data=_rank_target(self.rank, self.save_id))
            return plan

        def prepare_global_plan(self, plans):
            return [
                plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=_rank_target(i, self.save_id))
                for i, plan in enumerate(plans)
            ]

        def write_data(self, plan: SavePlan, planner: SavePlanner):
            target = plan.storage_data
            if not isinstance(target, _RankTarget):
                target = _rank_target(self.rank or 0, self.save_id)
            file = target.file
            tensors, info, results = {}, {}, []
            for item in plan.items:
                data = planner.resolve_data(item)
                name = item.index.fqn
                if name in tensors:
                    name = f"{name}@{'_'.join(map(str, item.index.offset or ()))}"
                if name in tensors:
                    raise FormatError(f"two items of one rank would be stored as {name!r} in {file}")
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue()
                    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                    info[name] = {"fqn": item.index.fqn, "bytes": True}
                    size = len(raw)
                else:
                    tensor = data.detach()
                    if tensor.is_sparse or tensor.layout != torch.strided:
                        raise FormatError(f"{item.index.fqn}: only dense tensors can be saved, not {tensor.layout}")
                    offsets = list(item.tensor_data.chunk.offsets) if item.tensor_data is not None else []
                    info[name] = {"fqn": item.index.fqn, "saved_offsets": offsets}
                    size = tensor.numel() * tensor.element_size()
                tensors[name] = tensor
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=StorageInfo(file, name)))
            _api.save(
                tensors,
                os.path.join(self.path, file),
                metadata={"format": "pt", SHARDING_INFO_KEY: json.dumps(info), SAVE_ID_KEY: target.save_id},
                fsync=self.sync_files,
            )
            return done(results)

        def finish(self, metadata: Metadata, results) -> None:
            storage = {}
            for rank_results in results:
                storage.update({r.index: r.storage_data for r in rank_results})
            metadata.storage_data = storage
            metadata.storage_meta = self.storage_meta()
            named = {info.file for info in storage.values()}
            if any(not name.endswith(f"_{self.save_id}{SUFFIX}") for name in named):
                raise FormatError(f"{self.path}: the ranks wrote files of another save than {self.save_id}: {sorted(named)}")
            rank = self.rank if not self.use_collectives and self.rank is not None else None
            path = os.path.join(self.path, _metadata_file(rank))
            replaced = _files_named_by(path)
            blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
            # Replaced as tf.save replaces a file (an object: one PUT): whole, or not at all.
            _native.put(path, blob, self.sync_files)
            # Committed: what the replaced checkpoint named is no longer needed.
            _remove_files(self.path, replaced - named)

    # Scratch blocks (reads for targets that are not contiguous host memory) held at once.
    _SCRATCH_BYTES = 256 << 20

    class TensorferryReader(StorageReader):
        """Reads a checkpoint written by :class:`TensorferryWriter` from the folder ``path``.

        Each rank reads the header of every file it needs once, then only the byte runs of
        the chunks its plan names (any resharding DCP plans), with native positioned reads
        straight into the planner's tensor when that is contiguous host memory, else into scratch blocks
        (at most 256 MB at a time) copied once. Reads run on ``read_threads`` threads
        (default: up to 4, one per core): page-cache copies side by side, pieces of a large
        tensor included. A damaged file is a :class:`tensorferry.FormatError` naming it.

        ``read_stats`` (a :class:`ReadStats`, reset by every load) counts the bytes needed
        and the bytes read: data, and headers apart.

        ``path`` may be an object-storage folder (``s3://bucket/ckpt``, as
        :func:`tensorferry.load` takes them): each header comes from a ranged GET, and the
        byte runs from parallel ranged GETs of the version of the file whose header was
        read (a file replaced meanwhile is an error).
        """

        def __init__(self, path, *, read_threads=None):
            super().__init__()
            self.read_threads = int(read_threads) if read_threads else min(4, os.cpu_count() or 1)
            self.path = os.fspath(path)
            self.storage_data = {}
            self.chunk_sizes = {}
            self.load_id = uuid.uuid4().hex
            self.save_id = None
            self.read_stats = _dcp_io.ReadStats()

        def reset(self, checkpoint_id=None):
            self.storage_data = {}
            if checkpoint_id:
                self.path = os.fspath(checkpoint_id)
            self.load_id = uuid.uuid4().hex
            self.read_stats = _dcp_io.ReadStats()

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            try:
                path = os.fspath(checkpoint_id)
                return _native.is_url(path) or os.path.isdir(path)
            except TypeError:
                return False

        @property
        def checkpoint_id(self):
            return self.path

        def read_metadata(self, *args, **kwargs) -> Metadata:
            metadata = _dcp_metadata.load(os.path.join(self.path, _metadata_file(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata: Metadata, is_coordinator, *args, **kwargs):
            if metadata.storage_data is None:
                raise FormatError(f"{self.path}: the checkpoint's metadata says where no item is stored")
            self.storage_data = metadata.storage_data
            self.save_id = metadata.storage_meta.save_id if metadata.storage_meta is not None else None
            # Each saved chunk's size, by (fqn, offsets): a rank file must hold it as such.
            self.chunk_sizes = {
                (fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
                for fqn, md in metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)
                for chunk in md.chunks
            }

        def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def read_data(self, plan: LoadPlan, planner: LoadPlanner):
            per_file = {}
            for item in plan.items:
                where = self.storage_data.get(item.storage_index)
                if where is None:
                    raise FormatError(
                        f"{os.path.join(self.path, METADATA_FILE)}: says where no part of {item.storage_index.fqn} "
                        f"at {list(item.storage_index.offset or ())} is stored")
                per_file.setdefault(where.file, []).append((item, where.name))
            for file, items in per_file.items():
                path = os.path.join(self.path, file)
                fd = _dcp_io.open_read(path)
                try:
                    entries = _dcp_io.read_header(fd, path, self.read_stats, save_id=self.save_id)
                    # In file order: one forward pass over the file, whatever the plan's order.
                    items.sort(key=lambda pair: entries[pair[1]].begin if pair[1] in entries else -1)
                    batch, scratch = [], 0
                    for item, name in items:
                        entry = entries.get(name)
                        if entry is None:
                            raise FormatError(f"{path}: holds no tensor {name!r}, which the checkpoint's metadata names")
                        if item.type == LoadItemType.BYTE_IO:
                            self._read_bytes(planner, item, fd, path, entry)
                            continue
                        prepared = self._prepare_item(planner, item, path, entry)
                        batch.append(prepared)
                        if not prepared[3]:
                            scratch += prepared[2].numel() * prepared[2].element_size()
                        if scratch >= _SCRATCH_BYTES:
                            self._read_batch(planner, batch, fd, path)
                            batch, scratch = [], 0
                    self._read_batch(planner, batch, fd, path)
                finally:
                    _dcp_io.close(fd)
            return done(None)

        def _read_bytes(self, planner, item, fd, path, entry):
            raw = bytearray(entry.end - entry.begin)
            self.read_stats.needed += len(raw)
            _dcp_io.read_runs(fd, path, entry, [(0, len(raw))] if raw else [], memoryview(raw), self.read_stats)
            _check_plain_pickle(raw, path, item.storage_index.fqn)
            planner.load_bytes(item, io.BytesIO(raw))

        def _read_batch(self, planner, batch, fd, path):
            """Reads the byte runs of prepared items on several threads, then copies each
            scratch block to its tensor and commits the tensors, in order (the planner is
            called from this thread only)."""
            todo = []
            for _, _, dest, _, runs, entry in batch:
                if runs:
                    todo.extend(_dcp_io.pieces(entry, runs, byte_view(dest)))
            _dcp_io.read_pieces(fd, path, todo, self.read_threads, self.read_stats)
            for item, target, dest, direct, _, _ in batch:
                if not direct:
                    target.copy_(dest)
                planner.commit_tensor(item, target)

        def _prepare_item(self, planner, item, path, entry):
            """Checks a tensor item against the file and the plan and resolves its tensor:
            ``(item, target, dest, direct, runs, entry)``, where the runs are read into
            ``dest`` — the target itself when it is contiguous host memory."""
            stats = self.read_stats
            index = item.storage_index
            saved = self.chunk_sizes.get((index.fqn, tuple(index.offset or ())))
            if saved is not None and saved != entry.shape:
                raise FormatError(
                    f"{path}: {index.fqn} at {list(index.offset)} is {list(entry.shape)} in the file, the checkpoint's "
                    f"metadata says {list(saved)} (a file of another save?)"
                )
            dtype = dtypes.get(entry.dtype)
            offsets, lengths = list(item.storage_offsets), list(item.lengths)
            if len(offsets) != len(entry.shape) or any(o + n > d for o, n, d in zip(offsets, lengths, entry.shape)):
                raise FormatError(
                    f"{path}: {item.storage_index.fqn} is {list(entry.shape)} in the file, the plan asks for "
                    f"{lengths} at {offsets}"
                )
            target = planner.resolve_tensor(item).detach()
            if list(target.size()) != lengths:
                raise FormatError(
                    f"{path}: {item.storage_index.fqn} at {offsets} holds {lengths}, the plan's tensor is {list(target.size())}"
                )
            if target.dtype != dtype:
                raise FormatError(f"{path}: {item.storage_index.fqn} is {dtype} in the file, {target.dtype} in the state dict")
            runs = _dcp_io.byte_runs(entry.shape, _dcp_io.ITEM_SIZE[entry.dtype], offsets, lengths)
            nbytes = target.numel() * target.element_size()
            stats.needed += nbytes
            # Straight into the planner's tensor when it is one contiguous block of host
            # memory; else into one scratch block, then one copy (to a device, a view).
            direct = target.device.type == "cpu" and target.is_contiguous()
            dest = target if direct else torch.empty(lengths, dtype=dtype)
            return item, target, dest, direct, runs if nbytes else [], entry

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a PyTorch without DTensor
        DTensor = ()

    class TensorferryStager(AsyncStager):
        """Stages a state dict for ``dcp.async_save(..., async_stager=...)`` by
        :func:`tensorferry.to_host` with ``copy=True, pinned=True``: one planned transfer of
        every device tensor into the device's pinned pool (reused by the next stage), host
        tensors copied. DTensors (FSDP2, tensor parallel) are staged by their local shard
        and come back as DTensors of the same mesh, placements and global shape.
        Blocking: when ``stage`` returns, training may change its tensors."""

        _synchronize_after_execute = False

        def stage(self, state_dict):
            dtensors = {p: t for p, t in _native.collect_tensors(state_dict, fw.kind_of) if isinstance(t, DTensor)}
            if not dtensors:
                return _api.to_host(state_dict, copy=True, pinned=True)
            # Each DTensor staged by its local shard, then made a DTensor again, of the staged
            # copy (once for a DTensor under two keys).
            local = _native.rebuild(state_dict, {id(d): d.to_local() for d in dtensors.values()})
            staged = _api.to_host(local, copy=True, pinned=True)
            again = {}
            for path, s in _native.collect_tensors(staged, fw.kind_of):
                if path in dtensors and id(s) not in again:
                    d = dtensors[path]
                    again[id(s)] = DTensor.from_local(
                        s, d.device_mesh, d.placements, shape=d.shape, stride=d.stride(), run_check=False
                    )
            return _native.rebuild(staged, again)

        def synchronize_staging(self):
            pass

        def close(self):
            pass

    return {"TensorferryWriter": TensorferryWriter, "TensorferryReader": TensorferryReader, "TensorferryStager": TensorferryStager}


def __getattr__(name):
    if name in __all__:
        built = _build()
        for cls in built.values():
            cls.__module__ = __name__
        globals().update(built)
        return built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
