"""DCP with tensorferry's storage layer on 4 real gloo ranks (loopback), FSDP2 on CPU:
model + Adam state saved on 4 ranks, loaded on 4, 2 and 1 (resharding) and compared
exactly with the full tensors rank 0 gathered without DCP; DTensors by rows, columns and
replicated saved and loaded on 2 ranks; bytes read per rank against
bytes needed; a write failing on one rank, ``overwrite=False``, a rank killed mid-save.

Two process groups in all (4 ranks, then 2), each running several scenarios (see
``_dcp_ranks.py``); every rank bounded by a timeout.
"""

import os
import shutil

import pytest

torch = pytest.importorskip("torch", reason="DCP needs PyTorch")
if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint", reason="this PyTorch has no distributed checkpoint")
pytest.importorskip("torch.distributed.fsdp", reason="this PyTorch has no FSDP2")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("this PyTorch has no fully_shard (FSDP2)", allow_module_level=True)

import _dcp_ranks  # noqa: E402
from _trees import assert_same  # noqa: E402

import tensorferry as tf  # noqa: E402
from tensorferry.dcp import TensorferryReader  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """The 4-rank group's folder and per-rank results (its last step kills rank 3)."""
    folder = tmp_path_factory.mktemp("dcp_4ranks")
    results = _dcp_ranks.run_ranks("four", 4, folder, expect_killed=_dcp_ranks.KILLED_RANK)
    return folder, results


@pytest.fixture(scope="module")
def two(four):
    folder, _ = four
    return _dcp_ranks.run_ranks("two", 2, folder)


def _truth(folder):
    return torch.load(folder / "truth.pt", weights_only=False)


def _plain_target(truth):
    """Full-size zeroed tensors for every tensor of the truth (the non-tensor leaves
    left out: a subset load)."""
    if isinstance(truth, dict):
        out = {k: _plain_target(v) for k, v in truth.items() if k != "param_groups"}
        return {k: v for k, v in out.items() if v is not None}
    return torch.zeros_like(truth) if torch.is_tensor(truth) else None


def _within_5_percent(stats):
    assert stats["data"] == stats["needed"], stats  # byte runs: exactly the chunks asked
    assert stats["data"] + stats["header"] <= 1.05 * stats["needed"], stats


def test_saved_on_4_loads_on_4_exactly(four):
    _, results = four
    assert sorted(results) == [0, 1, 2, 3]
    for rank, r in results.items():
        assert r["load4"]["needed"] > 0, (rank, r)


def test_async_save_on_4_with_the_stager_saves_the_snapshot(four):
    # Each rank changed its tensors right after async_save returned, then loaded the
    # async checkpoint and compared it with the truth (before the change).
    for rank, r in four[1].items():
        assert r["load4_async"]["needed"] > 0 and r["async_blocked_s"] < 30, (rank, r)


def test_one_file_per_rank_and_each_readable_by_safetensors(four):
    from safetensors.torch import load_file

    folder, _ = four
    # The checkpoint is the first save's: metadata and 4 rank files it names.
    reader = TensorferryReader(folder / "ckpt")
    md = reader.read_metadata()
    named = sorted({info.file for info in md.storage_data.values()})
    assert [n[:4] for n in named] == ["__0_", "__1_", "__2_", "__3_"]
    cols = [load_file(str(folder / "ckpt" / n))["extra.cols"] for n in named]
    assert torch.equal(torch.cat(cols, dim=1), _dcp_ranks.full_cols())


def _rank_path(folder, rank):
    names = [n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".safetensors")]
    assert len(names) == 1, names
    return folder / names[0]


def test_two_ranks_save_then_load_every_shard_exactly(four, two):
    # The ranks compared their tensors themselves; here: one file per rank.
    folder = four[0] / "two_ckpt"
    names = sorted(os.listdir(folder))
    assert names[0] == ".metadata" and [n[:4] for n in names[1:]] == ["__0_", "__1_"]


def test_two_rank_files_hold_their_shards_for_safetensors(four, two):
    from safetensors.torch import load_file

    folder = four[0] / "two_ckpt"
    r0 = load_file(str(_rank_path(folder, 0)))
    r1 = load_file(str(_rank_path(folder, 1)))
    assert torch.equal(torch.cat([r0["model.w"], r1["model.w"]]), _dcp_ranks.full_weight())
    assert torch.equal(torch.cat([r0["model.odd"], r1["model.odd"]], dim=1), _dcp_ranks.full_odd())
    assert torch.equal(r1["rank1.local"], _dcp_ranks.local_only(1))


def test_saved_on_two_ranks_loads_resharded_in_one_process(four, two):
    target = {
        "model": {"w": torch.zeros(6, 4), "odd": torch.zeros(3, 5, dtype=torch.int64), "half": torch.zeros(8, dtype=torch.bfloat16)},
        "optim": {"step": 0, "lr": 0.0, "exp_avg": torch.zeros(6, 4)},
        "rank0": {"local": torch.zeros(3, dtype=torch.float64)},
        "rank1": {"local": torch.zeros(3, dtype=torch.float64)},
    }
    dcp.load(target, storage_reader=TensorferryReader(four[0] / "two_ckpt"), no_dist=True)
    assert_same(target, {
        "model": {"w": _dcp_ranks.full_weight(), "odd": _dcp_ranks.full_odd(), "half": _dcp_ranks.full_bf16()},
        "optim": {"step": 100, "lr": 3e-4, "exp_avg": _dcp_ranks.full_weight() * 2},
        "rank0": {"local": _dcp_ranks.local_only(0)},
        "rank1": {"local": _dcp_ranks.local_only(1)},
    })


def test_saved_on_4_loads_on_2_exactly_reading_only_the_needed_bytes(two):
    for rank, r in two.items():
        _within_5_percent(r["load2"])


def test_saved_on_4_loads_on_4_reading_only_the_needed_bytes(four):
    for rank, r in four[1].items():
        _within_5_percent(r["load4"])


def test_saved_on_4_loads_in_one_process_exactly(four):
    folder, _ = four
    truth = _truth(folder)
    target = _plain_target(truth)
    reader = TensorferryReader(folder / "ckpt")
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, _plain_target_like(truth))
    stats = reader.read_stats
    assert stats.data == stats.needed and stats.files == 4


def _plain_target_like(truth):
    if isinstance(truth, dict):
        out = {k: _plain_target_like(v) for k, v in truth.items() if k != "param_groups"}
        return {k: v for k, v in out.items() if v is not None}
    return truth if torch.is_tensor(truth) else None


def test_overwrite_false_refuses_an_existing_checkpoint_on_every_rank(four):
    for rank, r in four[1].items():
        assert r["overwrite_false"] == {str(i): "TensorferryFileExistsError" for i in range(4)}, (rank, r)


def test_a_write_failing_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_checkpoint(four):
    for rank, r in four[1].items():
        assert r["failed_write"] == {str(_dcp_ranks.FAILING_RANK): "OSError"}, (rank, r)
        assert r["load4_after_failed_write"]["needed"] > 0


def test_a_rank_killed_mid_save_by_a_reused_writer_fails_the_others_and_leaves_the_previous_checkpoint(four, two):
    # The killed save used the first save's writer again (no checkpoint_id: DCP never
    # resets it). (`two` loaded after the kill too.) The survivors raised; the folder
    # still loads as the first save, exactly.
    folder, results = four
    for rank in (0, 1, 2):
        assert results[rank]["killed"] != "saved", results[rank]
    assert "killed" not in results[_dcp_ranks.KILLED_RANK]
    truth = _truth(folder)
    target = _plain_target(truth)
    dcp.load(target, storage_reader=TensorferryReader(folder / "ckpt"), no_dist=True)
    assert_same(target, _plain_target_like(truth))


# ---- a damaged 4-rank checkpoint, loaded in one process ------------------------------

def _copy(four, tmp_path):
    folder, _ = four
    dst = tmp_path / "ckpt"
    shutil.copytree(folder / "ckpt", dst)
    return dst, _plain_target(_truth(folder))


def _rank_file(folder, rank):
    md = TensorferryReader(folder).read_metadata()
    (name,) = {i.file for i in md.storage_data.values() if i.file.startswith(f"__{rank}_")}
    return folder / name


def _cause(info):
    exc = info.value
    if isinstance(exc, dcp.api.CheckpointException):
        (first,) = exc.failures.values()
        return first[0] if isinstance(first, tuple) else first
    return exc


def test_partial_folder_missing_one_rank_file_names_it(four, tmp_path):
    ckpt, target = _copy(four, tmp_path)
    missing = _rank_file(ckpt, 3)
    os.remove(missing)
    with pytest.raises((dcp.api.CheckpointException, FileNotFoundError)) as info:
        dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True)
    err = _cause(info)
    assert isinstance(err, FileNotFoundError) and missing.name in str(err)


def test_folder_without_metadata_is_a_clear_error(four, tmp_path):
    ckpt, target = _copy(four, tmp_path)
    os.remove(ckpt / ".metadata")
    with pytest.raises(dcp.api.CheckpointException) as info:  # a BaseException, not an Exception
        dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True)
    assert isinstance(_cause(info), AssertionError) and str(ckpt / ".metadata") in str(_cause(info))


def test_corrupt_rank_file_of_four_is_a_format_error_naming_it(four, tmp_path):
    ckpt, target = _copy(four, tmp_path)
    bad = _rank_file(ckpt, 2)
    data = bytearray(bad.read_bytes())
    data[8:40] = b"#" * 32  # the header's JSON broken
    bad.write_bytes(bytes(data))
    with pytest.raises((dcp.api.CheckpointException, tf.FormatError)) as info:
        dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True)
    err = _cause(info)
    assert isinstance(err, tf.FormatError) and bad.name in str(err)


def test_rank_file_of_another_world_size_is_a_format_error_naming_it(four, tmp_path):
    # Rank 0's file of this checkpoint replaced by rank 0's file of a 1-rank save of the
    # same names: its shapes are not the ones the metadata planned for.
    ckpt, target = _copy(four, tmp_path)
    truth = _truth(four[0])
    other = tmp_path / "one_rank"
    from tensorferry.dcp import TensorferryWriter

    dcp.save(_plain_target_like(truth), storage_writer=TensorferryWriter(other), no_dist=True)
    victim = _rank_file(ckpt, 0)
    shutil.copyfile(_rank_file(other, 0), victim)
    with pytest.raises((dcp.api.CheckpointException, tf.FormatError)) as info:
        dcp.load(target, storage_reader=TensorferryReader(ckpt), no_dist=True)
    err = _cause(info)
    assert isinstance(err, tf.FormatError) and victim.name in str(err)


def test_state_dict_of_another_shape_is_a_clear_error(four):
    folder, _ = four
    target = {"model": {"0.weight": torch.zeros(5, 5)}}
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.load(target, storage_reader=TensorferryReader(folder / "ckpt"), no_dist=True)
    err = _cause(info)
    assert isinstance(err, ValueError) and "model.0.weight" in str(err) and "Size mismatch" in str(err)


# ---- consolidation of the 4-rank checkpoint ------------------------------------------

def test_consolidate_stitches_the_four_rank_shards_into_one_hf_file(four, tmp_path):
    from safetensors.torch import load_file

    from tensorferry.dcp import consolidate

    folder, _ = four
    truth = _truth(folder)
    written = consolidate(folder / "ckpt", tmp_path / "hf", prefix="model.")
    assert [os.path.basename(p) for p in written] == ["model.safetensors"]
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert_same(got, truth["model"])  # FSDP2 row shards of 4 ranks, whole again


def test_consolidate_into_shards_with_an_index_read_by_safetensors_and_tensorferry(four, tmp_path):
    import json

    from safetensors.torch import load_file

    from tensorferry.dcp import consolidate

    folder, _ = four
    truth = _truth(folder)
    out = tmp_path / "hf"
    written = consolidate(folder / "ckpt", out, max_shard_size=300_000)
    names = [os.path.basename(p) for p in written]
    assert names[-1] == "model.safetensors.index.json" and len(names) >= 4
    assert all(n == f"model-{i + 1:05d}-of-{len(names) - 1:05d}.safetensors" for i, n in enumerate(names[:-1]))
    index = json.loads((out / names[-1]).read_text())
    merged = {}
    for n in names[:-1]:
        part = load_file(str(out / n))
        assert all(index["weight_map"][k] == n for k in part)
        merged.update(part)
    want = {f"model.{k}": v for k, v in truth["model"].items()}
    want["extra.cols"] = _dcp_ranks.full_cols()  # column shards (DTensor Shard(1)) stitched
    for fqn, groups in truth["optim"]["state"].items():
        for k, v in groups.items():
            want[f"optim.state.{fqn}.{k}"] = v
    assert_same(merged, want, any_key_order=True)  # each shard lists its names in its own order
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())
    loaded = tf.load(out / names[-1], like="torch")
    flat = {}

    def walk(d, path):
        for k, v in d.items():
            walk(v, f"{path}{k}.") if isinstance(v, dict) else flat.__setitem__(f"{path}{k}", v)

    walk(loaded, "")
    assert_same(flat, want, any_key_order=True)  # the index lists the names sorted
