"""to_host: the structure comes back, tensors on the host, everything else the same object."""

from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest

import tensorferry as tf

Pair = namedtuple("Pair", ["first", "second"])


def test_non_tensor_leaves_are_the_very_same_objects(state):
    out = tf.to_host(state)
    assert out["tag"] is state["tag"]
    assert out["optimizer"]["lr"] is state["optimizer"]["lr"]
    assert out["none"] is None
    assert out is not state and out["model"] is not state["model"]


def test_host_tensors_are_returned_without_copy_by_default(state):
    out = tf.to_host(state)
    assert out["ids"] is state["ids"]


def test_copy_true_shares_no_memory_and_keeps_values(state):
    out = tf.to_host(state, copy=True)
    for key in ("layer.0.weight", "layer.0.bias"):
        a, b = state["model"][key], out["model"][key]
        assert isinstance(b, np.ndarray)
        assert not np.shares_memory(a, b)
        np.testing.assert_array_equal(a, b)
        assert b.dtype == a.dtype and b.shape == a.shape


def test_the_source_is_never_modified(state):
    before = state["model"]["layer.0.weight"].copy()
    out = tf.to_host(state, copy=True)
    out["model"]["layer.0.weight"][...] = -1
    np.testing.assert_array_equal(state["model"]["layer.0.weight"], before)


def test_container_types_are_kept():
    src = {
        "od": OrderedDict([("b", np.ones(1)), ("a", 2)]),
        "dd": defaultdict(list, {"x": np.ones(1)}),
        "nt": Pair(np.ones(1), "s"),
        "t": (np.ones(1), 1),
        "l": [np.ones(1)],
    }
    out = tf.to_host(src, copy=True)
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]
    assert type(out["dd"]) is defaultdict and out["dd"].default_factory is list
    assert type(out["nt"]) is Pair and out["nt"].second == "s"
    assert type(out["t"]) is tuple and type(out["l"]) is list


def _reordered_state():
    """An OrderedDict whose order (after ``move_to_end``) differs from its insertion order,
    carrying an instance attribute, as PyTorch's ``state_dict()`` carries ``_metadata``."""
    od = OrderedDict((f"w{i}", np.full(3, i, np.float32)) for i in range(4))
    od.move_to_end("w0")
    od["nested"] = OrderedDict(b=np.ones(2), a="x")
    od._metadata = OrderedDict([("", {"version": 1})])
    return od


@pytest.mark.parametrize("call", ["to_host", "to_numpy", "to_device"])
def test_an_ordered_dict_keeps_its_order_and_its_attributes(call):
    src = _reordered_state()
    move = {
        "to_host": lambda x: tf.to_host(x, copy=True),
        "to_numpy": tf.to_numpy,
        "to_device": lambda x: tf.to_device(x, "cpu", copy=True),
    }[call]
    out = move(src)
    assert type(out) is OrderedDict and list(out) == ["w1", "w2", "w3", "w0", "nested"]
    assert type(out["nested"]) is OrderedDict and list(out["nested"]) == ["b", "a"]
    assert out._metadata is src._metadata  # kept as every plain leaf is: the same object
    for key in ("w1", "w0"):
        np.testing.assert_array_equal(out[key], src[key])
    assert not np.shares_memory(out["w1"], src["w1"]) or call == "to_numpy"


def test_an_ordered_dict_inside_a_container_the_python_rules_walk_keeps_its_attributes():
    # A namedtuple is walked by the Python rules, and so is the OrderedDict inside it.
    src = Pair(_reordered_state(), "s")
    out = tf.to_host(src, copy=True)
    assert type(out) is Pair and type(out.first) is OrderedDict
    assert list(out.first) == list(src.first) and out.first._metadata is src.first._metadata
    np.testing.assert_array_equal(out.first["w0"], src.first["w0"])


def test_an_ordered_dict_is_saved_in_its_order(tmp_path):
    src = _reordered_state()
    tf.save(src, tmp_path / "od.safetensors")
    back = tf.load(tmp_path / "od.safetensors")
    assert list(back) == ["w1", "w2", "w3", "w0", "nested"]
    np.testing.assert_array_equal(back["w0"], src["w0"])


def test_a_modules_state_dict_copied_to_the_host_loads_back_into_the_module(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4))  # running statistics move away from their defaults
    sd = model.state_dict()
    out = tf.to_host(sd, copy=True)
    assert type(out) is OrderedDict and list(out) == list(sd)
    assert out._metadata == sd._metadata
    for k in sd:
        assert torch.equal(out[k], sd[k]) and out[k].data_ptr() != sd[k].data_ptr()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(out)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values()))


def test_strided_arrays_are_copied_in_order():
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    view = base[::2, ::-3]
    out = tf.to_host({"v": view}, copy=True)["v"]
    np.testing.assert_array_equal(out, view)


def test_torch_in_torch_out(torch):
    src = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "p": torch.nn.Parameter(torch.ones(2))}
    out = tf.to_host(src, copy=True)
    assert isinstance(out["w"], torch.Tensor) and out["w"].device.type == "cpu"
    assert torch.equal(out["w"], src["w"])
    assert out["w"].data_ptr() != src["w"].data_ptr()
    assert torch.equal(out["p"], torch.ones(2))


def test_torch_bfloat16_survives(torch):
    src = {"b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}
    out = tf.to_host(src, copy=True)
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], src["b"])


def test_jax_in_jax_out(jax):
    import jax.numpy as jnp

    src = {"x": jnp.arange(4, dtype=jnp.float32)}
    out = tf.to_host(src, copy=True)
    assert isinstance(out["x"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(4, dtype=np.float32))


def test_native_tensors_stay_native():
    t = tf.Tensor.from_numpy(np.arange(3))
    out = tf.to_host({"t": t}, copy=True)["t"]
    assert isinstance(out, tf.Tensor) and out.data_ptr != t.data_ptr
    np.testing.assert_array_equal(out.numpy(), np.arange(3))


def test_copies_are_64_byte_aligned():
    out = tf.to_host({"a": np.ones(3, np.int8), "b": np.ones(5, np.float64)}, copy=True)
    for v in out.values():
        assert v.ctypes.data % 64 == 0


def test_a_root_list_or_tuple_works():
    out = tf.to_host([np.ones(1), ("x", np.zeros(2))], copy=True)
    assert isinstance(out, list) and isinstance(out[1], tuple) and out[1][0] == "x"


def test_the_same_tensor_twice_stays_shared():
    a = np.ones(3)
    out = tf.to_host({"x": a, "y": a}, copy=True)
    assert out["x"] is out["y"]


@pytest.mark.parametrize("non_blocking", [False, True])
def test_non_blocking_numpy_results_come_through_a_transfer(state, non_blocking):
    out = tf.to_host(state, non_blocking=non_blocking, copy=True)
    if non_blocking:
        # NumPy arrays cannot wait for their copies: the handle gives them once done.
        assert isinstance(out, tf.Transfer)
        out = out.result()
    np.testing.assert_array_equal(out["ids"], np.arange(5))


def test_transformers_batches_and_model_outputs_keep_their_types(torch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 32, (2, 5))
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids), "note": "x"})
    moved = tf.to_device(batch, "cpu", copy=True)
    assert type(moved) is transformers.BatchEncoding and moved["note"] == "x"
    assert torch.equal(moved["input_ids"], ids) and moved["input_ids"].data_ptr() != ids.data_ptr()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    host = tf.to_host(out, copy=True)
    assert type(host) is type(out) and list(host.keys()) == list(out.keys())
    assert torch.equal(host.logits, out.logits) and host.logits.data_ptr() != out.logits.data_ptr()
    assert type(host.hidden_states) is tuple and len(host.hidden_states) == len(out.hidden_states)
    assert torch.equal(host[0], out.logits)  # ModelOutput's index access still works
    if not isinstance(out.get("past_key_values"), (tuple, type(None))):
        assert host.past_key_values is out.past_key_values  # a cache object, not a tensor: kept
    arrays = tf.to_numpy(out)
    assert isinstance(arrays.logits, np.ndarray)
    np.testing.assert_array_equal(arrays.logits, out.logits.numpy())
