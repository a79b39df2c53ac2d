//! What a training state holds beside tensors: integer keys (the parameter indices of an
//! optimizer's state) and one tensor under several keys (tied weights) save, load back
//! as they were, and read in other tools as flat dotted names.

mod common;

use common::{every_way, f32s, load_dict, official_names, save_dict, save_err, write_official};

use std::sync::Arc;

use tensorferry::{load, save, DType, Error, LoadOptions, Node, SaveOptions, Tensor, TensorDict};

/// An optimizer's state dict: `{"state": {0: {...}, 1: {...}}, "param_groups": [...]}`.
fn optimizer_state() -> TensorDict {
    let mut state = TensorDict::new();
    for i in 0..2i64 {
        let mut one = TensorDict::new();
        one.insert("step", f32s(&[3.0], &[]));
        one.insert("exp_avg", f32s(&[i as f32; 4], &[2, 2]));
        state.insert(i, one);
    }
    let mut group = TensorDict::new();
    group.insert("lr", 0.1);
    group.insert("betas", Node::Tuple(vec![0.9.into(), 0.999.into()]));
    group.insert("params", Node::List(vec![0i64.into(), 1i64.into()]));
    let mut d = TensorDict::new();
    d.insert("state", state);
    d.insert("param_groups", Node::List(vec![Node::Dict(group)]));
    d
}

fn int_keys(d: &TensorDict) -> Vec<(String, bool)> {
    d.iter_keyed()
        .map(|(k, _)| (k.to_string(), k.is_int()))
        .collect()
}

#[test]
fn integer_keys_come_back_as_integers_and_read_as_dotted_names_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    save_dict(&optimizer_state(), &path, &SaveOptions::default());
    for how in every_way() {
        let (back, _) = load_dict(&path, how);
        let state = back.get("state").unwrap().as_dict().unwrap();
        assert_eq!(int_keys(state), [("0".into(), true), ("1".into(), true)]);
        assert_eq!(
            back.tensor(&["state", "1", "exp_avg"])
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            [1.0; 4]
        );
    }
    assert_eq!(
        official_names(&path),
        [
            "state.0.exp_avg",
            "state.0.step",
            "state.1.exp_avg",
            "state.1.step"
        ]
    );
}

#[test]
fn a_dict_of_tensors_under_integer_keys_keeps_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = TensorDict::new();
    d.insert(-3i64, f32s(&[1.0], &[1]));
    d.insert("w", f32s(&[2.0], &[1]));
    let path = dir.path().join("flat.safetensors");
    save_dict(&d, &path, &SaveOptions::default());
    let (back, _) = load_dict(&path, LoadOptions::default());
    assert_eq!(int_keys(&back), [("-3".into(), true), ("w".into(), false)]);
}

#[test]
fn a_record_with_integer_keys_says_format_2_and_others_stay_format_1() {
    let dir = tempfile::tempdir().unwrap();
    let record = |d: &TensorDict| {
        let path = dir.path().join("r.safetensors");
        save_dict(d, &path, &SaveOptions::default());
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        meta.metadata().as_ref().unwrap()["tensorferry"].clone()
    };
    assert!(record(&optimizer_state()).starts_with(r#"{"format":2,"#));
    let mut plain = TensorDict::new();
    plain.insert("step", 3i64);
    plain.insert("w", f32s(&[1.0], &[1]));
    assert!(record(&plain).starts_with(r#"{"format":1,"#));
}

#[test]
fn records_of_format_1_still_load() {
    let dir = tempfile::tempdir().unwrap();
    let record = r#"{"format":1,"tree":{"dict":[["0",{"tensor":"0"}],["n",{"int":5}]]}}"#;
    let meta = std::collections::HashMap::from([("tensorferry".to_string(), record.to_string())]);
    let path = dir.path().join("v1.safetensors");
    write_official(&path, &[("0", &[0.0])], Some(meta));
    let (d, _) = load_dict(&path, LoadOptions::default());
    assert_eq!(int_keys(&d), [("0".into(), false), ("n".into(), false)]);
}

/// A model whose output layer is its embedding (tied weights).
fn tied() -> (TensorDict, Tensor) {
    let wte = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    let mut d = TensorDict::new();
    d.insert("wte.weight", wte.clone());
    d.insert("h.0.bias", f32s(&[7.0, 8.0], &[2]));
    d.insert("lm_head.weight", wte.clone());
    (d, wte)
}

#[test]
fn a_tensor_under_two_keys_is_written_once_and_shared_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tied.safetensors");
    let (d, _) = tied();
    save_dict(&d, &path, &SaveOptions::default());
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Other tools see the tensor once, under its first name (as `save_model` does).
    assert_eq!(official_names(&path), ["h.0.bias", "wte.weight"]);
    assert_eq!(st.tensor("wte.weight").unwrap().data().len(), 24);
    for how in every_way() {
        let (back, _) = load_dict(&path, how);
        assert_eq!(
            back.keys().collect::<Vec<_>>(),
            ["wte.weight", "h.0.bias", "lm_head.weight"]
        );
        let a = back.tensor(&["wte.weight"]).unwrap();
        let b = back.tensor(&["lm_head.weight"]).unwrap();
        assert!(Arc::ptr_eq(a.storage(), b.storage()));
        assert_eq!(a.data_ptr(), b.data_ptr());
        assert_eq!(b.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }
}

#[test]
fn tied_tensors_in_a_sharded_checkpoint_are_shared_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let (d, _) = tied();
    let mut big = d.clone();
    big.insert("x", Tensor::zeros(DType::F32, &[64]).unwrap());
    let path = dir.path().join("model.safetensors");
    let files = tensorferry::internal::io::save_sharded(
        &Node::Dict(big),
        &path,
        &SaveOptions::default(),
        64,
    )
    .unwrap();
    assert!(files.len() > 1, "{files:?}");
    let back = load(dir.path(), LoadOptions::default()).unwrap().root;
    let back = back.as_dict().unwrap();
    let a = back.tensor(&["wte.weight"]).unwrap();
    let b = back.tensor(&["lm_head.weight"]).unwrap();
    assert_eq!(a.data_ptr(), b.data_ptr());
}

#[test]
fn one_tensor_in_a_list_twice_is_one_tensor_after_load() {
    let dir = tempfile::tempdir().unwrap();
    let t = f32s(&[1.0, 2.0], &[2]);
    let root = Node::List(vec![Node::Tensor(t.clone()), Node::Tensor(t)]);
    let path = dir.path().join("l.safetensors");
    save(&root, &path, &SaveOptions::default()).unwrap();
    let back = load(&path, LoadOptions::default()).unwrap().root;
    let Node::List(items) = back else {
        panic!("{back:?}")
    };
    let ptrs: Vec<_> = items
        .iter()
        .map(|n| n.as_tensor().unwrap().data_ptr())
        .collect();
    assert_eq!(ptrs[0], ptrs[1]);
}

#[test]
fn overlapping_views_are_refused_naming_both_keys_and_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let w = f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let mut d = TensorDict::new();
    d.insert("w", w.clone());
    d.insert("w_t", w.transpose(0, 1).unwrap());
    let path = dir.path().join("o.safetensors");
    let err = save_err(d, &path);
    let text = err.to_string();
    assert!(matches!(err, Error::InvalidValue { .. }), "{err:?}");
    assert!(
        text.contains("w_t") && text.contains("\"w\"") && text.contains(".clone()"),
        "{text}"
    );
    assert!(!path.exists());
    // Views of one storage that do not overlap (its two rows) are two tensors.
    let rows = |at| Tensor::from_storage(w.storage().clone(), at, DType::F32, vec![2], vec![1]);
    let mut d = TensorDict::new();
    d.insert("row0", rows(0).unwrap());
    d.insert("row1", rows(8).unwrap());
    save_dict(&d, &path, &SaveOptions::default());
    let (back, _) = load_dict(&path, LoadOptions::default());
    assert_eq!(
        back.tensor(&["row1"]).unwrap().to_vec::<f32>().unwrap(),
        [3.0, 4.0]
    );
}
