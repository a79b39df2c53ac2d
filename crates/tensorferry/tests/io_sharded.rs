//! Sharded checkpoints: shards plus a `*.safetensors.index.json`, as Hugging Face writes
//! them; round trips, the official reader on every shard, other tools' indexes, bad ones.

mod common;

use common::write_official;
use std::path::{Path, PathBuf};

use tensorferry::internal::io::{load_sharded, save_sharded, INDEX_SUFFIX};
use tensorferry::{load, Error, LoadOptions, Node, SaveOptions, Tensor, TensorDict, Value};

/// `layers` tensors of 1 KiB each (256 f32) under `model`, every value shifted by `by`.
fn weights(layers: usize, by: f32) -> TensorDict {
    let mut d = TensorDict::new();
    for i in 0..layers {
        let values: Vec<f32> = (0..256).map(|j| (i * 1000 + j) as f32 + by).collect();
        d.insert_path(
            &["model", &format!("layer.{i}.weight")],
            Tensor::from_slice(&values, &[16, 16]).unwrap(),
        )
        .unwrap();
    }
    d
}

/// [`weights`] alone: the same names for every `by`, other values.
fn model_plus(layers: usize, by: f32) -> Node {
    Node::Dict(weights(layers, by))
}

/// A state-dict-like tree: [`weights`] with plain values beside them.
fn model(layers: usize) -> Node {
    let mut d = weights(layers, 0.0);
    d.insert("step", 42i64);
    d.insert("tag", "run-1");
    d.insert(
        "betas",
        Node::Tuple(vec![
            Node::Value(Value::Float(0.9)),
            Node::Value(Value::Float(0.999)),
        ]),
    );
    Node::Dict(d)
}

fn same(a: &Node, b: &Node) {
    let (ta, tb) = (a.tensors(), b.tensors());
    assert_eq!(ta.len(), tb.len());
    for ((pa, x), (pb, y)) in ta.iter().zip(&tb) {
        assert_eq!(pa, pb);
        assert_eq!(
            x.to_vec::<f32>().unwrap(),
            y.to_vec::<f32>().unwrap(),
            "{pa}"
        );
    }
    assert_eq!(format!("{a:?}").len(), format!("{b:?}").len());
}

/// Where the index of a checkpoint saved as `dir/model.safetensors` is.
fn index_in(dir: &Path) -> PathBuf {
    dir.join(format!("model{INDEX_SUFFIX}"))
}

fn index_json(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(index_in(dir)).unwrap()).unwrap()
}

/// Saves `tree` at `path` in shards of at most `max` bytes; the files written.
fn shard(tree: &Node, path: impl AsRef<Path>, max: u64) -> Vec<PathBuf> {
    save_sharded(tree, path, &SaveOptions::default(), max).unwrap()
}

/// The tree loaded from `path` (a file, an index or a folder).
fn load_root(path: impl AsRef<Path>) -> Node {
    load(path, LoadOptions::default()).unwrap().root
}

/// The first value of the first tensor of `tree`.
fn first_value(tree: &Node) -> f32 {
    tree.tensors()[0].1.to_vec::<f32>().unwrap()[0]
}

#[test]
fn a_tree_saved_in_shards_loads_back_whole_from_the_index_or_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let tree = model(10);
    let written = shard(&tree, dir.path().join("model.safetensors"), 3000);
    assert_eq!(
        written.len(),
        6,
        "5 shards of 2 tensors of 1 KiB, then the index"
    );
    assert!(written[0].ends_with("model-00001-of-00005.safetensors"));
    assert!(written[5].to_str().unwrap().ends_with(INDEX_SUFFIX));
    let index = index_json(dir.path());
    assert_eq!(index["metadata"]["total_size"], 10 * 1024);
    assert_eq!(
        index["weight_map"]["model.layer.9.weight"],
        "model-00005-of-00005.safetensors"
    );
    for from in [written[5].clone(), dir.path().to_path_buf()] {
        let back = load(&from, LoadOptions::default()).unwrap();
        same(&back.root, &tree);
        assert_eq!(back.metadata.get("format").map(String::as_str), Some("pt"));
        let Node::Dict(d) = &back.root else { panic!() };
        assert!(matches!(d.get("step"), Some(Node::Value(Value::Int(42)))));
        assert!(matches!(d.get("betas"), Some(Node::Tuple(_))));
    }
}

#[test]
fn the_official_reader_reads_every_shard() {
    let dir = tempfile::tempdir().unwrap();
    let written = shard(&model(6), dir.path().join("model.safetensors"), 2048);
    let mut names = 0;
    for shard in &written[..written.len() - 1] {
        let bytes = std::fs::read(shard).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        names += st.names().len();
    }
    assert_eq!(names, 6);
}

#[test]
fn a_tree_that_fits_one_shard_is_one_file_without_an_index() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let written = shard(&model(3), &path, 1 << 30);
    assert_eq!(written, vec![path.clone()]);
    assert!(!index_in(dir.path()).exists());
    let back = load(dir.path(), LoadOptions::default()).unwrap();
    same(&back.root, &model(3));
    // transformers requires the key in a single file too.
    assert_eq!(back.metadata.get("format").map(String::as_str), Some("pt"));
}

#[test]
fn a_tensor_larger_than_a_shard_gets_a_shard_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let written = shard(&model(3), dir.path().join("model.safetensors"), 100);
    assert_eq!(written.len(), 4);
}

#[test]
fn shards_of_an_earlier_larger_save_are_removed_and_others_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    shard(&model(8), &path, 1024);
    std::fs::write(dir.path().join("notes.txt"), "keep").unwrap();
    std::fs::write(dir.path().join("other-00001-of-00002.safetensors"), "keep").unwrap();
    shard(&model(8), &path, 4096);
    assert_eq!(
        names_in(dir.path()),
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "notes.txt",
            "other-00001-of-00002.safetensors"
        ]
    );
}

/// Two shards written by the official `safetensors` crate and an index as transformers
/// writes it: a flat dict of names.
fn foreign_checkpoint(dir: &Path, weight_map: serde_json::Value) {
    write_official(
        dir.join("a.safetensors"),
        &[("x.weight", &[1.0, 2.0])],
        None,
    );
    write_official(dir.join("b.safetensors"), &[("y.bias", &[1.0, 2.0])], None);
    let index = serde_json::json!({"metadata": {"total_size": 16}, "weight_map": weight_map});
    std::fs::write(index_in(dir), index.to_string()).unwrap();
}

#[test]
fn an_index_of_another_tool_loads_as_a_flat_dict_of_names() {
    let dir = tempfile::tempdir().unwrap();
    foreign_checkpoint(
        dir.path(),
        serde_json::json!({"x.weight": "a.safetensors", "y.bias": "b.safetensors"}),
    );
    let back = load_sharded(index_in(dir.path()), LoadOptions::default()).unwrap();
    let Node::Dict(d) = back.root else { panic!() };
    let keys: Vec<String> = d.iter().map(|(k, _)| k.to_string()).collect();
    assert_eq!(keys, ["x.weight", "y.bias"]);
}

#[test]
fn an_index_naming_a_tensor_its_shard_lacks_is_a_format_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    foreign_checkpoint(
        dir.path(),
        serde_json::json!({"x.weight": "a.safetensors", "y.bias": "a.safetensors"}),
    );
    let err = load(dir.path(), LoadOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::Format { .. }) && err.to_string().contains("y.bias"),
        "{err}"
    );
}

#[test]
fn an_index_pointing_outside_its_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for evil in ["../a.safetensors", "/etc/passwd", "sub/a.safetensors", ""] {
        foreign_checkpoint(dir.path(), serde_json::json!({"x.weight": evil}));
        let err = load(dir.path(), LoadOptions::default()).unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{evil}: {err}");
    }
}

#[test]
fn a_missing_shard_is_an_io_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let written = shard(&model(4), dir.path().join("model.safetensors"), 1024);
    std::fs::remove_file(&written[2]).unwrap();
    let err = load(dir.path(), LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{err}"
    );
    assert!(err.to_string().contains("model-00003-of-00004"), "{err}");
}

#[test]
fn a_damaged_index_is_a_format_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(index_in(dir.path()), "{\"weight_map\": 3}").unwrap();
    let err = load(dir.path(), LoadOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Format { .. }), "{err}");
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn an_index_that_names_itself_or_another_index_is_a_format_error_not_a_recursion() {
    let dir = tempfile::tempdir().unwrap();
    let index = index_in(dir.path());
    for shard in [
        format!("model{INDEX_SUFFIX}"),
        "other.index.json".to_string(),
    ] {
        let json = serde_json::json!({"weight_map": {"x": shard}});
        std::fs::write(&index, json.to_string()).unwrap();
        std::fs::write(dir.path().join("other.index.json"), json.to_string()).unwrap();
        for err in [
            load(&index, LoadOptions::default()).unwrap_err(),
            load(dir.path(), LoadOptions::default()).unwrap_err(),
            tensorferry::load_to(
                &index,
                tensorferry::Device::Emulated(0),
                LoadOptions::default(),
                tensorferry::Staging::Auto,
            )
            .unwrap_err(),
        ] {
            assert!(
                matches!(err, Error::Format { .. }) && err.to_string().contains("an index"),
                "{shard}: {err}"
            );
        }
    }
}

#[test]
fn an_index_of_many_distinct_shards_is_read_in_linear_time() {
    // 300,000 distinct shard names, none present: a scan per name (quadratic) took
    // minutes; one pass takes well under a second before the first missing shard fails.
    let dir = tempfile::tempdir().unwrap();
    let map: serde_json::Map<String, serde_json::Value> = (0..300_000)
        .map(|i| (format!("t{i}"), format!("s{i}.safetensors").into()))
        .collect();
    let index = index_in(dir.path());
    std::fs::write(&index, serde_json::json!({ "weight_map": map }).to_string()).unwrap();
    let started = std::time::Instant::now();
    let err = load(&index, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_name_held_by_two_shards_loads_from_the_shard_the_index_names() {
    let dir = tempfile::tempdir().unwrap();
    for (file, value) in [("a.safetensors", 1.0f32), ("b.safetensors", 2.0)] {
        let values = [value, value + 1.0];
        write_official(
            dir.path().join(file),
            &[("w", &values), ("z", &values)],
            None,
        );
    }
    for (w_in, expected) in [("a.safetensors", 1.0f32), ("b.safetensors", 2.0)] {
        let z_in = if w_in == "a.safetensors" {
            "b.safetensors"
        } else {
            "a.safetensors"
        };
        let index = serde_json::json!({"weight_map": {"w": w_in, "z": z_in}});
        std::fs::write(index_in(dir.path()), index.to_string()).unwrap();
        let back = load_root(dir.path());
        let w = back.child("w").and_then(Node::as_tensor).unwrap();
        assert_eq!(
            w.to_vec::<f32>().unwrap(),
            [expected, expected + 1.0],
            "w in {w_in}"
        );
    }
}

#[test]
fn a_sharded_save_that_fails_part_way_leaves_the_previous_checkpoint_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    shard(&model_plus(8, 0.0), &path, 1024);
    let before = names_in(dir.path());
    // Shard 5 of the new save cannot be written: its usual name is a folder.
    std::fs::remove_file(dir.path().join("model-00005-of-00008.safetensors")).unwrap();
    std::fs::create_dir(dir.path().join("model-00005-of-00008.safetensors")).unwrap();
    let err = save_sharded(&model_plus(8, 0.5), &path, &SaveOptions::default(), 1024);
    assert!(err.is_err());
    std::fs::remove_dir(dir.path().join("model-00005-of-00008.safetensors")).unwrap();
    // The old shard 5 is gone (removed above); every other name is as it was, and the
    // old checkpoint's tensors that remain are the old values.
    let after = names_in(dir.path());
    assert_eq!(after.len(), before.len() - 1, "{after:?}");
    let err = load(&path, LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("model-00005-of-00008"), "{err}");
    let shard4 = load_root(dir.path().join("model-00004-of-00008.safetensors"));
    assert_eq!(first_value(&shard4), 3000.0);
}

#[test]
fn a_save_replaces_a_checkpoint_of_the_other_layout_and_touches_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let keep = [
        "config.json",
        "model-00001-of-00002.safetensors.bak",
        "other-00001-of-00002.safetensors",
        "other.safetensors.index.json",
    ];
    for name in keep {
        std::fs::write(dir.path().join(name), "user's").unwrap();
    }
    // Sharded, then one file: the index and its shards go.
    shard(&model_plus(8, 0.0), &path, 1024);
    tensorferry::save(&model_plus(8, 0.25), &path, &SaveOptions::default()).unwrap();
    let mut expected: Vec<String> = keep.iter().map(|s| s.to_string()).collect();
    expected.push("model.safetensors".into());
    expected.sort();
    assert_eq!(names_in(dir.path()), expected);
    assert_eq!(first_value(&load_root(&path)), 0.25);
    // One file, then sharded: the file goes.
    shard(&model_plus(8, 0.5), &path, 1024);
    assert!(!path.exists());
    assert_eq!(first_value(&load_root(&path)), 0.5);
    assert_eq!(first_value(&load_root(index_in(dir.path()))), 0.5);
    for name in keep {
        assert_eq!(
            std::fs::read_to_string(dir.path().join(name)).unwrap(),
            "user's",
            "{name}"
        );
    }
    let shards = names_in(dir.path())
        .into_iter()
        .filter(|n| n.starts_with("model-") && n.ends_with(".safetensors"))
        .count();
    assert_eq!(
        shards,
        8,
        "only the new checkpoint's shards: {:?}",
        names_in(dir.path())
    );
}

#[test]
fn a_folder_path_saves_model_safetensors_in_it_creating_it() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("ckpt/");
    shard(&model_plus(4, 0.0), &folder, 1024);
    assert!(index_in(&folder).is_file());
    assert_eq!(names_in(dir.path()), ["ckpt"]);
    same(&load_root(&folder), &model_plus(4, 0.0));
}

#[test]
fn a_folder_with_both_layouts_loads_the_single_file_as_transformers_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    shard(&model_plus(4, 0.0), &path, 1024);
    // What a crash between a single-file save's rename and its removals leaves.
    let single = tempfile::tempdir().unwrap();
    tensorferry::save(
        &model_plus(4, 9.0),
        single.path().join("m.safetensors"),
        &SaveOptions::default(),
    )
    .unwrap();
    std::fs::copy(single.path().join("m.safetensors"), &path).unwrap();
    assert_eq!(first_value(&load_root(dir.path())), 9.0);
}

#[test]
fn a_shard_of_another_save_is_a_format_error_not_a_mix() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for (dir, by) in [(&a, 0.0), (&b, 0.5)] {
        let path = dir.path().join("model.safetensors");
        shard(&model_plus(4, by), &path, 1024);
    }
    // What a reader opening shards while a save replaced them would see, or a hand copy.
    let shard = "model-00002-of-00004.safetensors";
    std::fs::copy(b.path().join(shard), a.path().join(shard)).unwrap();
    let err = load(a.path(), LoadOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::Format { .. }) && err.to_string().contains("another save"),
        "{err}"
    );
    assert!(err.to_string().contains(shard), "{err}");
}

#[test]
fn the_path_a_sharded_save_was_given_loads_it_with_or_without_the_suffix() {
    let dir = tempfile::tempdir().unwrap();
    for path in ["model.safetensors", "weights"] {
        let path = dir.path().join(path);
        shard(&model_plus(4, 1.0), &path, 1024);
        assert!(
            !path.exists(),
            "{path:?} is the checkpoint's name, not a file"
        );
        same(&load_root(&path), &model_plus(4, 1.0));
    }
}
