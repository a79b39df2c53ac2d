"""tensorferry.dcp.consolidate in one process: dtypes, scalars, the prefix, the size
limit, and its errors (the 4-rank stitching is tested in test_dcp_ranks.py)."""

import os

import pytest

torch = pytest.importorskip("torch", reason="DCP needs PyTorch")
dcp = pytest.importorskip("torch.distributed.checkpoint", reason="this PyTorch has no distributed checkpoint")

import tensorferry as tf  # noqa: E402
from tensorferry.dcp import TensorferryWriter, consolidate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state():
    return {
        "model": {
            "w": torch.randn(64, 32, generator=torch.Generator().manual_seed(1)),
            "ids": torch.arange(100, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "half": torch.linspace(-1, 1, 16).to(torch.bfloat16),
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 4),
        },
        "optim": {"step": 5, "lr": 0.1},
    }


def _saved(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=TensorferryWriter(tmp_path / "dcp"), no_dist=True)
    return state


def test_every_dtype_and_shape_into_one_file_without_the_non_tensor_items(tmp_path):
    from safetensors.torch import load_file

    state = _saved(tmp_path)
    written = consolidate(tmp_path / "dcp", tmp_path / "hf")
    assert written == [str(tmp_path / "hf" / "model.safetensors")]
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    got = load_file(written[0])
    assert sorted(got) == sorted(f"model.{k}" for k in state["model"])  # optim.step/lr are not tensors
    for k, v in state["model"].items():
        assert got[f"model.{k}"].dtype == v.dtype and torch.equal(got[f"model.{k}"], v), k


def test_prefix_keeps_and_strips_it(tmp_path):
    from safetensors import safe_open

    state = _saved(tmp_path)
    (path,) = consolidate(tmp_path / "dcp", tmp_path / "hf", prefix="model.")
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(state["model"])
        assert f.metadata()["format"] == "pt"
        assert torch.equal(f.get_tensor("w"), state["model"]["w"])


def test_size_limit_splits_in_order_with_an_index(tmp_path):
    import json

    state = _saved(tmp_path)
    written = consolidate(tmp_path / "dcp", tmp_path / "hf", max_shard_size="1KB", prefix="model.")
    names = [os.path.basename(p) for p in written]
    # w (8 KiB) alone; then the small ones grouped under 1 KB.
    assert names[0] == f"model-00001-of-{len(names) - 1:05d}.safetensors" and names[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "hf" / names[-1]).read_text())
    assert index["weight_map"]["w"] == names[0]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state["model"].values())
    loaded = tf.load(tmp_path / "hf" / names[-1], like="torch")
    assert torch.equal(loaded["w"], state["model"]["w"]) and torch.equal(loaded["ids"], state["model"]["ids"])


def test_nothing_to_consolidate_is_a_value_error(tmp_path):
    _saved(tmp_path)
    with pytest.raises(ValueError, match="no tensor to consolidate under the prefix 'nope.'"):
        consolidate(tmp_path / "dcp", tmp_path / "hf", prefix="nope.")


def test_missing_metadata_is_a_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        consolidate(tmp_path, tmp_path / "hf")


def test_corrupt_rank_file_is_a_format_error_naming_it(tmp_path):
    _saved(tmp_path)
    (rank_file,) = [n for n in os.listdir(tmp_path / "dcp") if n.startswith("__0_")]
    path = tmp_path / "dcp" / rank_file
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(tf.FormatError, match=rank_file):
        consolidate(tmp_path / "dcp", tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def _rewrite_metadata(folder, change):
    """Rewrites a checkpoint's .metadata after ``change(metadata)`` (a damaged checkpoint,
    as a bad writer or a hand edit leaves it)."""
    import pickle

    from tensorferry.dcp import TensorferryReader

    md = TensorferryReader(folder).read_metadata()
    change(md)
    (folder / ".metadata").write_bytes(pickle.dumps(md, protocol=5))


def test_overlapping_chunks_are_a_format_error_not_uninitialised_memory(tmp_path):
    # Two chunks at the same place, whose element count equals the tensor's.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _saved(tmp_path)

    def overlap(md):
        w = md.state_dict_metadata["model.w"]
        w.size = torch.Size([128, 32])
        w.chunks = [w.chunks[0], ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([64, 32]))]

    _rewrite_metadata(tmp_path / "dcp", overlap)
    with pytest.raises(tf.FormatError, match=r"model\.w.*overlap") as info:
        consolidate(tmp_path / "dcp", tmp_path / "hf")
    assert ".metadata" in str(info.value)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_chunks_leaving_a_gap_are_a_format_error(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _saved(tmp_path)

    def gap(md):
        w = md.state_dict_metadata["model.w"]
        w.size = torch.Size([64, 40])  # columns 32..40 held by no chunk; one chunk overlaps
        w.chunks = [w.chunks[0], ChunkStorageMetadata(torch.Size([0, 24]), torch.Size([64, 16]))]

    _rewrite_metadata(tmp_path / "dcp", gap)
    with pytest.raises(tf.FormatError, match=r"model\.w"):
        consolidate(tmp_path / "dcp", tmp_path / "hf")


def test_a_tensor_the_metadata_claims_larger_than_its_file_is_refused_before_its_memory_is_taken(tmp_path):
    """The metadata says model.w is 2**40 float32 (4 TiB) in one chunk; the rank file holds
    64 x 32: named before anything is allocated (PyTorch's allocator used to fail first)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    _saved(tmp_path)

    def huge(md):
        w = md.state_dict_metadata["model.w"]
        w.size = torch.Size([1 << 40])
        w.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))]
        md.storage_data = {(MetadataIndex("model.w", torch.Size([0]), 0) if k.fqn == "model.w" else k): v
                           for k, v in md.storage_data.items()}

    _rewrite_metadata(tmp_path / "dcp", huge)
    with pytest.raises(tf.FormatError, match=r"model\.w is \[64, 32\] in the file, the metadata says \[1099511627776\]"):
        consolidate(tmp_path / "dcp", tmp_path / "hf")


def test_a_rank_file_of_another_save_is_a_format_error_naming_it(tmp_path):
    import shutil

    state = _saved(tmp_path)
    other = {"model": {k: (v + 1 if v.dtype != torch.bool else ~v) for k, v in state["model"].items()},
             "optim": state["optim"]}
    dcp.save(other, storage_writer=TensorferryWriter(tmp_path / "other"), no_dist=True)
    (victim,) = [n for n in os.listdir(tmp_path / "dcp") if n.startswith("__0_")]
    (theirs,) = [n for n in os.listdir(tmp_path / "other") if n.startswith("__0_")]
    shutil.copyfile(tmp_path / "other" / theirs, tmp_path / "dcp" / victim)
    with pytest.raises(tf.FormatError, match=f"{victim}.*another save"):
        consolidate(tmp_path / "dcp", tmp_path / "hf")


@pytest.mark.parametrize("first, second", [("1KB", None), (None, "1KB"), ("1KB", 500)])
def test_consolidating_again_replaces_the_earlier_output_and_touches_nothing_else(tmp_path, first, second):
    from safetensors.torch import save_file

    state = _saved(tmp_path)
    out = tmp_path / "hf"
    consolidate(tmp_path / "dcp", out, max_shard_size=first, prefix="model.")
    mine = {"config.json": b"{}", "model-00001-of-00002.safetensors.bak": b"backup", "notes.txt": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    save_file({"x": torch.ones(1)}, str(out / "other-00001-of-00001.safetensors"))
    # The second consolidation writes other values: a stale file would show.
    changed = {"model": {k: (v * 2 if v.dtype != torch.bool else v) for k, v in state["model"].items()}, "optim": {}}
    dcp.save(changed, storage_writer=TensorferryWriter(tmp_path / "dcp"), no_dist=True)
    written = consolidate(tmp_path / "dcp", out, max_shard_size=second, prefix="model.")
    produced = {os.path.basename(p) for p in written}
    assert set(os.listdir(out)) == produced | set(mine) | {"other-00001-of-00001.safetensors"}
    for name, data in mine.items():
        assert (out / name).read_bytes() == data
    entry = "model.safetensors.index.json" if "model.safetensors.index.json" in produced else "model.safetensors"
    loaded = tf.load(out / entry, like="torch")
    assert sorted(loaded) == sorted(changed["model"])
    for k, v in changed["model"].items():
        assert torch.equal(loaded[k], v), k


def test_consolidating_again_keeps_the_permissions_of_the_index_it_replaces(tmp_path):
    import stat

    _saved(tmp_path)
    out = tmp_path / "hf"
    consolidate(tmp_path / "dcp", out, max_shard_size="1KB", prefix="model.")
    os.chmod(out / "model.safetensors.index.json", 0o640)
    consolidate(tmp_path / "dcp", out, max_shard_size="1KB", prefix="model.")
    assert stat.S_IMODE(os.stat(out / "model.safetensors.index.json").st_mode) == 0o640
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
