//! Build a nested dictionary of tensors and plain values, save it as safetensors, and
//! load it back exactly. Run: cargo run -p tensorferry --example 01-save-and-load

use tensorferry::{load, save, LoadOptions, Node, SaveOptions, Tensor, TensorDict, Value};

fn main() -> tensorferry::Result<()> {
    let mut state = TensorDict::new();
    // "layer.0.weight" is one key: dots are ordinary characters in keys.
    state.insert_path(
        &["model", "layer.0.weight"],
        Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?,
    )?;
    state.insert_path(
        &["model", "layer.0.bias"],
        Tensor::from_slice(&[0.5f32, -0.5], &[2])?,
    )?;
    state.insert("step", 1200i64);
    state.insert("run", "example");
    // The dictionary is a node: every entry point takes and returns a `Node`.
    let state = Node::from(state);

    let dir = std::env::temp_dir().join(format!("tensorferry-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| tensorferry::Error::Io {
        op: "create",
        path: dir.clone(),
        source: e,
    })?;
    let path = dir.join("state.safetensors");
    save(&state, &path, &SaveOptions::default())?;

    // The safe default reads the file into fresh memory. Mapping it instead (no copy,
    // read-only views of the file) is the unsafe opt-in `Mapping::map`.
    let back = load(&path, LoadOptions::default())?.root;
    let w = back.tensor(&["model", "layer.0.weight"]).expect("saved");
    println!("{:?} = {:?}", w, w.to_vec::<f32>()?);
    assert!(matches!(
        back.get_path(&["step"]),
        Some(Node::Value(Value::Int(1200)))
    ));
    println!(
        "{} tensors, {} bytes, keys {:?}",
        back.tensor_count(),
        back.nbytes(),
        back.as_dict().expect("a dict").keys().collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
