//! A tree that would give a file nobody can read is refused before the existing file is
//! touched: what tensorferry's reader or the official one refuses, the writer refuses.

mod common;

use common::{every_way, load_dict, save_dict};

use std::path::Path;

use tensorferry::{save, Error, LoadOptions, Node, SaveOptions, Tensor, TensorDict, Value};

fn small() -> Tensor {
    Tensor::from_slice(&[1.0f32], &[1]).unwrap()
}

/// Saves `root` over a file holding "previous": the save must fail, with the file and the
/// folder as they were.
fn assert_refused_leaving_the_file(root: &Node) -> Error {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kept.safetensors");
    std::fs::write(&path, b"previous").unwrap();
    let err = save(root, &path, &SaveOptions::default()).unwrap_err();
    assert_eq!(std::fs::read(&path).unwrap(), b"previous");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left"
    );
    err
}

#[test]
fn a_tensor_named_metadata_is_refused() {
    let mut d = TensorDict::new();
    d.insert("w", small());
    d.insert("__metadata__", small());
    let err = assert_refused_leaving_the_file(&Node::Dict(d));
    assert!(
        matches!(err, Error::InvalidValue { ref key, .. } if key == "__metadata__"),
        "{err:?}"
    );
    assert!(err.to_string().contains("reserves the name"), "{err}");
}

#[test]
fn a_dict_named_metadata_is_fine_its_tensors_have_longer_names() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.safetensors");
    let mut d = TensorDict::new();
    d.insert_path(&["__metadata__", "w"], small()).unwrap();
    save_dict(&d, &path, &SaveOptions::default());
    let (back, _) = load_dict(&path, LoadOptions::default());
    assert!(back.tensor(&["__metadata__", "w"]).is_some());
}

#[test]
fn an_empty_name_is_accepted_as_the_format_and_the_reader_accept_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty_name.safetensors");
    let mut d = TensorDict::new();
    d.insert("", small());
    save_dict(&d, &path, &SaveOptions::default());
    let (back, _) = load_dict(&path, LoadOptions::default());
    assert!(back.tensor(&[""]).is_some());
    let bytes = std::fs::read(&path).unwrap();
    assert!(safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .tensor("")
        .is_ok());
}

#[test]
fn a_tree_too_costly_to_read_back_is_refused() {
    // 400,000 plain values beside 4 bytes of data: reading it back would take far more
    // than 4x the file's size, so the reader would refuse it.
    let values: Vec<Node> = (0..400_000).map(|i| Node::Value(Value::Int(i))).collect();
    let mut d = TensorDict::new();
    d.insert("w", small());
    d.insert("values", Node::List(values));
    let err = assert_refused_leaving_the_file(&Node::Dict(d));
    assert!(matches!(err, Error::InvalidValue { .. }), "{err:?}");
    assert!(
        err.to_string().contains("refuse to read the file back"),
        "{err}"
    );
}

#[test]
fn a_tree_nested_too_deep_is_refused() {
    let mut node = Node::Tensor(small());
    for _ in 0..50 {
        node = Node::List(vec![node]);
    }
    assert_refused_leaving_the_file(&node);
}

#[test]
fn what_the_writer_accepts_the_reader_reads() {
    // Many plain values, but few enough for the bytes: saved and read back.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("values.safetensors");
    let values: Vec<Node> = (0..20_000).map(|i| Node::Value(Value::Int(i))).collect();
    let mut d = TensorDict::new();
    d.insert("values", Node::List(values));
    save_dict(&d, &path, &SaveOptions::default());
    assert!(Path::new(&path).exists());
    for options in every_way() {
        let (back, _) = load_dict(&path, options);
        assert!(matches!(back.get("values"), Some(Node::List(v)) if v.len() == 20_000));
    }
}
