//! The `tensorferry` command as a user runs it.

use std::process::Command;

use std::path::Path;

use serde_json::Value;
use tensorferry::internal::io::{read_header, save_sharded};
use tensorferry::{save, DType, Node, SaveOptions, Tensor, TensorDict};

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
    save(&d.into(), &path, &opts).unwrap();
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
    assert_no_row_above_its_roof(&out);
}

/// Every "% roof" is at most 100: a row faster than its roof says "roof mismeasured".
fn assert_no_row_above_its_roof(table: &str) {
    for line in table.lines() {
        if let Some(pct) = line
            .split_whitespace()
            .last()
            .and_then(|w| w.strip_suffix('%'))
        {
            let pct: f64 = pct
                .parse()
                .unwrap_or_else(|_| panic!("not a percentage: {line}"));
            assert!(
                pct <= 100.0,
                "a row above its roof printed as a percentage: {line}"
            );
        }
    }
}

#[test]
fn bench_times_device_moves_against_raw_copies_on_the_backend() {
    let (ok, out, err) = tensorferry(&[
        "bench", "--preset", "tiny-1k", "--scale", "0.01", "--repeat", "1", "--device", "emu:0",
    ]);
    assert!(ok, "{err}");
    for path in [
        "to host, pinned",
        "to device, from pinned",
        "save from device",
    ] {
        assert!(out.contains(path), "{path} missing in {out}");
    }
    assert!(out.contains("raw copy into pinned"), "{out}");
    assert!(out.contains("raw copy from pinned"), "{out}");
    assert_no_row_above_its_roof(&out);
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

/// What the headers of `files` store: tensors and bytes.
fn stored_in(files: &[&Path]) -> (u64, u64) {
    let mut totals = (0, 0);
    for file in files {
        for t in read_header(file).unwrap().tensors {
            totals.0 += 1;
            totals.1 += (t.end - t.begin) as u64;
        }
    }
    totals
}

fn inspect_json(path: &Path) -> Value {
    let (ok, json, err) = tensorferry(&["inspect", "--json", path.to_str().unwrap()]);
    assert!(ok, "{err}");
    serde_json::from_str(&json).unwrap()
}

#[test]
fn inspect_totals_count_tensors_and_bytes_per_dtype_as_the_file_stores_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let mut d = TensorDict::new();
    let wte = Tensor::from_slice(&[1.0f32; 6], &[2, 3]).unwrap();
    d.insert("wte", wte.clone());
    d.insert(
        "norm",
        Tensor::from_bytes(DType::BF16, vec![4], &[0u8; 8]).unwrap(),
    );
    // Tied: stored once, shown at both places, counted once.
    d.insert("lm_head", wte);
    save(&d.into(), &path, &SaveOptions::default()).unwrap();
    assert_eq!(stored_in(&[&path]), (2, 32));

    let doc = inspect_json(&path);
    assert_eq!(doc["total_tensors"], 2);
    assert_eq!(doc["total_bytes"], 32);
    assert_eq!(
        doc["dtypes"],
        serde_json::json!({"float32": {"tensors": 1, "bytes": 24}, "bfloat16": {"tensors": 1, "bytes": 8}})
    );
    assert_eq!(doc["tensors"][2]["name"], "lm_head");
    assert_eq!(doc["tensors"][2]["same_as"], "wte");

    let (ok, table, _) = tensorferry(&["inspect", path.to_str().unwrap()]);
    assert!(ok);
    for line in [
        "2 tensors, 32 bytes (32 B)",
        "  float32: 1 tensor, 24 bytes (24 B)",
        "  bfloat16: 1 tensor, 8 bytes (8 B)",
        "  1 more paths name a tied tensor (stored once, counted once)",
    ] {
        assert!(table.lines().any(|l| l == line), "{line:?} in\n{table}");
    }
    assert!(table.contains("same as wte"), "{table}");
}

#[test]
fn inspect_of_a_sharded_checkpoint_reads_every_shard_by_its_index_or_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = TensorDict::new();
    for i in 0..5 {
        d.insert(
            format!("layer.{i}.weight"),
            Tensor::from_slice(&[i as f32; 250], &[25, 10]).unwrap(),
        );
    }
    d.insert("head", Tensor::from_slice(&[1i64; 3], &[3]).unwrap());
    let written = save_sharded(
        &Node::Dict(d),
        dir.path().join("model.safetensors"),
        &SaveOptions::default(),
        2500,
    )
    .unwrap();
    let (index, shards) = written.split_last().unwrap();
    assert!(shards.len() >= 3, "{written:?}");
    let shard_paths: Vec<&Path> = shards.iter().map(|p| p.as_path()).collect();
    let (tensors, bytes) = stored_in(&shard_paths);
    assert_eq!((tensors, bytes), (6, 5 * 1000 + 24));

    for path in [index.as_path(), dir.path()] {
        let doc = inspect_json(path);
        assert_eq!(doc["total_tensors"], tensors);
        assert_eq!(doc["total_bytes"], bytes);
        assert_eq!(
            doc["dtypes"],
            serde_json::json!({"float32": {"tensors": 5, "bytes": 5000}, "int64": {"tensors": 1, "bytes": 24}})
        );
        assert!(
            doc["index"]
                .as_str()
                .unwrap()
                .ends_with("model.safetensors.index.json"),
            "{doc}"
        );
        let listed: Vec<&str> = doc["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["file"].as_str().unwrap())
            .collect();
        let on_disk: Vec<String> = shards
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        assert_eq!(listed, on_disk);
        for (shard, file) in doc["shards"].as_array().unwrap().iter().zip(shards) {
            let (n, b) = stored_in(&[file]);
            assert_eq!(
                (shard["tensors"].as_u64(), shard["bytes"].as_u64()),
                (Some(n), Some(b))
            );
        }
    }
    let (ok, table, _) = tensorferry(&["inspect", dir.path().to_str().unwrap()]);
    assert!(ok);
    assert!(table.contains("6 tensors, 5024 bytes (5.0 KB)"), "{table}");
    assert!(
        table.contains(&format!("{} shards of ", shards.len())),
        "{table}"
    );
}

#[test]
fn inspect_of_an_index_naming_a_missing_shard_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {"total_size": 4}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    let (ok, _, err) = tensorferry(&["inspect", index.to_str().unwrap()]);
    assert!(!ok);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("model-00001-of-00001.safetensors"), "{err}");
}
