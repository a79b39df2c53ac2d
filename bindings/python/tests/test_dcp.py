"""tensorferry as the storage layer of torch.distributed.checkpoint (DCP): real saves and
loads through ``dcp.save``/``dcp.load``, in one process and across gloo ranks on loopback.

Run alone: ``python -m pytest bindings/python/tests/test_dcp.py -q``. The multi-rank tests
(2 and 4 gloo ranks) are in test_dcp_ranks.py.
"""

import os
import stat
import subprocess
import sys

import pytest
from _trees import assert_same

torch = pytest.importorskip("torch", reason="DCP needs PyTorch")
if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint", reason="this PyTorch has no distributed checkpoint")

import tensorferry as tf  # noqa: E402
from tensorferry.dcp import TensorferryReader, TensorferryWriter  # noqa: E402

CheckpointException = dcp.api.CheckpointException
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

def _plain_state():
    return {
        "model": {
            "w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)),
            "ids*[0]": torch.arange(5),  # glob characters in a name stay literal
            "t": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
            "half": torch.ones(2, 2, dtype=torch.bfloat16),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5),
        },
        "optim": {"step": 7, "lr": 0.1, "betas": (0.9, 0.99), "name": "adamw"},
    }


def _zeros_like_state(state):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _zeros_like_state(v)
        elif torch.is_tensor(v):
            out[k] = torch.zeros_like(v.contiguous())
        else:
            out[k] = type(v)() if not isinstance(v, tuple) else (0.0, 0.0)
    return out


def _failure(exc_info):
    """The exception a rank raised: DCP wraps it in a CheckpointException."""
    exc = exc_info.value
    if isinstance(exc, CheckpointException):
        (first,) = exc.failures.values()
        return first[0]
    return exc


def _save_load_one_process(tmp_path, state):
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    target = _zeros_like_state(state)
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    return target


def _rank_path(folder, rank):
    """The one file of ``rank`` in a checkpoint folder (names carry a per-save id)."""
    names = [n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".safetensors")]
    assert len(names) == 1, names
    return folder / names[0]


# ---- one process, no process group -------------------------------------------------

def test_single_process_save_load_round_trips_every_tensor_and_value(tmp_path):
    state = _plain_state()
    assert_same(_save_load_one_process(tmp_path, state), state)


def test_single_process_writes_one_safetensors_file_and_the_metadata(tmp_path):
    _save_load_one_process(tmp_path, _plain_state())
    names = sorted(os.listdir(tmp_path))
    assert names[0] == ".metadata" and len(names) == 2 and names[1].startswith("__0_")


def test_rank_file_is_read_by_the_official_safetensors_package(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = _plain_state()
    _save_load_one_process(tmp_path, state)
    path = str(_rank_path(tmp_path, 0))
    loaded = load_file(path)
    assert torch.equal(loaded["model.w"], state["model"]["w"])
    assert torch.equal(loaded["model.t"], state["model"]["t"])
    assert torch.equal(loaded["model.ids*[0]"], state["model"]["ids*[0]"])
    assert loaded["optim.step"].dtype == torch.uint8  # DCP's bytes, as uint8
    with safe_open(path, "pt") as f:
        assert f.metadata()["format"] == "pt"
        assert "DCP_SHARDING_INFO" in f.metadata()


def test_importing_the_module_does_not_import_torch():
    code = "import sys, tensorferry.dcp; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_loading_a_subset_of_the_saved_keys(tmp_path):
    state = _plain_state()
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    target = {"model": {"w": torch.zeros(4, 3)}}
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_saving_again_into_the_same_folder_replaces_the_checkpoint(tmp_path):
    _save_load_one_process(tmp_path, _plain_state())
    state = {"x": torch.arange(4.0)}
    got = _save_load_one_process(tmp_path, state)
    assert_same(got, state)


def test_a_save_that_dies_before_its_metadata_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    before = {"w": torch.arange(6.0), "step": 1}
    _save_load_one_process(tmp_path, before)

    def killed(self, metadata, results):
        raise SystemExit("killed before the metadata was written")

    monkeypatch.setattr(TensorferryWriter, "finish", killed)
    with pytest.raises(BaseException):
        dcp.save({"w": torch.arange(6.0) * 10, "step": 2}, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    monkeypatch.undo()
    target = _zeros_like_state(before)
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    assert_same(target, before)


_KILLED_SAVE = """
import sys, torch, torch.distributed.checkpoint as dcp
from tensorferry.dcp import TensorferryWriter
state = {f"w{i}": torch.full((1 << 20,), 2.0) for i in range(64)}
print("saving", flush=True)
dcp.save(state, storage_writer=TensorferryWriter(sys.argv[1]), no_dist=True)
"""


def test_a_process_killed_mid_save_leaves_a_loadable_checkpoint_of_one_save(tmp_path):
    import signal
    import time

    before = {f"w{i}": torch.full((1 << 20,), 1.0) for i in range(64)}
    dcp.save(before, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    time.sleep(0.15)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    target = {k: torch.zeros_like(v) for k, v in before.items()}
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    values = {float(v[0]) for v in target.values()} | {float(v[-1]) for v in target.values()}
    assert values in ({1.0}, {2.0}), f"a mix of two saves: {values}"


@pytest.mark.parametrize("sync_files", [True, False])
def test_a_save_replaces_the_metadata_as_tf_save_replaces_a_file_keeping_its_permissions(tmp_path, sync_files):
    dcp.save({"w": torch.arange(6.0)}, storage_writer=TensorferryWriter(tmp_path, sync_files=sync_files), no_dist=True)
    os.chmod(tmp_path / ".metadata", 0o640)
    state = {"w": torch.arange(6.0) * 2}
    assert_same(_save_load_one_process(tmp_path, state), state)
    assert stat.S_IMODE(os.stat(tmp_path / ".metadata").st_mode) == 0o640
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize("sync_files", [True, False])
def test_a_metadata_write_that_fails_leaves_no_temporary_file(tmp_path, sync_files):
    """A folder where ``.metadata`` should be: the save fails, as ``tf.save`` to a folder's
    place does, and leaves nothing of its ``.metadata`` behind."""
    (tmp_path / ".metadata").mkdir()
    (tmp_path / ".metadata" / "keep").write_text("x")
    with pytest.raises(BaseException) as e:
        dcp.save({"w": torch.arange(6.0)}, storage_writer=TensorferryWriter(tmp_path, sync_files=sync_files),
                 no_dist=True)
    assert ".metadata" in str(_failure(e))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")], os.listdir(tmp_path)


def _named_files(folder):
    """The rank files the checkpoint's metadata names."""
    return {info.file for info in TensorferryReader(folder).read_metadata().storage_data.values()}


def test_a_save_removes_the_files_of_the_checkpoint_it_replaces_and_nothing_else(tmp_path):
    from safetensors.torch import save_file

    dcp.save({"w": torch.arange(6.0)}, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    first = _named_files(tmp_path)
    # Files named like rank files that no save of this checkpoint wrote: a user's, and
    # one of another tool.
    save_file({"x": torch.ones(2)}, str(tmp_path / "__7_deadbeef.safetensors"))
    (tmp_path / "__0_0123abcd.safetensors").write_bytes(b"not ours")
    (tmp_path / "config.json").write_text("{}")
    state = {"w": torch.arange(6.0) * 2}
    assert_same(_save_load_one_process(tmp_path, state), state)
    second = _named_files(tmp_path)
    assert not first & second
    names = set(os.listdir(tmp_path))
    assert not first & names, "the replaced checkpoint's files stay"
    assert {"__7_deadbeef.safetensors", "__0_0123abcd.safetensors", "config.json"} <= names


def test_a_reused_writer_gives_every_save_files_of_new_names(tmp_path):
    # No checkpoint_id: DCP never calls reset(), yet the second save must not write over
    # the committed checkpoint's files before its own metadata commits.
    writer = TensorferryWriter(tmp_path)
    dcp.save({"w": torch.arange(6.0)}, storage_writer=writer, no_dist=True)
    first = _named_files(tmp_path)
    first_bytes = {n: (tmp_path / n).read_bytes() for n in first}
    seen = {}

    def write_data(plan, planner, _orig=writer.write_data):
        # The committed checkpoint's files are untouched while the second save writes.
        seen["before"] = {n: (tmp_path / n).read_bytes() for n in first}
        return _orig(plan, planner)

    writer.write_data = write_data
    state = {"w": torch.arange(6.0) * 3}
    dcp.save(state, storage_writer=writer, no_dist=True)
    second = _named_files(tmp_path)
    assert not first & second, (first, second)
    assert seen["before"] == first_bytes
    target = {"w": torch.zeros(6)}
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    assert torch.equal(target["w"], state["w"])


def test_a_rank_file_of_another_save_with_the_same_shapes_is_a_format_error_naming_it(tmp_path):
    import shutil

    dcp.save({"w": torch.arange(6.0), "step": 1}, storage_writer=TensorferryWriter(tmp_path / "a"), no_dist=True)
    dcp.save({"w": torch.arange(6.0) * 7, "step": 2}, storage_writer=TensorferryWriter(tmp_path / "b"), no_dist=True)
    (victim,) = _named_files(tmp_path / "a")
    (other,) = _named_files(tmp_path / "b")
    shutil.copyfile(tmp_path / "b" / other, tmp_path / "a" / victim)
    with pytest.raises((CheckpointException, tf.FormatError)) as info:
        dcp.load({"w": torch.zeros(6), "step": 0}, storage_reader=TensorferryReader(tmp_path / "a"), no_dist=True)
    err = _failure(info)
    assert isinstance(err, tf.FormatError) and victim in str(err) and "another save" in str(err), err


# ---- errors -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "damage, error",
    [
        (os.remove, FileNotFoundError),
        (lambda path: path.write_bytes(b"\xff" * 8 + b"{not json"), tf.FormatError),
        (lambda path: path.write_bytes(path.read_bytes()[:-16]), tf.FormatError),
    ],
    ids=["missing", "corrupt", "truncated"],
)
def test_a_missing_or_damaged_rank_file_is_an_error_naming_it(tmp_path, damage, error):
    state = _plain_state()
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    damage(_rank_path(tmp_path, 0))
    with pytest.raises((CheckpointException, error)) as info:
        dcp.load(_zeros_like_state(state), storage_reader=TensorferryReader(tmp_path), no_dist=True)
    err = _failure(info)
    assert isinstance(err, error)
    assert "__0_" in str(err)


def test_missing_metadata_names_the_metadata_file(tmp_path):
    state = _plain_state()
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    os.remove(tmp_path / ".metadata")
    with pytest.raises((CheckpointException, FileNotFoundError, AssertionError)) as info:
        dcp.load(_zeros_like_state(state), storage_reader=TensorferryReader(tmp_path), no_dist=True)
    assert ".metadata" in str(_failure(info))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    import pickle

    state = {"x": torch.arange(3)}
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises((CheckpointException, tf.FormatError, AssertionError)) as info:
        dcp.load({"x": torch.zeros(3, dtype=torch.int64)}, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    assert "os" in str(_failure(info)) and ".metadata" in str(_failure(info))


# ---- async staging ------------------------------------------------------------------

def test_async_save_with_the_tensorferry_stager_snapshots_the_state(tmp_path):
    from tensorferry.dcp import TensorferryStager

    state = _plain_state()
    want = {"model": {k: v.clone() for k, v in state["model"].items()}, "optim": dict(state["optim"])}
    stager = TensorferryStager()
    response = dcp.async_save(state, storage_writer=TensorferryWriter(tmp_path), async_stager=stager, no_dist=True)
    for t in state["model"].values():  # training goes on: the saved snapshot must not see this
        t.add_(1) if t.dtype != torch.bool else None
    future = getattr(response, "upload_completion", response)
    future.result(timeout=60)
    stager.close()
    target = _zeros_like_state(want)
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    assert_same(target, want)


# ---- GPU state dicts (run by the GPU kit; skipped without a CUDA GPU) -----------------

def _cuda_or_skip():
    if not torch.cuda.is_available() or "cuda:0" not in tf.devices():
        pytest.skip("no CUDA GPU for PyTorch and tensorferry")


@pytest.mark.gpu
def test_a_cuda_state_dict_saves_and_loads_into_cuda_tensors(tmp_path):
    _cuda_or_skip()
    state = {"model": {k: v.cuda() for k, v in _plain_state()["model"].items()}, "step": 3}
    want = {"model": {k: v.cpu().clone() for k, v in state["model"].items()}}
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    for k, v in target["model"].items():
        assert v.is_cuda and torch.equal(v.cpu(), want["model"][k]), k
    assert target["step"] == 3


@pytest.mark.gpu
def test_async_save_of_a_cuda_state_dict_snapshots_it_before_training_goes_on(tmp_path):
    _cuda_or_skip()
    from tensorferry.dcp import TensorferryStager

    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(1024, device="cuda")}
    want = {k: v.cpu().clone() for k, v in state.items()}
    stager = TensorferryStager()
    response = dcp.async_save(state, storage_writer=TensorferryWriter(tmp_path), async_stager=stager, no_dist=True)
    for t in state.values():
        t.add_(1)
    getattr(response, "upload_completion", response).result(timeout=60)
    stager.close()
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(target, storage_reader=TensorferryReader(tmp_path), no_dist=True)
    for k in want:
        assert torch.equal(target[k], want[k]), k


# ---- offset reads -------------------------------------------------------------------

@pytest.mark.parametrize(
    "shape, offsets, lengths",
    [((6, 4), (2, 0), (3, 4)), ((6, 4), (0, 1), (6, 2)), ((3, 4, 5), (1, 0, 2), (2, 4, 3)),
     ((3, 4, 5), (0, 1, 0), (3, 2, 5)), ((7,), (3,), (4,)), ((), (), ()), ((4, 0), (1, 0), (2, 0))],
)
def test_byte_runs_laid_end_to_end_are_the_requested_block(shape, offsets, lengths):
    from tensorferry._dcp_io import byte_runs

    full = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).reshape(shape)
    raw = full.reshape(-1).view(torch.uint8).numpy().tobytes()
    got = b"".join(raw[s:s + n] for s, n in byte_runs(shape, 4, offsets, lengths))
    block = full
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        block = block.narrow(d, o, n)
    want = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert got == want


def test_loading_one_tensor_reads_only_its_bytes_and_the_header(tmp_path):
    state = {f"w{i}": torch.full((1000,), float(i)) for i in range(8)}
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    target = {"w5": torch.zeros(1000)}
    reader = TensorferryReader(tmp_path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w5"], state["w5"])
    stats = reader.read_stats
    assert (stats.needed, stats.data, stats.files) == (4000, 4000, 1)
    assert 8 < stats.header < 4000 and stats.total == stats.data + stats.header


def test_a_load_reads_and_counts_each_rank_files_header_once(tmp_path):
    state = {f"w{i}": torch.full((1000,), float(i)) for i in range(8)}
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path), no_dist=True)
    reader = TensorferryReader(tmp_path)
    target = {"w5": torch.zeros(1000)}
    dcp.load(target, storage_reader=reader, no_dist=True)
    with open(_rank_path(tmp_path, 0), "rb") as f:
        header_bytes = 8 + int.from_bytes(f.read(8), "little")
    assert (reader.read_stats.files, reader.read_stats.header) == (1, header_bytes)
