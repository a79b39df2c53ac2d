"""The one walker of containers (``_native``'s): every kind of container a user's tree can
hold is entered by the same rules as a dict, with the same bounds, and comes back as its
own type where that type can be built from its items."""

from collections import defaultdict, namedtuple
from collections.abc import Mapping

import numpy as np
import pytest

import tensorferry as tf

from _mutating_leaf import AddsATensorWhenAsked

Pair = namedtuple("Pair", ["first", "second"])


class Frozen(Mapping):
    """A read-only Mapping that is no dict, built from a dict of items."""

    def __init__(self, items=()):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class Unbuildable(Frozen):
    """A Mapping whose type cannot be made from items."""

    def __init__(self, items, required):
        super().__init__(items)


class Row(list):
    """A list subclass."""


class Record(tuple):
    """A tuple subclass that is not a namedtuple."""


class Versioned(dict):
    """A dict subclass (a Mapping to the walker, walked through its own ``items``)."""


def test_a_mapping_that_is_no_dict_keeps_its_type_and_is_walked():
    src = {"m": Frozen({"w": np.ones(2), "n": Frozen({"b": np.zeros(1)}), "s": "x"})}
    out = tf.to_host(src, copy=True)
    assert type(out["m"]) is Frozen and type(out["m"]["n"]) is Frozen
    assert out["m"]["s"] is src["m"]["s"]
    np.testing.assert_array_equal(out["m"]["w"], np.ones(2))
    assert not np.shares_memory(out["m"]["w"], src["m"]["w"])
    assert not np.shares_memory(out["m"]["n"]["b"], src["m"]["n"]["b"])


def test_a_mapping_whose_type_cannot_be_built_from_items_comes_back_as_a_dict():
    src = {"m": Unbuildable({"w": np.ones(2)}, required=1)}
    out = tf.to_host(src, copy=True)
    assert type(out["m"]) is dict and list(out["m"]) == ["w"]
    assert not np.shares_memory(out["m"]["w"], src["m"]["w"])


def test_list_and_tuple_subclasses_keep_their_types_and_namedtuples_their_fields():
    src = {"row": Row([np.ones(1), 2]), "rec": Record((np.ones(1), "s")), "nt": Pair(Row([np.ones(1)]), 3)}
    out = tf.to_host(src, copy=True)
    assert type(out["row"]) is Row and out["row"][1] == 2
    assert type(out["rec"]) is Record and out["rec"][1] == "s"
    assert type(out["nt"]) is Pair and type(out["nt"].first) is Row and out["nt"].second == 3
    assert not np.shares_memory(out["row"][0], src["row"][0])
    assert not np.shares_memory(out["nt"].first[0], src["nt"].first[0])


def test_a_dict_subclass_and_a_defaultdict_inside_a_mapping_keep_their_types():
    src = Frozen({"v": Versioned(w=np.ones(1)), "d": defaultdict(int, {"x": np.ones(1)})})
    out = tf.to_device(src, "cpu", copy=True)
    assert type(out) is Frozen and type(out["v"]) is Versioned
    assert type(out["d"]) is defaultdict and out["d"].default_factory is int


def test_to_numpy_reaches_tensors_in_every_kind_of_container():
    t = tf.Tensor.from_numpy(np.arange(3.0))
    out = tf.to_numpy(Frozen({"row": Row([t]), "rec": Record((t,)), "nt": Pair(t, 1)}))
    for leaf in (out["row"][0], out["rec"][0], out["nt"].first):
        assert isinstance(leaf, np.ndarray)
        np.testing.assert_array_equal(leaf, np.arange(3.0))


def test_plain_containers_of_other_kinds_become_dict_list_and_tuple():
    td = tf.TensorDict({"m": Frozen({"row": Row([1]), "nt": Pair(1, 2), "rec": Record((1,))})})
    out = td.to_dict()
    assert type(out["m"]) is dict and type(out["m"]["row"]) is list
    assert type(out["m"]["nt"]) is tuple and type(out["m"]["rec"]) is tuple


def test_a_mapping_that_is_no_dict_and_contains_itself_is_an_error():
    inner = {"w": np.ones(2)}
    m = Frozen({"inner": inner})
    inner["loop"] = m  # through a dict
    alone = Frozen({"w": np.ones(2)})
    alone._items["self"] = alone  # through itself only
    for m in (m, alone):
        for call in (lambda: tf.to_host({"m": m}, copy=True), lambda: tf.to_device({"m": m}, "cpu"),
                     lambda: tf.TensorDict({"m": m}).keys(nested=True)):
            with pytest.raises(tf.FormatError, match="contains itself"):
                call()


def test_mappings_that_are_no_dict_nested_past_the_limit_are_an_error_naming_the_depth():
    d = np.ones(2, np.float32)
    for _ in range(tf._tree.MAX_DEPTH + 1):
        d = Frozen({"a": d})
    with pytest.raises(tf.FormatError, match=r"deeper than \d+ levels"):
        tf.to_host(d, copy=True)
    ok = np.ones(2, np.float32)
    for _ in range(tf._tree.MAX_DEPTH - 1):
        ok = Frozen({"a": ok})
    tf.to_host(ok, copy=True)


def test_list_subclasses_nested_past_the_limit_are_an_error_naming_the_depth():
    d = np.ones(2, np.float32)
    for _ in range(tf._tree.MAX_DEPTH + 1):
        d = Row([d])
    with pytest.raises(tf.FormatError, match=r"deeper than \d+ levels"):
        tf.to_host(d, copy=True)


def test_a_list_subclass_of_numbers_is_data_for_to_device():
    out = tf.to_device({"x": Row([1.0, 2.0]), "m": Frozen({"y": Row([[1, 2], [3, 4]])})}, "cpu")
    assert isinstance(out["x"], tf.Tensor) and out["x"].numpy().tolist() == [1.0, 2.0]
    assert isinstance(out["m"]["y"], tf.Tensor) and out["m"]["y"].numpy().tolist() == [[1, 2], [3, 4]]


def test_lists_of_numbers_in_an_optimizer_state_held_by_a_mapping_stay_lists():
    state = Frozen({"state": {0: {"step": np.ones(1)}}, "param_groups": [{"params": [0, 1], "lr": 0.1}]})
    out = tf.to_device({"optim": state, "data": [1.0, 2.0]}, "cpu")
    assert out["optim"]["param_groups"][0]["params"] == [0, 1]
    np.testing.assert_array_equal(out["optim"]["state"][0]["step"], np.ones(1))
    assert isinstance(out["data"], tf.Tensor)


class _NoContains(Frozen):
    def __contains__(self, key):
        raise ValueError("no membership test here")


def test_a_mapping_whose_membership_test_fails_is_walked_as_any_other():
    out = tf.to_device({"m": _NoContains({"x": [1.0, 2.0]})}, "cpu")
    assert type(out["m"]) is _NoContains and isinstance(out["m"]["x"], tf.Tensor)


def test_a_tensor_added_to_a_dict_subclass_during_a_move_is_an_error_naming_its_key():
    d = Versioned()
    d["sneaky"] = AddsATensorWhenAsked(d)
    with pytest.raises(RuntimeError, match="changed during the call at .*late"):
        tf.to_host({"outer": d}, copy=True)


def test_nested_keys_enter_every_kind_of_mapping_and_nothing_else():
    td = tf.TensorDict({"a": Frozen({"b": Versioned(c=1)}), "l": [{"x": 1}]})
    assert td.keys(nested=True) == ["a", ("a", "b"), ("a", "b", "c"), "l"]


def test_load_keys_keeps_the_named_leaves_and_drops_containers_left_empty(tmp_path):
    w = np.arange(3.0)
    path = tmp_path / "f.safetensors"
    tf.save({"a": {"x": w, "y": w + 1}, "t": (w + 2, 1), "l": [w + 3, w + 4], "gone": {"z": w}}, path)
    out = tf.load(path, keys=["a.x", "t.0", "l.1"])
    assert list(out) == ["a", "t", "l"] and list(out["a"]) == ["x"]
    assert type(out["t"]) is tuple and len(out["t"]) == 1 and type(out["l"]) is list and len(out["l"]) == 1
    np.testing.assert_array_equal(out["t"][0], w + 2)
    np.testing.assert_array_equal(out["l"][0], w + 4)
    whole = tf.load(path, keys="a")
    assert list(whole) == ["a"] and list(whole["a"]) == ["x", "y"]


def _natives(n):
    return [tf.to_device(np.full(3, float(i), np.float32), "cpu", like="tensorferry") for i in range(n)]


def test_convert_native_replaces_each_tensor_once_by_order_and_keeps_every_other_leaf():
    from tensorferry import _native

    a, b, c = _natives(3)
    arr = np.arange(2.0)
    tree = {"x": a, "l": [b, Pair(c, "s")], "tied": a, "r": Row([arr, 7]), "f": Frozen({"k": b})}
    seen = []

    def convert(tensors, paths):
        seen.append((list(tensors), paths))
        return [("made", float(t.numpy()[0])) for t in tensors]

    out = _native.convert_native(tree, convert, True)
    [(tensors, paths)] = seen
    assert [float(t.numpy()[0]) for t in tensors] == [0.0, 1.0, 2.0]  # a, b, c: each once
    assert paths == [("x",), ("l", 0), ("l", 1, 0)]  # a tensor's first path
    assert out["x"] is out["tied"] and out["x"] == ("made", 0.0)
    assert out["l"][0] is out["f"]["k"] and out["l"][1] == Pair(("made", 2.0), "s")
    assert type(out["l"][1]) is Pair and type(out["r"]) is Row and type(out["f"]) is Frozen
    assert out["r"][0] is arr and out["r"][1] == 7
    assert tree["x"] is a  # the input is not changed
    assert _native.convert_native(tree, lambda t, p: seen.append(p) or list(t), False)["x"] is a
    assert seen[-1] is None  # no paths unless asked for


def test_convert_native_without_tensors_calls_nothing_and_gives_the_same_object():
    from tensorferry import _native

    tree = {"a": np.arange(2.0), "b": [1, "s"]}
    assert _native.convert_native(tree, lambda *_: pytest.fail("called"), True) is tree


def test_convert_native_refuses_a_wrong_count_and_a_tree_changed_by_convert():
    from tensorferry import _native

    a, b, late = _natives(3)
    with pytest.raises(RuntimeError, match="1 replacements for 2 tensors"):
        _native.convert_native({"a": a, "b": b}, lambda t, p: t[:1])
    tree = {"a": a, "b": b}

    def swaps(tensors, paths):
        tree["a"] = late  # another tensor where the first one was
        return tensors

    with pytest.raises(RuntimeError, match="changed during the call at .*a"):
        _native.convert_native(tree, swaps)
    tree = {"a": a}

    def adds(tensors, paths):
        tree["z"] = late
        return tensors

    with pytest.raises(RuntimeError, match="changed during the call"):
        _native.convert_native(tree, adds)
    tree = {"a": a, "b": b}

    def drops(tensors, paths):
        del tree["b"]
        return tensors

    with pytest.raises(RuntimeError, match="1 of its 2 tensors were gone"):
        _native.convert_native(tree, drops)
    with pytest.raises(TypeError):
        _native.convert_native({"a": a}, lambda t, p: None)  # no sequence of replacements


def test_a_tensor_saved_under_two_names_loads_as_one_object_in_its_first_names_framework(tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.arange(6.0)
    path = tmp_path / "tied.safetensors"
    tf.save({"a": t, "b": t.numpy()}, path)  # one tensor, stored once, from two frameworks
    out = tf.load(path)
    assert out["a"] is out["b"] and isinstance(out["a"], torch.Tensor)
    tf.save({"b": t.numpy(), "a": t}, path)
    out = tf.load(path)
    assert out["a"] is out["b"] and isinstance(out["b"], np.ndarray)
    np.testing.assert_array_equal(out["a"], np.arange(6.0, dtype=np.float32))
