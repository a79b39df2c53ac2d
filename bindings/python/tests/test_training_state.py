"""Everyday training state round-trips: an optimizer's, a scheduler's and a GradScaler's
state dicts move, save and load back exactly (ints stay ints, tuples tuples, integer keys
integers) and into ``load_state_dict``; tied tensors are stored once and shared again on
load; every dtype of the safetensors format loads and saves back byte for byte."""

import copy
import json
import os
import struct
from collections import Counter

import numpy as np
import pytest
from _trees import assert_same

import tensorferry as tf

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
from torch.optim import lr_scheduler as L  # noqa: E402

pytestmark = pytest.mark.torch


# -- helpers -----------------------------------------------------------------------------


def as_torch(tree):
    """A tree whose tensorferry tensors (moved to the emulated device and back) are
    PyTorch tensors, as ``load_state_dict`` needs."""
    host = tf.to_host(tree)

    def walk(x):
        if isinstance(x, tf.Tensor):
            return torch.from_numpy(tf.to_numpy({"t": x})["t"].copy())
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(host)


def trained(opt_kind="adamw", steps=2):
    """A small model, its optimizer after ``steps`` steps, a StepLR and a GradScaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    if opt_kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = L.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        step(model, opt, sched)
    return model, opt, sched, scaler


def step(model, opt, sched=None):
    torch.manual_seed(1)
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    if sched is not None:
        sched.step()


def resume(state, opt_kind):
    """Fresh objects loaded from (a copy of) ``state``, then one more step: the parameters,
    the learning rate and the scale. (``load_state_dict`` keeps some of the tensors it is
    given, which the step then changes: the copy leaves ``state`` as it was.)"""
    state = copy.deepcopy(state)
    model, opt, sched, scaler = trained(opt_kind, steps=0)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    step(model, opt, sched)
    return [p.detach().clone() for p in model.parameters()], sched.get_last_lr(), scaler.get_scale()


def training_state(opt_kind):
    model, opt, sched, scaler = trained(opt_kind)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": 3,
    }


# -- 1. optimizer, scheduler and scaler state -------------------------------------------


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("move", ["to_host", "to_device_cpu"])
def test_a_training_state_moved_on_the_host_is_exact_and_resumes_identically(opt_kind, move):
    state = training_state(opt_kind)
    moved = tf.to_host(state, copy=True) if move == "to_host" else tf.to_device(state, "cpu", copy=True)
    assert_same(moved, state)
    groups = moved["optimizer"]["param_groups"]
    assert all(type(g["params"]) is list and type(g["params"][0]) is int for g in groups)
    if opt_kind == "adamw":
        assert groups[0]["betas"] == (0.8, 0.95)
    assert sorted(moved["optimizer"]["state"]) == [0, 1, 2, 3]
    assert type(moved["scheduler"]["base_lrs"]) is list
    want, got = resume(state, opt_kind), resume(moved, opt_kind)
    assert all(a.equal(b) for a, b in zip(want[0], got[0])) and want[1:] == got[1:]


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_a_training_state_on_the_emulated_device_keeps_every_plain_value(opt_kind):
    state = training_state(opt_kind)
    there = tf.to_device(state, "emu:0")
    exp_avg = there["optimizer"]["state"][0]["exp_avg" if opt_kind == "adamw" else "momentum_buffer"]
    assert type(exp_avg) is tf.Tensor and exp_avg.device == "emu:0"
    assert_same(there, state, any_framework=True)  # ints, tuples, integer keys, lists of numbers as they were
    back = as_torch(there)
    assert_same(back, state, any_dict=True)  # as_torch makes the OrderedDict a dict
    want, got = resume(state, opt_kind), resume(back, opt_kind)
    assert all(a.equal(b) for a, b in zip(want[0], got[0])) and want[1:] == got[1:]


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("device", ["cpu", "emu:0"])
def test_a_training_state_saves_and_loads_back_exactly_and_resumes_identically(tmp_path, opt_kind, device):
    state = training_state(opt_kind)
    path = tmp_path / "ckpt.safetensors"
    tf.save(state if device == "cpu" else tf.to_device(state, device), path)
    back = tf.load(path) if device == "cpu" else tf.load(path, like="torch")
    assert_same(back, state, any_dict=True)  # a file holds the OrderedDict as a dict
    assert type(back["epoch"]) is int and type(back["scaler"]["scale"]) is float
    assert type(back["scaler"]["growth_interval"]) is int
    assert list(back["optimizer"]["state"]) == [0, 1, 2, 3]
    want, got = resume(state, opt_kind), resume(back, opt_kind)
    assert all(a.equal(b) for a, b in zip(want[0], got[0])) and want[1:] == got[1:]
    # On the device, the same structure.
    assert_same(tf.load(path, device="emu:0"), state, any_framework=True, any_dict=True)


def test_other_tools_read_an_optimizer_state_as_dotted_names(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "opt.safetensors"
    opt_state = training_state("adamw")["optimizer"]
    tf.save(opt_state, path)
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        record = json.loads(f.metadata()["tensorferry"])
    assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.3.step"} <= names
    assert record["format"] == 2
    state_entry = dict((k if isinstance(k, str) else f"int:{k}", v) for k, v in record["tree"]["dict"])
    assert [k for k, _ in state_entry["state"]["dict"]] == [0, 1, 2, 3]


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, 2, gamma=0.5),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=20),
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.9**e),
    "MultiStepLR": lambda o: L.MultiStepLR(o, [2, 4]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.ConstantLR(o), L.ExponentialLR(o, 0.9)], milestones=[2]),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o), L.ExponentialLR(o, 0.9)]),
    "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.1),
}


def _schedule(name, steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = SCHEDULERS[name](opt)
    for _ in range(steps):
        _step(opt, sched, name)
    return opt, sched


def _step(opt, sched, name):
    opt.step()
    sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_state_moves_and_saves_exactly_and_loads_into_the_scheduler(tmp_path, name):
    opt, sched = _schedule(name, 3)
    sd = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    path = tmp_path / "s.safetensors"
    tf.save(sd, path)
    for moved in (tf.to_device(sd, "cpu"), tf.to_device(sd, "emu:0"), tf.to_host(sd), tf.load(path)):
        if name == "MultiStepLR":
            # A Counter is kept by the moves; a file holds it as the dict it is.
            milestones = moved["scheduler"]["milestones"]
            assert type(milestones) in (Counter, dict) and dict(milestones) == {2: 1, 4: 1}
            moved["scheduler"] = {**moved["scheduler"], "milestones": Counter(milestones)}
        assert_same(moved, sd)
        fresh_opt, fresh = _schedule(name, 0)
        fresh_opt.load_state_dict(moved["optimizer"])
        fresh.load_state_dict(moved["scheduler"])
        _, original = _schedule(name, 3)
        for s in (fresh, original):
            _step(s.optimizer, s, name)
        assert fresh.get_last_lr() == original.get_last_lr()


def test_a_grad_scaler_state_saves_exactly(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    sd = scaler.state_dict()
    tf.save({"scaler": sd}, tmp_path / "g.safetensors")
    back = tf.load(tmp_path / "g.safetensors")["scaler"]
    assert_same(back, sd)
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(back)
    assert fresh.get_scale() == 1024.0 and fresh.get_growth_interval() == 7


def test_lists_of_numbers_outside_torch_state_are_still_data():
    out = tf.to_device({"x": [1.0, 2.0], "ids": [1, 2], "cfg": {"base_lrs": [0.1]}}, "emu:0")
    assert out["x"].dtype == "float32" and out["ids"].dtype == "int64" and out["x"].device == "emu:0"
    assert type(out["cfg"]["base_lrs"]) is tf.Tensor  # "base_lrs" alone is not a scheduler


def test_a_tuple_is_a_record_and_stays_as_it_is():
    src = {"betas": (0.9, 0.999), "shape": (3, 4), "pairs": [(1, 2), (3, 4)]}
    out = tf.to_device(src, "emu:0")
    assert out == src and type(out["betas"]) is tuple and type(out["pairs"][0]) is tuple


def test_an_integer_key_and_its_text_as_a_key_are_refused_naming_them(tmp_path):
    with pytest.raises(tf.FormatError, match=r"keys 0 and '0' are one name"):
        tf.save({"state": {0: np.ones(1), "0": np.ones(1)}}, tmp_path / "x.safetensors")
    with pytest.raises(tf.FormatError, match="strings or integers"):
        tf.save({"s": {True: 1}}, tmp_path / "x.safetensors")


def test_integer_keys_of_plain_values_and_nested_dicts_come_back_as_integers(tmp_path):
    src = {"counts": {3: 7, -1: "x", 10**12: [1.5, None]}, "t": np.arange(2)}
    tf.save(src, tmp_path / "i.safetensors")
    assert_same(tf.load(tmp_path / "i.safetensors"), src)
    flat = {-3: np.arange(2), "w": np.ones(1)}  # tensors only: a file without a record would lose -3
    tf.save(flat, tmp_path / "f.safetensors")
    assert_same(tf.load(tmp_path / "f.safetensors"), flat)


def test_a_file_with_a_record_of_format_1_still_loads(tmp_path):
    from safetensors.numpy import save_file

    record = {"format": 1, "tree": {"dict": [["a", {"tuple": [{"int": 1}, {"tensor": "b"}]}]]}}
    save_file({"b": np.ones(2, np.float32)}, tmp_path / "v1.safetensors", metadata={"tensorferry": json.dumps(record)})
    out = tf.load(tmp_path / "v1.safetensors")
    assert out["a"][0] == 1 and type(out["a"]) is tuple and out["a"][1].tolist() == [1.0, 1.0]


# -- 2. tied tensors -------------------------------------------------------------------


def _gpt2(transformers):
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), config


def test_a_gpt2_with_tied_embeddings_saves_once_and_loads_tied(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    model, config = _gpt2(transformers)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    path = tmp_path / "model.safetensors"
    tf.save(sd, path)
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    loaded = tf.load(path)
    assert loaded["lm_head.weight"] is loaded["transformer.wte.weight"]
    assert list(loaded) == list(sd)
    fresh, _ = _gpt2(transformers)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(loaded)
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    # transformers reads the file as its own (the tied name is left out, as it writes it).
    config.save_pretrained(tmp_path)
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("like", ["numpy", "torch", "tensorferry"])
def test_one_tensor_under_two_keys_is_one_object_after_load(tmp_path, like):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    tf.save({"a": w, "b": {"c": w}, "l": [w]}, tmp_path / "t.safetensors")
    out = tf.load(tmp_path / "t.safetensors", like=like)
    assert out["a"] is out["b"]["c"] is out["l"][0]
    assert_same(out["a"], w, any_framework=True)


def test_tied_tensors_loaded_on_a_device_are_one_object(tmp_path):
    w = torch.arange(4.0)
    tf.save({"a": w, "b": w}, tmp_path / "t.safetensors")
    out = tf.load(tmp_path / "t.safetensors", device="emu:0")
    assert out["a"] is out["b"] and out["a"].device == "emu:0"


def test_overlapping_views_are_refused_naming_both_keys_and_the_way_out(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    for other in (w.t(), w[1], w[:, :2]):
        with pytest.raises(tf.FormatError) as e:
            tf.save({"w": w, "v": other}, tmp_path / "o.safetensors")
        assert "'v'" in str(e.value) or '"v"' in str(e.value)
        assert '"w"' in str(e.value) and ".clone()" in str(e.value)
    assert not (tmp_path / "o.safetensors").exists()
    tf.save({"w": w, "v": w[1].clone()}, tmp_path / "o.safetensors")


# -- 3. every dtype of the safetensors format ------------------------------------------

_TORCH_DTYPES = ["float8_e8m0fnu", "float4_e2m1fn_x2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3fn"]


def _header(data):
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _entries(data):
    """name -> (dtype code, shape, bytes) of a safetensors file's bytes, as the official
    package reads them."""
    from safetensors import deserialize

    return {name: (v["dtype"], v["shape"], bytes(v["data"])) for name, v in deserialize(data)}


@pytest.mark.parametrize("name", _TORCH_DTYPES)
def test_a_torch_file_of_every_8_and_4_bit_float_loads_and_saves_back_byte_for_byte(tmp_path, name):
    from safetensors.torch import load_file, save_file

    dtype = getattr(torch, name)
    raw = torch.arange(24, dtype=torch.uint8).reshape(2, 12)
    t = raw.view(dtype)
    save_file({"w": t, "b": torch.ones(2)}, tmp_path / "official.safetensors", metadata={"format": "pt"})
    original = (tmp_path / "official.safetensors").read_bytes()
    out = tf.load(tmp_path / "official.safetensors")
    assert out["w"].dtype == dtype and out["w"].shape == t.shape
    assert torch.equal(out["w"].view(torch.uint8), raw)
    tf.save(out, tmp_path / "again.safetensors")
    again = (tmp_path / "again.safetensors").read_bytes()
    assert _entries(again) == _entries(original)
    assert torch.equal(load_file(tmp_path / "again.safetensors")["w"].view(torch.uint8), raw)
    # Without "format": "pt", NumPy through ml_dtypes where it holds the dtype, else a
    # tensorferry.Tensor (ml_dtypes keeps one 4-bit value a byte, not two).
    save_file({"w": t}, tmp_path / "plain.safetensors")
    plain = tf.load(tmp_path / "plain.safetensors")["w"]
    expected = tf.Tensor if name == "float4_e2m1fn_x2" else np.ndarray
    assert type(plain) is expected and str(plain.dtype) == name


@pytest.mark.parametrize("code,values_per_element,elem_bytes", [("F6_E2M3", 4, 3), ("F6_E3M2", 4, 3), ("F4", 2, 1)])
def test_packed_floats_without_a_numpy_dtype_load_as_tensorferry_tensors_and_save_back(tmp_path, code, values_per_element, elem_bytes):
    from safetensors import deserialize

    shape = [2, 8]
    nbytes = 16 * elem_bytes // values_per_element
    data = bytes((i * 29 + 3) % 256 for i in range(nbytes))
    header = json.dumps({"x": {"dtype": code, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    original = struct.pack("<Q", len(header)) + header + data
    assert deserialize(original)[0][1]["dtype"] == code  # the official package reads it
    path = tmp_path / "packed.safetensors"
    path.write_bytes(original)
    out = tf.load(path)
    assert type(out["x"]) is tf.Tensor and out["x"].shape == (2, 8 // values_per_element)
    tf.save(out, tmp_path / "again.safetensors")
    assert _entries((tmp_path / "again.safetensors").read_bytes()) == _entries(original)
    with pytest.raises(tf.TensorferryError, match="x"):
        tf.to_numpy(out)


def test_an_e8m0_file_without_a_framework_loads_as_ml_dtypes(tmp_path, ml_dtypes):
    arr = np.arange(4, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    tf.save({"s": arr}, tmp_path / "e.safetensors")
    assert _header((tmp_path / "e.safetensors").read_bytes())[0]["s"]["dtype"] == "F8_E8M0"
    out = tf.load(tmp_path / "e.safetensors")["s"]
    assert out.dtype == ml_dtypes.float8_e8m0fnu and np.array_equal(out.view(np.uint8), arr.view(np.uint8))
