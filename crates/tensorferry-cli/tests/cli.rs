//! The `tensorferry` command as a user runs it.

use std::process::Command;

use tensorferry::{save, SaveOptions, Tensor, TensorDict};

fn tensorferry(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorferry"))
        .args(args)
        .output()
        .expect("the binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn info_lists_the_host_and_the_cuda_state() {
    let (ok, out, _) = tensorferry(&["info"]);
    assert!(ok);
    assert!(out.contains("devices: cpu"), "{out}");
    assert!(out.contains("cuda: "), "{out}");
}

#[test]
fn inspect_shows_nested_paths_as_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let mut d = TensorDict::new();
    d.insert_path(
        &["model", "layer.0.weight"],
        Tensor::from_slice(&[1.0f32; 6], &[2, 3]).unwrap(),
    )
    .unwrap();
    let mut opts = SaveOptions::default();
    opts.metadata.insert("author".into(), "me".into());
    save(&d, &path, &opts).unwrap();
    let file = path.to_str().unwrap();

    let (ok, table, _) = tensorferry(&["inspect", file]);
    assert!(ok);
    assert!(
        table.contains("model/layer.0.weight")
            && table.contains("float32")
            && table.contains("[2, 3]"),
        "{table}"
    );
    assert!(table.contains("metadata author: me"), "{table}");

    let (ok, json, _) = tensorferry(&["inspect", file, "--json"]);
    assert!(ok);
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(doc["tensors"][0]["name"], "model.layer.0.weight");
    assert_eq!(
        doc["tensors"][0]["path"],
        serde_json::json!(["model", "layer.0.weight"])
    );
    assert_eq!(doc["total_bytes"], 24);
}

#[test]
fn inspect_of_a_broken_file_fails_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    std::fs::write(&path, [1, 2, 3]).unwrap();
    let (ok, _, err) = tensorferry(&["inspect", path.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("shorter than the 8-byte header"), "{err}");
}

#[test]
fn bench_prints_a_table_against_measured_roofs() {
    let (ok, out, err) = tensorferry(&[
        "bench", "--preset", "tiny-20k", "--scale", "0.01", "--repeat", "1",
    ]);
    assert!(ok, "{err}");
    for path in [
        "consolidate",
        "save (page cache)",
        "save (fsync)",
        "load (read, cached)",
        "load (mmap)",
    ] {
        assert!(out.contains(path), "{path} missing in {out}");
    }
    assert!(out.contains("roofs measured in this run"));
}

#[test]
fn help_lists_every_subcommand_convert_included() {
    let (ok, out, _) = tensorferry(&["--help"]);
    assert!(ok);
    for command in ["info", "inspect", "convert", "bench"] {
        assert!(
            out.contains(&format!("\n  {command} ")),
            "{command} in {out}"
        );
    }
}

#[test]
fn convert_from_the_binary_says_in_one_line_that_it_needs_the_python_package() {
    for args in [
        &["convert"][..],
        &["convert", "pytorch_model.bin", "--max-shard-size", "5GB"][..],
    ] {
        let (ok, out, err) = tensorferry(args);
        assert!(!ok);
        assert_eq!(out, "");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("tensorferry: convert ")
                && err.contains("pip install tensorferry torch"),
            "{err}"
        );
    }
}
