//! Saving and loading safetensors files: exact round trips and interoperability.

mod common;

use common::{every_way, f32s, load_dict, official_names, save_dict, save_err, write_official};

use std::collections::BTreeMap;

use tensorferry::{load, save, DType, LoadOptions, Node, SaveOptions, Tensor, TensorDict, Value};

fn sample() -> TensorDict {
    let mut d = TensorDict::new();
    d.insert_path(
        &["model", "layer.0.weight"],
        f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]),
    )
    .unwrap();
    d.insert_path(
        &["model", "layer.0.bias"],
        Tensor::from_slice(&[7i64, 8], &[2]).unwrap(),
    )
    .unwrap();
    d.insert(
        "mask",
        Tensor::from_slice(&[true, false, true], &[3]).unwrap(),
    );
    d.insert("step", 12i64);
    d.insert("lr", f64::NAN);
    d.insert("name", "run");
    d.insert("none", Node::Value(Value::None));
    d.insert(
        "history",
        Node::Tuple(vec![
            Node::Tensor(f32s(&[0.5], &[])),
            Node::Value(Value::Float(f64::NEG_INFINITY)),
        ]),
    );
    d
}

fn assert_same(a: &TensorDict, b: &TensorDict) {
    let (a, b) = (Node::from(a.clone()), Node::from(b.clone()));
    let ta = a.tensors();
    let tb = b.tensors();
    assert_eq!(ta.len(), tb.len());
    for ((pa, x), (pb, y)) in ta.iter().zip(&tb) {
        assert_eq!(pa, pb);
        assert_eq!(x.dtype(), y.dtype());
        assert_eq!(x.shape(), y.shape());
        assert_eq!(
            x.deep_copy().unwrap().contiguous_bytes(),
            y.deep_copy().unwrap().contiguous_bytes()
        );
    }
}

#[test]
fn a_saved_tree_loads_back_exactly_every_way() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let d = sample();
    save_dict(&d, &path, &SaveOptions::default());
    for options in every_way() {
        let (back, meta) = load_dict(&path, options);
        assert!(meta.is_empty());
        assert_same(&d, &back);
        assert_eq!(
            back.keys().collect::<Vec<_>>(),
            d.keys().collect::<Vec<_>>()
        );
        assert!(matches!(
            back.get("step"),
            Some(Node::Value(Value::Int(12)))
        ));
        assert!(matches!(back.get("lr"), Some(Node::Value(Value::Float(x))) if x.is_nan()));
        assert!(matches!(back.get("none"), Some(Node::Value(Value::None))));
        match back.get("history") {
            Some(Node::Tuple(items)) => {
                assert!(matches!(items[1], Node::Value(Value::Float(x)) if x == f64::NEG_INFINITY))
            }
            other => panic!("history came back as {other:?}"),
        }
        let w = back.tensor(&["model", "layer.0.weight"]).unwrap();
        assert_eq!(
            w.is_read_only(),
            options.mmap.is_mapped() && !options.direct
        );
    }
}

#[test]
fn user_metadata_is_kept_and_the_reserved_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let mut opts = SaveOptions::default();
    opts.metadata.insert("author".into(), "me".into());
    save(&tensorferry::Node::from(sample()), &path, &opts).unwrap();
    let (_, meta) = load_dict(&path, LoadOptions::default());
    assert_eq!(
        meta,
        BTreeMap::from([("author".to_string(), "me".to_string())])
    );
    opts.metadata.insert("tensorferry".into(), "x".into());
    assert!(save(&tensorferry::Node::from(sample()), &path, &opts).is_err());
}

#[test]
fn a_list_at_the_root_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.safetensors");
    let root = Node::List(vec![
        Node::Tensor(f32s(&[1.0], &[1])),
        Node::Value(Value::Str("x".into())),
    ]);
    save(&root, &path, &SaveOptions::default()).unwrap();
    let back = load(&path, LoadOptions::default()).unwrap();
    assert!(matches!(back.root, Node::List(ref items) if items.len() == 2));
    assert!(back.into_dict().is_err(), "a list is not a dict");
}

#[test]
fn files_are_valid_for_the_official_reader_with_dotted_names() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("o.safetensors");
    save_dict(&sample(), &path, &SaveOptions::default());
    assert_eq!(
        official_names(&path),
        [
            "history.0",
            "mask",
            "model.layer.0.bias",
            "model.layer.0.weight"
        ]
    );
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("model.layer.0.weight").unwrap();
    assert_eq!(w.shape(), &[2, 2]);
    let expected: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(w.data(), &expected[..]);
}

#[test]
fn files_of_the_official_writer_load_as_flat_dicts_keeping_dots() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("official.safetensors");
    write_official(&path, &[("a.b.c", &[1.0, 2.0])], None);
    let (d, _) = load_dict(&path, LoadOptions::default());
    assert_eq!(d.keys().collect::<Vec<_>>(), ["a.b.c"]);
    assert_eq!(
        d.tensor(&["a.b.c"]).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 2.0]
    );
}

/// The `__metadata__` of the file at `path`, as the official reader reads it.
fn official_metadata(path: &std::path::Path) -> BTreeMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect()
}

#[test]
fn a_flat_dict_is_saved_without_the_tree_record_and_loads_back_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flat.safetensors");
    // Keys out of alphabetical order, dotted, and dtypes of rising and falling size (the
    // bytes follow in order of falling size, the header lists the dict's order): the
    // record would only repeat the names.
    let mut flat = TensorDict::new();
    flat.insert("z.w", Tensor::from_slice(&[1u8, 2, 3], &[3]).unwrap());
    flat.insert("a", f32s(&[3.0], &[1]));
    flat.insert("m.b", Tensor::from_slice(&[true], &[1]).unwrap());
    flat.insert("n", Tensor::from_slice(&[7i64, 8], &[2]).unwrap());
    let mut opts = SaveOptions::default();
    opts.metadata.insert("k".into(), "v".into());
    save_dict(&flat, &path, &opts);
    assert_eq!(
        official_metadata(&path),
        BTreeMap::from([("k".to_string(), "v".to_string())])
    );
    for how in every_way() {
        let (back, meta) = load_dict(&path, how);
        assert_eq!(back.keys().collect::<Vec<_>>(), ["z.w", "a", "m.b", "n"]);
        assert_same(&flat, &back);
        assert_eq!(meta, opts.metadata);
    }
    // The official reader finds every tensor, aligned to its element size.
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("n").unwrap().data().as_ptr() as usize % 8, 0);
    assert_eq!(st.tensor("z.w").unwrap().data(), &[1, 2, 3]);
    assert_eq!(st.tensor("a").unwrap().data(), &3.0f32.to_le_bytes());

    // Any nesting or plain value keeps the record.
    let mut nested = TensorDict::new();
    nested.insert_path(&["a", "b"], f32s(&[1.0], &[1])).unwrap();
    let mut with_value = TensorDict::new();
    with_value.insert("t", f32s(&[1.0], &[1]));
    with_value.insert("step", 3i64);
    for (dict, order) in [(nested, vec!["a"]), (with_value, vec!["t", "step"])] {
        save_dict(&dict, &path, &SaveOptions::default());
        assert!(official_metadata(&path).contains_key("tensorferry"));
        for how in every_way() {
            let (back, _) = load_dict(&path, how);
            assert_eq!(back.keys().collect::<Vec<_>>(), order);
            assert_same(&dict, &back);
        }
    }
}

#[test]
fn strided_tensors_are_written_in_c_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    let m = Tensor::from_slice(&[1u16, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
    let mut d = TensorDict::new();
    d.insert("t", m.transpose(0, 1).unwrap());
    save_dict(&d, &path, &SaveOptions::default());
    let (back, _) = load_dict(&path, LoadOptions::default());
    assert_eq!(
        back.tensor(&["t"]).unwrap().to_vec::<u16>().unwrap(),
        vec![1, 4, 2, 5, 3, 6]
    );
}

#[test]
fn colliding_names_complex128_and_bad_roots_fail_before_touching_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.safetensors");
    std::fs::write(&path, b"previous").unwrap();
    let mut d = TensorDict::new();
    d.insert("a.b", f32s(&[1.0], &[1]));
    d.insert_path(&["a", "b"], f32s(&[2.0], &[1])).unwrap();
    let err = save_err(d, &path);
    assert!(
        err.to_string().contains("a.b") && err.to_string().contains("a/b"),
        "{err}"
    );
    let mut c = TensorDict::new();
    c.insert("z", Tensor::zeros(DType::Complex128, &[1]).unwrap());
    let err = save_err(c, &path);
    assert!(
        err.to_string().contains("complex128") && err.to_string().contains('z'),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"previous");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file is left"
    );
}

#[test]
fn a_failed_write_leaves_the_previous_file_and_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keep.safetensors");
    save_dict(&sample(), &path, &SaveOptions::default());
    let before = std::fs::read(&path).unwrap();
    // A view whose storage is foreign device memory cannot be written: the save fails.
    let mut bad = sample();
    // SAFETY: never read: the save refuses device memory before reading it.
    let t = unsafe {
        Tensor::from_foreign(
            std::ptr::null_mut(),
            tensorferry::Device::Cuda(0),
            true,
            Box::new(()),
            DType::F32,
            vec![1],
            vec![1],
        )
    }
    .unwrap();
    bad.insert("gpu", t);
    assert!(save(
        &tensorferry::Node::from(bad.clone()),
        &path,
        &SaveOptions::default()
    )
    .is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn empty_dicts_and_empty_tensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.safetensors");
    let mut d = TensorDict::new();
    d.insert("empty", Tensor::zeros(DType::F16, &[0, 3]).unwrap());
    d.insert("sub", TensorDict::new());
    save_dict(&d, &path, &SaveOptions::default());
    for options in every_way() {
        let (back, _) = load_dict(&path, options);
        assert_eq!(back.tensor(&["empty"]).unwrap().shape(), &[0, 3]);
        assert!(matches!(back.get("sub"), Some(Node::Dict(s)) if s.is_empty()));
    }
}

#[test]
fn a_dict_of_many_small_tensors_of_every_rank_loads_back_exactly_every_way() {
    // Over 64 KiB of header (the reader then parses it while another thread reads the
    // data), shapes of 0 to 6 dimensions (inline and on the heap), values between them;
    // no float, so the tree record is read by the fast reader.
    let mut d = TensorDict::new();
    d.insert("name", "run");
    for i in 0..3000usize {
        let shape: Vec<usize> = (0..i % 7).map(|k| 1 + (i + k) % 2).collect();
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|j| (i * 7 + j) as f32).collect();
        d.insert_path(&["many", &format!("t{i}")], f32s(&values, &shape))
            .unwrap();
        if i % 100 == 0 {
            d.insert_path(&["values", &format!("v{i}")], i as i64)
                .unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.safetensors");
    save_dict(&d, &path, &SaveOptions::default());
    for options in every_way() {
        let (back, _) = load_dict(&path, options);
        assert_same(&d, &back);
        assert_eq!(back.len(), d.len());
    }
}
