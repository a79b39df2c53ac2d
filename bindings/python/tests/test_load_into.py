"""Loading into a model's own tensors (`out=`) and casting on load (`dtype=`), as a
training run resumes: every dtype PyTorch models hold, tied weights, and casts onto a
device, before the bytes cross where the cast narrows."""

import numpy as np
import pytest

import tensorferry as tf


def test_out_fills_a_bfloat16_model_in_place(torch, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    tf.save(model.state_dict(), tmp_path / "m.safetensors")
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    before = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
    tf.load(tmp_path / "m.safetensors", out=fresh.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
        assert v.data_ptr() == before[k], "filled in place"


@pytest.fixture
def tied(torch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    make = lambda: transformers.GPT2LMHeadModel(config).eval()  # noqa: E731
    return make


def test_out_fills_tied_weights_once_and_keeps_them_tied(tied, torch, tmp_path):
    model, fresh = tied(), tied()
    with torch.no_grad():
        fresh.transformer.wte.weight.zero_()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    tf.save({k: v.clone() for k, v in state.items()}, tmp_path / "m.safetensors")
    tf.load(tmp_path / "m.safetensors", out=fresh.state_dict())
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr(), "still tied"
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_tied_targets_with_different_values_in_the_file_are_named_and_nothing_is_written(tied, torch, tmp_path):
    model, fresh = tied(), tied()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] += 1
    tf.save(state, tmp_path / "m.safetensors")
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(tf.FormatError, match=r"lm_head\.weight, transformer\.wte\.weight: one tensor in out= \(tied\)"):
        tf.load(tmp_path / "m.safetensors", out=fresh.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was written"


@pytest.mark.parametrize("writer", ["save_pretrained", "save_model"])
def test_out_fills_a_tied_model_from_files_that_store_the_tied_tensor_once(writer, tied, torch, tmp_path):
    """transformers' save_pretrained stores lm_head.weight only as transformer.wte.weight,
    safetensors' save_model the other way round: the name the file lacks is the same tensor
    of out= as one it holds, filled through that one."""
    from safetensors.torch import save_model

    model, fresh = tied(), tied()
    if writer == "save_pretrained":
        model.save_pretrained(tmp_path)
        path = tmp_path / "model.safetensors"
    else:
        path = tmp_path / "m.safetensors"
        save_model(model, str(path))
    state = fresh.state_dict()
    tf.load(path, out=state)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr(), "still tied"
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    # An untied name the file lacks is still named.
    del state["lm_head.weight"]
    state["extra.weight"] = torch.zeros(2)
    with pytest.raises(tf.FormatError, match=r"extra\.weight: in out= but not in the file"):
        tf.load(path, out=state)


def test_out_takes_the_plain_values_of_the_file_as_torch_distributed_checkpoint_does(torch, tmp_path):
    """An epoch, a learning rate in param_groups, an optimizer's betas and a scheduler's
    milestones: a resume in place gets the file's. As DCP's load does, a list or tuple with
    no tensor in it is one value, replaced whole; keys match as names do (0 and "0")."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.8, 0.9))
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
             "milestones": [10, 20, 40], "by_step": {"0": 5}}
    tf.save(saved, tmp_path / "train/")
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)  # default betas (0.9, 0.999)
    fresh(torch.ones(1, 4)).sum().backward()
    fresh_opt.step()
    out = {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict(), "epoch": 0,
           "milestones": [30, 60], "by_step": {0: 1}, "only_here": 7}
    assert tf.load(tmp_path / "train/", out=out) is out
    assert out["epoch"] == 3 and out["only_here"] == 7
    assert out["milestones"] == [10, 20, 40] and out["by_step"] == {0: 5}
    group = out["optimizer"]["param_groups"][0]
    assert group["lr"] == 1e-5 and group["betas"] == (0.8, 0.9)
    fresh_opt.load_state_dict(out["optimizer"])
    assert fresh_opt.param_groups[0]["lr"] == 1e-5 and fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(fresh.weight, model.weight)


def test_a_plain_value_that_would_change_inside_a_tuple_of_tensors_is_named_and_nothing_written(torch, tmp_path):
    tf.save({"pair": (torch.ones(2), 2), "epoch": 3}, tmp_path / "p.safetensors")
    out = {"pair": (torch.zeros(2), 1), "epoch": 0}
    with pytest.raises(tf.FormatError, match=r"pair\.1: 2 in the file, 1 in out=, in a tuple, which cannot change"):
        tf.load(tmp_path / "p.safetensors", out=out)
    assert not out["pair"][0].any() and out["epoch"] == 0


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_overlapping_views_in_out_are_named(framework, tmp_path):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        base = torch.zeros(8)
    else:
        base = np.zeros(8)
    tf.save({"a": np.ones(5), "b": np.ones(5)}, tmp_path / "m.safetensors")
    out = {"a": base[:5], "b": base[3:]}
    with pytest.raises(tf.FormatError, match=r"a, b: overlapping views of one memory"):
        tf.load(tmp_path / "m.safetensors", out=out)
    assert (np.asarray(base) == 0).all(), "nothing is written"


@pytest.mark.parametrize("saved_from", ["numpy", "torch", "tensorferry"])
def test_a_cast_on_load_works_on_the_emulated_device_for_every_framework(saved_from, tmp_path):
    values = np.linspace(-2, 2, 64, dtype=np.float32)
    if saved_from == "torch":
        torch = pytest.importorskip("torch")
        tree = {"w": torch.from_numpy(values.copy()), "n": torch.arange(3)}
    elif saved_from == "tensorferry":
        tree = {"w": tf.Tensor.from_numpy(values.copy()), "n": tf.Tensor.from_numpy(np.arange(3))}
    else:
        tree = {"w": values, "n": np.arange(3)}
    tf.save(tree, tmp_path / "m.safetensors")
    for direct in (False, True):
        got = tf.load(tmp_path / "m.safetensors", device="emu:0", dtype="bfloat16", direct=direct)
        assert got["w"].device == "emu:0" and got["w"].dtype == "bfloat16", direct
        assert got["n"].dtype == "int64", "integers keep their dtype"
        back = tf.to_numpy(got)["w"].astype(np.float32)
        np.testing.assert_allclose(back, values, rtol=1 / 128)


@pytest.mark.parametrize("group_bytes", [1, 5000, 1 << 30])
def test_a_cast_load_onto_a_device_goes_a_group_at_a_time_and_keeps_the_structure(group_bytes, tmp_path, monkeypatch):
    """Groups of one tensor, of a few and of all give the same tree (nested dicts, lists,
    tuples, values kept), every tensor cast and on the device."""
    layers = [{"w": np.linspace(-1, 1, 500, dtype=np.float32) + i, "n": np.arange(i + 1)} for i in range(6)]
    tree = {"layers": layers, "pair": (np.ones(7, np.float64), "x"), "step": 3, "tied": layers[2]["w"]}
    tf.save(tree, tmp_path / "m.safetensors")
    monkeypatch.setenv("TENSORFERRY_CAST_GROUP_BYTES", str(group_bytes))
    got = tf.load(tmp_path / "m.safetensors", device="emu:0", dtype="float16")
    assert got["step"] == 3 and got["pair"][1] == "x" and type(got["pair"]) is tuple
    for i, layer in enumerate(got["layers"]):
        assert (layer["w"].device, layer["w"].dtype, layer["n"].dtype) == ("emu:0", "float16", "int64")
        np.testing.assert_array_equal(tf.to_numpy(layer)["w"], layers[i]["w"].astype(np.float16))
        np.testing.assert_array_equal(tf.to_numpy(layer)["n"], layers[i]["n"])
    assert tf.to_numpy(got)["pair"][0].dtype == np.float16
    assert got["tied"] is got["layers"][2]["w"], "a tensor under two names stays one tensor"


def test_a_cast_load_of_a_subset_moves_only_the_subset(tmp_path):
    # 8 MiB of float32 beside 4 KiB: as float16 the 4 KiB fit a device of 1 MiB, the rest not.
    tf.save({"big": np.ones(2 << 20, np.float32), "w": np.arange(1024, dtype=np.float32)}, tmp_path / "m.safetensors")
    tf.configure_emulated(1, capacity_bytes=1 << 20)
    try:
        got = tf.load(tmp_path / "m.safetensors", device="emu:1", dtype="float16", keys="w")
        assert list(got) == ["w"] and got["w"].dtype == "float16"
        np.testing.assert_array_equal(tf.to_numpy(got)["w"], np.arange(1024, dtype=np.float16))
    finally:
        tf.configure_emulated(1, capacity_bytes=1 << 40)


def test_a_narrowing_cast_happens_before_the_bytes_reach_the_device(tmp_path):
    # 4 MiB of float32: as bfloat16 it fits a device of 3 MiB, as float32 it does not.
    tf.save({"w": np.ones(1 << 20, np.float32)}, tmp_path / "m.safetensors")
    tf.configure_emulated(1, capacity_bytes=3 << 20)
    try:
        with pytest.raises(tf.OutOfMemoryError):
            tf.load(tmp_path / "m.safetensors", device="emu:1")
        got = tf.load(tmp_path / "m.safetensors", device="emu:1", dtype="bfloat16")
        assert got["w"].dtype == "bfloat16" and tf.to_numpy(got)["w"].astype(np.float32).min() == 1
    finally:
        tf.configure_emulated(1, capacity_bytes=1 << 40)
