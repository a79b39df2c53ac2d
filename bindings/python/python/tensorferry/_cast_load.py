"""Loads that go a group of tensors at a time: casts (``dtype=``) onto a device, and
``out=`` filled from object storage.

A device holds no kernels of tensorferry's own, so a cast runs on the host before the
bytes cross. Cast as a whole, a checkpoint would sit in host memory twice (read, then
cast); here its tensors go in groups of about :data:`GROUP_BYTES` (a larger tensor is a
group of its own), in file order: each group is read, cast and moved through the staging
ring while the next one is read, so host memory holds two groups and one group's cast,
whatever the checkpoint's size.

A local file's groups are views of its memory map. A checkpoint in object storage is read
a group at a time with ranged GETs of those tensors alone; each object's version is pinned
when the load starts (its ETag, and the index's), and a checkpoint replaced meanwhile is an
error, never a mix of two saves.

``out=`` filled from object storage goes the same way (:func:`into`), so that host memory
holds two groups, not the checkpoint.
"""

import os
from concurrent.futures import ThreadPoolExecutor

from . import _fanout
from . import _frameworks as fw
from . import _native
from . import _progress
from . import _select
from ._tree import dotted

#: Host bytes of one group of tensors (``TENSORFERRY_CAST_GROUP_BYTES`` sets another).
GROUP_BYTES = 256 << 20


def group_bytes():
    """The bytes of one group: :data:`GROUP_BYTES`, unless the environment says otherwise."""
    return int(os.environ.get("TENSORFERRY_CAST_GROUP_BYTES", GROUP_BYTES))


def _groups(leaves, limit, key=lambda leaf: None, nbytes=None):
    """``leaves`` (``[(path, tensor)]``, or items whose bytes ``nbytes(item)`` gives) cut
    greedily, in order, into runs of at most ``limit`` bytes (a larger tensor alone), never
    two ``key``s (files) in one run."""
    runs, run, size, at = [], [], 0, None
    for leaf in leaves:
        n, k = leaf[1].nbytes if nbytes is None else nbytes(leaf), key(leaf)
        if run and (size + n > limit or k != at):
            runs.append(run)
            run, size = [], 0
        run.append(leaf)
        size += n
        at = k
    if run:
        runs.append(run)
    return runs


def _in_groups(groups, read, each):
    """``each(group, read(group))`` for each of ``groups`` in turn, the next group read on
    a thread of its own meanwhile: two groups' host tensors live at once, at most. An
    exception (Ctrl-C too) returns at once: a read still running finishes on its own, into
    memory of its own, and is dropped."""
    reader = ThreadPoolExecutor(1, thread_name_prefix="tensorferry-grouped-load")
    done = False
    try:
        ahead = reader.submit(read, groups[0]) if groups else None
        for i, group in enumerate(groups):
            host = ahead.result()
            ahead = reader.submit(read, groups[i + 1]) if i + 1 < len(groups) else None
            each(group, host)
            del host
        done = True
    finally:
        reader.shutdown(wait=done, cancel_futures=not done)


def _bar(leaves, progress_of):
    """A progress bar over the bytes of ``leaves`` for the file ``progress_of``, or None."""
    if not progress_of:
        return None
    return _progress.bar(sum(t.nbytes for _, t in leaves), _progress.named("load", progress_of))


def onto_device(tree, dtype, target, staging, move, progress_of=None, objects=None):
    """``tree`` with every tensor cast to ``dtype`` (narrowing casts only, but on the
    emulated device, where nothing casts) and moved to ``target`` by ``move(tensors, target,
    staging)``, a group at a time. With ``objects`` (an :class:`_Objects`), a group's host
    tensors are fetched from its one object, in the order the objects hold them (read while
    the previous group is cast and moved); without, the leaves are the host tensors.
    ``progress_of`` (a file's name) draws a bar."""
    leaves = _select.distinct(_native.collect_tensors(tree, fw.kind_of))
    read, key = (lambda group: [t for _, t in group]), (lambda leaf: None)
    if objects is not None:
        leaves.sort(key=objects.place)
        read, key = objects.fetcher(fw.NATIVE), objects.file_of_item
    narrowing_only = not target.startswith("emu")
    replacements = {}
    progress = _bar(leaves, progress_of)

    def each(group, host):
        moved = move(_select.cast(host, dtype, narrowing_only), target, staging)
        replacements.update((id(leaf), m) for (_, leaf), m in zip(group, moved))
        if progress is not None:
            progress.update(sum(t.nbytes for _, t in group))

    try:
        _in_groups(_groups(leaves, group_bytes(), key), read, each)
    finally:
        if progress is not None:
            progress.close()
    return _native.rebuild(tree, replacements)


class _Objects:
    """A checkpoint in object storage as its headers describe it, no tensor read: what
    :func:`tensorferry.load` resolves ``path`` to (``top``: an object or an index, and its
    ``files``), the tree it builds (``skeleton``; its tensors view sparse stand-ins), each
    object as its header was read (``objects``: ``_dcp_io.RemoteObject``s; ``headers``:
    ``({name: Entry}, metadata)``), the name each tensor is stored under (``name_of``, by
    ``id``: a tied name is in no header), and the version of each object and of the index
    (``versions``), pinned from here on. ``local_load`` is :func:`tensorferry.load`, which
    builds the skeleton from the headers."""

    def __init__(self, path, local_load):
        is_index, self.top = _native.resolve(path)
        self.save_id, self.file_of, files = None, None, [self.top]
        # The index's version too: a save that replaced it names other shards.
        self.versions = {self.top: _native.object_head(self.top)[1]} if is_index else {}
        index, self.headers, self.objects = None, {}, {}
        if is_index:
            self.file_of, files, self.save_id, index = _fanout._shards(self.top)
        self.skeleton = _fanout._skeleton_of_objects(
            self.top, files, fw.NATIVE, self.objects, self.versions, self.headers, local_load, index
        )
        self.name_of = _select.stored_names(self.skeleton, {n for entries, _ in self.headers.values() for n in entries})
        self.files, self.order = files, {f: i for i, f in enumerate(files)}

    def selected(self, keys):
        """The skeleton pruned to ``keys`` (patterns, as ``load`` takes them)."""
        return _select.select(self.skeleton, _select.patterns(keys))

    def fetcher(self, like):
        """``fetch(group)``: the tensors (``like``: NumPy or native) of a group of the
        skeleton's leaves, all of one object, by one subset load of the version of the
        object whose header the load began with (another version is an error saying it was
        replaced), that header not asked for again. A group of another save (its save id)
        or lacking a name is an error, never a mix."""

        def fetch(group):
            url = self.file(group[0][1])
            names = [self.name_of[id(t)] for _, t in group]
            tree, found, _, _, _ = _native.load(
                url, True, like, fw.importable("ml_dtypes"), only=set(names), pinned=self.objects[url].pinned
            )
            if self.save_id is not None and found.get(_fanout._SAVE_ID_KEY) != self.save_id:
                raise _fanout._other_save(url, self.top)
            by_name = {dotted(p): t for p, t in _native.collect_tensors(tree, fw.kind_of)}
            if not all(n in by_name for n in names):
                raise _fanout._replaced(url)
            return [by_name[n] for n in names]

        return fetch

    def place(self, item):
        """Where the tensor of ``item`` (a skeleton's ``(path, leaf)``) lies: its object's
        place in the checkpoint, and its first byte there. Read in that order, groups are
        as few as the objects allow."""
        url = self.file(item[1])
        return self.order[url], self.headers[url][0][self.name_of[id(item[1])]].begin

    def file_of_item(self, item):
        """The object that stores the tensor of ``item``, a skeleton's ``(path, leaf)``."""
        return self.file(item[1])

    def file(self, leaf):
        """The object that stores the tensor ``leaf`` of the skeleton."""
        return self.top if self.file_of is None else self.file_of[self.name_of[id(leaf)]]


def subset_names(path, keys, local_load):
    """The names a native subset load of ``keys`` from the object-storage checkpoint
    ``path`` takes (as ``only``): each chosen tensor's dotted path, and the name its bytes
    are stored under, which differs for a tied name (``local_load``: see :class:`_Objects`)."""
    objects = _Objects(path, local_load)
    chosen = _native.collect_tensors(objects.selected(keys), fw.kind_of)
    return {dotted(p) for p, _ in chosen} | {objects.name_of[id(t)] for _, t in chosen}


def from_objects(path, dtype, target, staging, move, keys, progress, local_load):
    """``(tree, metadata)``: the checkpoint at the object-storage URL ``path`` (an object,
    an index or a prefix; ``keys``: patterns, as ``load`` takes them) cast to ``dtype`` on
    ``target``, read a group at a time (see :func:`onto_device`). Its tensors are
    ``tensorferry.Tensor``s; ``metadata`` is the first object's. Every group reads the
    version of its object whose header the load began with: the result is one save.
    ``local_load``: see :class:`_Objects`."""
    objects = _Objects(path, local_load)
    skeleton = objects.skeleton if keys is None else objects.selected(keys)
    tree = onto_device(skeleton, dtype, target, staging, move, progress and path, objects)
    return tree, objects.headers[objects.files[0]][1] if objects.files else {}


def into(out, path, dtype, keys, progress, local_load):
    """Fills ``out=`` (PyTorch tensors and NumPy arrays, on any device) from the
    object-storage checkpoint ``path`` a group of tensors at a time, as a cast load reads
    it: host memory holds two groups, whatever the checkpoint's size. Every name, shape,
    dtype and target is checked against the headers before the first byte is fetched, and
    the names ``out=`` ties are compared first (their tensors fetched alone). Each group is
    read (of the version of its object the load began with), put in its targets'
    frameworks and cast whole before any of it is written: a checkpoint of one group is
    written only once all of it is in; past that, a read that fails (the network, an
    object replaced meanwhile) leaves the groups before it written, and its error says how
    many tensors were (a note, which Python shows from 3.11 on). Returns ``out``.
    ``local_load``: see :class:`_Objects`."""
    objects = _Objects(path, local_load)
    skeleton = objects.skeleton if keys is None else objects.selected(keys)
    leaves = _native.collect_tensors(skeleton, fw.kind_of)
    stand_ins = {dotted(p): t for p, t in leaves}
    path_of = {dotted(p): p for p, _ in leaves}
    torch_targets = {dotted(p) for p, t in _native.collect_tensors(out, fw.kind_of) if fw.kind_of(t) == fw.TORCH}
    fetch = objects.fetcher(fw.NATIVE)

    def arrived(group):
        """A group's tensors, each in its target's framework (bfloat16 into PyTorch needs
        no ml_dtypes), cast as ``dtype`` says."""
        paths = [p for p, _ in group]
        kinds = [fw.TORCH if dotted(p) in torch_targets else fw.NUMPY for p in paths]
        host = fw.from_native_many(fetch(group), kinds, paths)
        if dtype is not None:  # the floating dtypes loads cast, as the checks expect
            at = [i for i, (_, leaf) in enumerate(group) if leaf.dtype in _select._FLOATS]
            for i, cast in zip(at, _select.cast([host[i] for i in at], dtype)):
                host[i] = cast
        return host

    fetched = {}

    def value(name):
        """The tensor of ``name`` (compared for the names ``out=`` ties), fetched once."""
        leaf = stand_ins[name]
        if id(leaf) not in fetched:
            fetched[id(leaf)] = arrived([(path_of[name], leaf)])[0]
        return fetched[id(leaf)]

    cast_to = None if dtype is None else _select._dtype_name(dtype)
    targets = _select.fill_targets(out, stand_ins, value, cast_to)
    plain = _select.plain_updates(out, skeleton)
    fetched.clear()
    targets_of = {}
    for name, t in targets.items():
        targets_of.setdefault(id(stand_ins[name]), []).append(t)
    distinct = sorted(_select.distinct(leaves), key=objects.place)
    written = 0
    progress = _bar(distinct, progress and path)

    def each(group, host):
        nonlocal written
        for (_, leaf), source in zip(group, host):
            for t in targets_of[id(leaf)]:
                _select.copy_into(t, source)
            written += 1
        if progress is not None:
            progress.update(sum(t.nbytes for _, t in group))

    try:
        _in_groups(_groups(distinct, group_bytes(), objects.file_of_item), arrived, each)
    except BaseException as e:
        if written:
            note = f"out= is partly filled: {written} of {len(distinct)} tensors were written before this error"
            if hasattr(e, "add_note"):
                e.add_note(note)
            else:  # Python before 3.11 keeps the note, without showing it
                e.__notes__ = [*getattr(e, "__notes__", []), note]
        raise
    finally:
        if progress is not None:
            progress.close()
    for update in plain:
        update()
    return out
