"""Property tests: random nested trees of random dtypes and shapes survive save/load and
to_host(copy=True) unchanged."""

import numpy as np
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from _trees import same

import tensorferry as tf

DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
          np.float16, np.float32, np.float64, np.complex64]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
).flatmap(lambda a: st.sampled_from([a, a.T, a[::-1] if a.ndim else a]))

plain = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=5)
keys = st.text(alphabet="ab.", min_size=1, max_size=3)

trees = st.recursive(
    arrays | plain,
    lambda inner: st.lists(inner, max_size=3)
    | st.tuples(inner, inner)
    | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


def collides(tree):
    names = []

    def walk(x, path):
        if isinstance(x, np.ndarray):
            names.append(".".join(path))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + [k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, path + [str(i)])

    walk(tree, [])
    return len(names) != len(set(names))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, trees, max_size=4), st.booleans())
def test_save_load_round_trip(tmp_path_factory, tree, mmap):
    p = tmp_path_factory.mktemp("p") / "t.safetensors"
    if collides(tree):
        try:
            tf.save(tree, p)
        except tf.FormatError:
            return
        raise AssertionError("a name collision was not reported")
    tf.save(tree, p, fsync=False)
    assert same(tf.load(p, mmap=mmap), tree)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_to_host_copy_keeps_values(tree):
    assert same(tf.to_host(tree, copy=True), tree)


# Leaves the bulk host copy takes (rows of whole 64-byte multiples, several of one dtype and
# shape), mixed with leaves it leaves to the engine, in any layout and byte order.
bulk_leaves = st.sampled_from(DTYPES + [np.complex128]).flatmap(
    lambda dt: st.tuples(
        st.integers(1, 3),
        st.sampled_from([(64 // np.dtype(dt).itemsize,), (2, 32 // np.dtype(dt).itemsize), (3,)]),
    ).flatmap(
        lambda n_shape: st.lists(
            hnp.arrays(dt, n_shape[1]).flatmap(
                lambda a: st.sampled_from([a, a.T, a.astype(a.dtype.newbyteorder()), np.asfortranarray(a)])
            ),
            min_size=n_shape[0],
            max_size=n_shape[0] + 2,
        )
    )
)


@settings(max_examples=80, deadline=None)
@given(st.lists(bulk_leaves, min_size=1, max_size=3))
def test_bulk_host_copies_keep_values_and_alignment_and_share_nothing(groups):
    tree = {str(i): leaves for i, leaves in enumerate(groups)}
    out = tf.to_host(tree, copy=True)
    for i, leaves in enumerate(groups):
        for a, b in zip(leaves, out[str(i)]):
            assert b.shape == a.shape and b.dtype.newbyteorder("=") == a.dtype.newbyteorder("=")
            assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
            assert not np.shares_memory(a, b) and b.flags.writeable
            assert b.__array_interface__["data"][0] % 64 == 0
