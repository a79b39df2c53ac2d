//! Property tests: random nested trees of random dtypes and shapes (0-d, empty,
//! strided) survive save/load and consolidate unchanged.

use proptest::prelude::*;
use tensorferry::{
    consolidate, load, save, DType, LoadOptions, Node, SaveOptions, Tensor, TensorDict, Value,
};

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(
        DType::ALL
            .iter()
            .copied()
            .filter(|d| *d != DType::Complex128)
            .collect::<Vec<_>>(),
    )
}

fn tensor() -> impl Strategy<Value = Tensor> {
    (
        dtype(),
        prop::collection::vec(0usize..4, 0..4),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(dtype, mut shape, strided, seed)| {
            if dtype.lanes() > 1 && shape.is_empty() {
                // A file counts packed values along the last dimension: no scalars.
                shape.push(1);
            }
            let n: usize = shape.iter().product::<usize>() * dtype.size();
            let bytes: Vec<u8> = (0..n)
                .map(|i| (seed.wrapping_mul(i as u64 + 1) >> 7) as u8)
                .collect();
            let t = Tensor::from_bytes(dtype, shape.clone(), &bytes).unwrap();
            if strided && shape.len() >= 2 {
                t.transpose(0, shape.len() - 1).unwrap()
            } else {
                t
            }
        })
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::None),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        any::<f64>().prop_map(Value::Float),
        ".{0,8}".prop_map(Value::Str),
    ]
}

fn node() -> impl Strategy<Value = Node> {
    let leaf = prop_oneof![
        tensor().prop_map(Node::Tensor),
        value().prop_map(Node::Value)
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Node::List),
            prop::collection::vec(inner.clone(), 0..4).prop_map(Node::Tuple),
            // Keys with dots and slashes are ordinary keys; a fixed prefix per position keeps
            // the dotted names of siblings apart (collisions are tested elsewhere).
            prop::collection::vec(("[a-z./]{0,5}", any::<Option<i8>>(), inner), 0..4).prop_map(
                |kv| {
                    let mut d = TensorDict::new();
                    for (i, (k, int, v)) in kv.into_iter().enumerate() {
                        match int {
                            // Integer keys (an optimizer's parameter indices), one text per place.
                            Some(n) => d.insert(i64::from(n) * 10 + i as i64, v),
                            None => d.insert(format!("k{i}_{}", k.replace('.', "_")), v),
                        };
                    }
                    Node::Dict(d)
                }
            ),
        ]
    })
}

fn root() -> impl Strategy<Value = Node> {
    prop::collection::vec(node(), 0..5)
        .prop_map(|items| {
            items
                .into_iter()
                .enumerate()
                .map(|(i, n)| (format!("r{i}"), n))
                .collect::<TensorDict>()
        })
        .prop_map(Node::Dict)
}

fn same(a: &Node, b: &Node) -> bool {
    match (a, b) {
        (Node::Tensor(x), Node::Tensor(y)) => {
            x.dtype() == y.dtype()
                && x.shape() == y.shape()
                && x.deep_copy().unwrap().contiguous_bytes()
                    == y.deep_copy().unwrap().contiguous_bytes()
        }
        (Node::Value(Value::Float(x)), Node::Value(Value::Float(y))) => {
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())
        }
        (Node::Value(x), Node::Value(y)) => x == y,
        (Node::List(x), Node::List(y)) | (Node::Tuple(x), Node::Tuple(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Node::Dict(x), Node::Dict(y)) => {
            x.len() == y.len()
                && x.iter_keyed()
                    .zip(y.iter_keyed())
                    .all(|((ka, a), (kb, b))| {
                        (ka.as_str(), ka.is_int()) == (kb.as_str(), kb.is_int()) && same(a, b)
                    })
        }
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn save_then_load_gives_the_same_tree(tree in root(), mmap in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        save(&tree, &path, &SaveOptions { fsync: false, ..Default::default() }).unwrap();
        // SAFETY: the file lives in this test's own temporary folder; nothing truncates or
        // rewrites it while its tensors are alive.
        let mmap = if mmap { unsafe { tensorferry::Mapping::map() } } else { tensorferry::Mapping::READ };
        let back = load(&path, LoadOptions { mmap, direct: false, ..Default::default() }).unwrap();
        prop_assert!(same(&tree, &back.root));
    }

    #[test]
    fn consolidate_keeps_every_value(tree in root()) {
        let packed = consolidate(&tree).unwrap();
        prop_assert!(same(&tree, &packed));
        for (_, t) in packed.tensors() {
            prop_assert!(t.is_contiguous());
        }
    }
}
