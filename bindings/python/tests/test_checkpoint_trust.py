"""A checkpoint is replaced as a whole or not at all: saves killed at random points, saves
that fail part-way, saves of another layout, two processes and non-blocking saves racing
for one checkpoint. After each, the folder must load as one whole checkpoint, the same one
through tensorferry, through the index with the official `safetensors` package, and
through `transformers.from_pretrained`."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tensorferry as tf

# A checkpoint's tensors all hold one number, its version: a mix of two saves shows as two
# numbers.
_SAVER = textwrap.dedent(
    """
    import sys, numpy as np, tensorferry as tf
    folder, version, shard, names = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
    shapes = {n: tuple(s) for n, s in __import__("json").loads(open(names).read()).items()}
    state = {n: np.full(s, version, np.float32) for n, s in shapes.items()}
    # Plain values travel in the checkpoint's record (the index's, when sharded): a mix of
    # new tensors and old values shows as a step that is not the tensors' version.
    import os
    state["step"] = int(version)
    state["notes"] = f"v{int(version)}" + "x" * int(os.environ.get("TF_NOTES_BYTES", "0"))
    print("go", flush=True)
    tf.save(state, folder + "/model.safetensors", metadata={"format": "pt"},
            max_shard_size=None if shard == "none" else int(shard))
    print("done", flush=True)
    """
)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("torch")
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=64, n_positions=16, tie_word_embeddings=False)
    model = transformers.GPT2LMHeadModel(config)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    names = tmp_path_factory.mktemp("names") / "names.json"
    names.write_text(json.dumps(shapes))
    return transformers, config, names, sum(int(np.prod(s)) * 4 for s in shapes.values())


def _start_save(folder, version, shard, names):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(folder), str(version), str(shard), str(names)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True,
    )
    assert proc.stdout.readline().strip() == "go", proc.stderr.read()
    return proc


def _versions_seen(folder, transformers=None):
    """The version each reader finds in the folder: tensorferry's load, the official
    package by transformers' choice of file (the single file first, else the index), and
    from_pretrained when `transformers` is given. Each must see exactly one version."""
    from safetensors import safe_open

    seen = {}
    loaded = tf.load(folder, like="numpy")
    step, notes = loaded.pop("step"), loaded.pop("notes")
    per_tensor = [np.unique(v) for v in loaded.values()]
    assert all(u.size == 1 for u in per_tensor), "a tensor mixes two saves"
    values = {float(u[0]) for u in per_tensor}
    assert len(values) == 1, f"tensorferry loads a mix of saves: {sorted(values)}"
    seen["tensorferry"] = values.pop()
    assert step == seen["tensorferry"] and notes.startswith(f"v{step}"), (
        f"tensorferry loads the plain values of save {step} with the tensors of save {seen['tensorferry']}"
    )
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        files = {name: single for name in loaded}
    else:
        index = json.loads(open(os.path.join(folder, "model.safetensors.index.json")).read())
        files = {name: os.path.join(folder, f) for name, f in index["weight_map"].items()}
    assert set(files) == set(loaded)
    official = set()
    for name, file in files.items():
        with safe_open(file, "np") as f:
            official.update(np.unique(f.get_tensor(name)).tolist())
    assert len(official) == 1, f"the official reader loads a mix of saves: {sorted(official)}"
    seen["safetensors"] = official.pop()
    if transformers is not None:
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
        hf = {float(v) for p in model.state_dict().values() for v in np.unique(p.detach().numpy())}
        assert len(hf) == 1, f"from_pretrained loads a mix of saves: {sorted(hf)}"
        seen["transformers"] = hf.pop()
    assert len(set(seen.values())) == 1, f"readers disagree: {seen}"
    return seen["tensorferry"]


def _checkpoint_files(folder):
    return sorted(n for n in os.listdir(folder) if n != "config.json")


def test_a_save_killed_at_random_points_leaves_the_old_or_the_new_checkpoint_whole(gpt2, tmp_path):
    transformers, config, names, nbytes = gpt2
    config.save_pretrained(tmp_path)
    # A new seed each run (TF_CRASH_SEED replays one); every failure names it.
    seed = int(os.environ.get("TF_CRASH_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    layouts = ["none", nbytes // 8, nbytes // 3]
    # A first whole save, timed: the kill points spread over a save's length.
    proc = _start_save(tmp_path, 1, layouts[1], names)
    started = time.perf_counter()
    assert proc.stdout.readline().strip() == "done", proc.stderr.read()
    length = time.perf_counter() - started
    assert proc.wait(60) == 0
    current, kills, commits = 1.0, 0, 0
    for run in range(14):
        version = float(run + 2)
        shard = rng.choice(layouts)
        proc = _start_save(tmp_path, version, shard, names)
        # Half the kills land in the first part of a save (its shards), half in the last
        # (its commit: renames, index, links, removals).
        delay = rng.uniform(0, 0.6 * length) if run % 2 else rng.uniform(0.4 * length, 1.2 * length)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        killed = proc.returncode == -signal.SIGKILL
        kills += killed
        try:
            seen = _versions_seen(str(tmp_path), transformers if run % 3 == 0 else None)
        except Exception as e:
            raise AssertionError(f"seed {seed}, run {run}: {e}") from e
        assert seen in (current, version), f"seed {seed}, run {run}: found version {seen}, expected {current} or {version}"
        commits += killed and seen == version
        current = seen
    print(f"save: {length * 1e3:.1f} ms, kills: {kills}, kills after the commit: {commits}")
    # A save that completes cleans what the killed ones left: its own files only.
    proc = _start_save(tmp_path, 99, layouts[1], names)
    assert proc.wait(60) == 0, proc.stderr.read()
    assert _versions_seen(str(tmp_path), transformers) == 99
    files = _checkpoint_files(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files == sorted(set(index["weight_map"].values()) | {"model.safetensors.index.json"}), (seed, files)


# The saver under a file-size limit of 2 MiB (a larger write fails with EFBIG).
_SAVER_LIMITED_TO_2_MIB = textwrap.dedent(
    """
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    """
) + _SAVER


def test_a_save_that_fails_part_way_leaves_the_previous_checkpoint(tmp_path):
    # Shards 1-4 of 1 MiB, shard 5 of 4 MiB, shards 6-8 of 1 MiB; a file-size limit of
    # 2 MiB fails the save with EFBIG at shard 5 (or at once for a single file).
    mib = 1 << 18  # float32 elements in 1 MiB
    shapes = {f"t{i}": [4 * mib if i == 4 else mib] for i in range(8)}
    names = tmp_path / "names.json"
    names.write_text(json.dumps(shapes))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    proc = _start_save(folder, 1, 1 << 20, names)
    assert proc.wait(60) == 0
    for shard in (1 << 20, 3 << 20, "none"):
        result = subprocess.run(
            [sys.executable, "-c", _SAVER_LIMITED_TO_2_MIB, str(folder), "2", str(shard), str(names)],
            capture_output=True, text=True, env=_env(), timeout=60,
        )
        assert result.returncode != 0 and "File too large" in result.stderr, result.stderr
        assert _versions_seen(str(folder)) == 1
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")], "no temporary file is left"


def test_a_failed_index_write_leaves_the_previous_tensors_and_plain_values(tmp_path):
    # Shards of 1 MiB fit a file-size limit of 2 MiB; the index, which carries the plain
    # values' record (a 3 MiB note), does not: the save fails at its last file.
    mib = 1 << 18
    names = tmp_path / "names.json"
    names.write_text(json.dumps({f"t{i}": [mib] for i in range(4)}))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    assert _start_save(folder, 1, 1 << 20, names).wait(60) == 0
    env = {**_env(), "TF_NOTES_BYTES": str(3 << 20)}
    result = subprocess.run(
        [sys.executable, "-c", _SAVER_LIMITED_TO_2_MIB, str(folder), "2", str(1 << 20), str(names)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode != 0 and "File too large" in result.stderr, result.stderr
    assert "index.json" in result.stderr.splitlines()[-1], "the index write failed: " + result.stderr
    assert _versions_seen(str(folder)) == 1
    assert tf.load(folder)["notes"] == "v1"
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")], "no temporary file is left"


def test_two_processes_saving_one_checkpoint_leave_one_whole_checkpoint(gpt2, tmp_path):
    _, config, names, nbytes = gpt2
    for round in range(4):
        a = _start_save(tmp_path, 10 + round, nbytes // 8, names)
        b = _start_save(tmp_path, 20 + round, nbytes // 3, names)
        assert a.wait(60) == 0 and b.wait(60) == 0, a.stderr.read() + b.stderr.read()
        assert _versions_seen(str(tmp_path)) in (10 + round, 20 + round)
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert _checkpoint_files(tmp_path) == sorted(set(index["weight_map"].values()) | {"model.safetensors.index.json"})


def test_non_blocking_saves_to_one_path_land_in_the_order_they_were_called(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    big = {"w": np.full(64 << 20, 1, np.uint8)}
    small = {"w": np.full(16, 2, np.uint8)}
    for second_blocks in (False, True):
        first = tf.save(big, path, non_blocking=True)
        second = tf.save(small, path, non_blocking=not second_blocks)
        first.result()
        if not second_blocks:
            second.result()
        assert tf.load(path)["w"].tolist() == [2] * 16, "the last call wins"
    # Sharded and single-file saves to one checkpoint too, through the folder's name.
    pending = [tf.save(big, tmp_path / "model.safetensors", non_blocking=True, max_shard_size=16 << 20)]
    pending.append(tf.save(small, str(tmp_path) + "/", non_blocking=True))
    for p in pending:
        p.result()
    assert tf.load(tmp_path / "model.safetensors")["w"].tolist() == [2] * 16
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_a_sharded_save_and_its_load_take_the_same_path(tmp_path):
    state = {f"w{i}": np.full(1024, i, np.float32) for i in range(4)}
    with pytest.raises(FileNotFoundError) as info:
        tf.save(state, tmp_path / "ckpt" / "model.safetensors", max_shard_size=4096)
    assert info.value.filename == str(tmp_path / "ckpt"), "the missing folder is named"
    tf.save(state, str(tmp_path / "ckpt") + "/", max_shard_size=4096, metadata={"run": "7"})
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "model.safetensors", tmp_path / "ckpt" / "model.safetensors.index.json"):
        assert tf.load(path)["w3"][0] == 3, path
        assert tf.metadata(path)["run"] == "7", path


@pytest.mark.parametrize(
    "content, says",
    [
        (b"PK\x03\x04" + bytes(64), "zip archive"),
        (b"\x80\x04\x95" + bytes(64), "pickle"),
        (b"hello, this is not a checkpoint\n", "text"),
    ],
)
def test_a_file_of_another_format_is_named_as_such(tmp_path, content, says):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    with pytest.raises(tf.FormatError, match=f"not a safetensors file: it starts like .*{says}"):
        tf.load(path)


def test_a_torch_save_file_is_named_as_such(tmp_path, torch):
    path = tmp_path / "model.bin"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(tf.FormatError, match="zip archive, as torch.save writes"):
        tf.load(path)


def test_a_folder_without_a_checkpoint_says_what_it_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(IsADirectoryError, match=r"find a checkpoint \(a \*\.safetensors file"):
        tf.load(tmp_path)


def _as_nobody(code, folder):
    """Runs `code` in a child process as the user `nobody` when this one is root (root
    bypasses permission bits), else as this user."""
    # Everything is imported first: nobody may not read the interpreter's own folders.
    prelude = "import os, pathlib, numpy, tensorferry\nif os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
    if os.geteuid() == 0:
        os.chmod(folder, 0o777)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=_env(), timeout=60)


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_a_read_only_checkpoint_is_not_replaced():
    import shutil
    import tempfile

    # A folder of its own in the system's temporary folder: nobody cannot enter pytest's.
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "ckpt.safetensors")
    code = textwrap.dedent(
        f"""
        import os, numpy as np, tensorferry as tf
        path = {path!r}
        tf.save({{"w": np.zeros(4)}}, path)
        os.chmod(path, 0o444)
        try:
            tf.save({{"w": np.ones(4)}}, path)
        except PermissionError as e:
            assert isinstance(e, tf.TensorferryError) and e.filename == path, (e, e.filename)
            print("refused")
        assert tf.load(path)["w"].tolist() == [0.0] * 4
        """
    )
    try:
        result = _as_nobody(code, folder)
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 0 and result.stdout.strip() == "refused", result.stderr


@pytest.mark.parametrize("non_blocking", [False, True])
def test_tied_tensors_are_stored_once_and_overlaps_refused_blocking_or_not(torch, tmp_path, non_blocking):
    w = torch.randn(4, 4)
    path = tmp_path / "tied.safetensors"
    pending = tf.save({"wte": w.detach(), "lm_head": w.detach(), "other": torch.ones(2)}, path, non_blocking=non_blocking)
    if pending is not None:
        pending.result()
    back = tf.load(path)
    assert back["wte"] is back["lm_head"] and torch.equal(back["wte"], w)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["other", "wte"], "stored once"
    with pytest.raises(tf.FormatError, match="overlaps"):
        pending = tf.save({"w": w, "row": w[1]}, path, non_blocking=non_blocking)
        if pending is not None:
            pending.result()
    assert tf.load(path)["wte"] is not None, "the previous file is intact"


def test_a_sharded_checkpoint_whose_record_omits_a_stored_tensor_is_refused(tmp_path):
    """As for one file: a tensor the index maps but the recorded tree leaves out is an
    error, not a tensor silently dropped."""
    tf.save({"a": np.ones(1024, np.float32), "b": np.zeros(1024, np.float32)}, str(tmp_path) + "/",
            max_shard_size=4096)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["metadata"]["tensorferry"] = json.dumps({"format": 1, "tree": {"dict": [["a", {"tensor": "a"}]]}})
    path.write_text(json.dumps(index))
    for options in ({}, {"device": "emu:0"}, {"dtype": "float16"}):
        with pytest.raises(tf.FormatError, match=r'tensor "b" is in the index but not in the recorded tree'):
            tf.load(tmp_path, **options)


def test_a_distributed_checkpoint_folder_is_named_as_one(torch, tmp_path):
    """A folder of torch.distributed.checkpoint's pieces (.metadata and one file a rank) is
    not a checkpoint tf.load reads: it says what is, and what reads it."""
    import torch.distributed.checkpoint as dcp

    from tensorferry.dcp import TensorferryWriter

    dcp.save({"w": torch.ones(4), "epoch": 3}, storage_writer=TensorferryWriter(tmp_path / "ck"), no_dist=True)
    with pytest.raises(tf.FormatError, match=r"PyTorch distributed checkpoint \(it holds \.metadata\).*TensorferryReader"):
        tf.load(tmp_path / "ck")
