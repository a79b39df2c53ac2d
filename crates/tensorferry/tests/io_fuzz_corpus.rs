//! The fuzz corpus, and every one-byte change to the headers of its files and of a file
//! tensorferry writes, through the reader: a result or an error, never a panic, and what
//! loads reads end to end (what the fuzz targets under `fuzz/` assert).

mod common;

use common::save_dict;

use std::path::PathBuf;

use tensorferry::internal::io::load_bytes;
use tensorferry::{DType, SaveOptions, Tensor, TensorDict};

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "the {target} corpus is missing");
    files
        .into_iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect()
}

/// What the `read_safetensors` target checks.
fn read_end_to_end(bytes: &[u8]) {
    if let Ok(loaded) = load_bytes(bytes) {
        for (_, t) in loaded.root.tensors() {
            let mut n = 0;
            t.for_each_run(|run| {
                n += run.len();
                Ok(())
            })
            .unwrap();
            assert_eq!(n, t.nbytes());
        }
    }
}

/// The header's length as the file gives it, bounded by the file.
fn header_end(bytes: &[u8]) -> usize {
    let n = bytes
        .get(..8)
        .map_or(0, |p| u64::from_le_bytes(p.try_into().unwrap()));
    (8 + n.min(bytes.len() as u64) as usize).min(bytes.len())
}

/// Every change of one header byte to a byte that matters to JSON, and every cut.
fn mutate_header(bytes: &[u8], each: &mut dyn FnMut(&[u8])) {
    let end = header_end(bytes);
    for at in 8..end {
        for b in [
            b'"', b'\\', b'{', b'}', b'[', b']', b',', b':', b'0', b'9', b'-', b' ',
        ] {
            let mut changed = bytes.to_vec();
            changed[at] = b;
            each(&changed);
        }
        each(&bytes[..at]);
    }
}

#[test]
fn the_read_corpus_and_its_mutations_never_panic() {
    for file in corpus("read_safetensors") {
        read_end_to_end(&file);
        if file.len() < 4096 {
            mutate_header(&file, &mut |b| read_end_to_end(b));
        }
    }
}

#[test]
fn mutations_of_a_written_file_never_panic() {
    let mut inner = TensorDict::new();
    inner.insert(
        "w",
        Tensor::from_bytes(DType::F32, vec![2], &[1; 8]).unwrap(),
    );
    let mut d = TensorDict::new();
    d.insert(
        "a",
        Tensor::from_bytes(DType::U8, vec![1, 3], &[1, 2, 3]).unwrap(),
    );
    d.insert("b", inner);
    d.insert("n", 7i64);
    d.insert("s", "x\"y");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    save_dict(&d, &path, &SaveOptions::default());
    let bytes = std::fs::read(&path).unwrap();
    assert!(load_bytes(&bytes).is_ok());
    mutate_header(&bytes, &mut |b| read_end_to_end(b));
}

const NAMES: [&str; 4] = ["a", "b", "x.0", "c.d"];

/// The file the `tree_record` target builds around a record.
fn file_with(record: &str, names: &[&str]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ "tensorferry": record }),
    );
    for (i, name) in names.iter().enumerate() {
        let entry = serde_json::json!({"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]});
        header.insert((*name).into(), entry);
    }
    let json = serde_json::to_vec(&header).unwrap();
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes.extend((0..names.len()).map(|i| i as u8));
    bytes
}

/// What the `tree_record` target checks.
fn tree_checks(data: &[u8]) {
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let Ok(record) = std::str::from_utf8(rest) else {
        return;
    };
    let names = &NAMES[..usize::from(choice % 5)];
    if let Ok(loaded) = load_bytes(&file_with(record, names)) {
        let tensors = loaded.root.tensors();
        assert_eq!(tensors.len(), names.len());
        for (_, t) in tensors {
            assert_eq!(t.nbytes(), 1);
        }
    }
}

#[test]
fn the_tree_corpus_and_its_mutations_never_panic() {
    for data in corpus("tree_record") {
        for choice in 0..5u8 {
            let mut with = data.clone();
            if let Some(first) = with.first_mut() {
                *first = choice;
            }
            tree_checks(&with);
            for at in 1..with.len().min(512) {
                for b in [b'"', b'{', b'}', b'[', b']', b',', b'1', b'-'] {
                    let mut changed = with.clone();
                    changed[at] = b;
                    tree_checks(&changed);
                }
                tree_checks(&with[..at]);
            }
        }
    }
}

/// What the `sharded_index` target checks: an index of any content, beside two valid
/// shards, loads as a tree of what they hold or fails, without a panic or a recursion.
fn load_index(dir: &std::path::Path, index: &[u8]) {
    let path = dir.join("m.safetensors.index.json");
    std::fs::write(&path, index).unwrap();
    if let Ok(loaded) = tensorferry::load(&path, tensorferry::LoadOptions::default()) {
        for (name, _) in loaded.root.tensors() {
            let name = name.dotted();
            assert!(["x", "y", "z"].contains(&name.as_str()), "{name}");
        }
    }
}

#[test]
fn the_index_corpus_and_its_mutations_never_panic_or_recurse() {
    let dir = tempfile::tempdir().unwrap();
    for (file, names) in [
        ("a.safetensors", &["x", "y"][..]),
        ("b.safetensors", &["z"]),
    ] {
        let mut d = TensorDict::new();
        for name in names {
            d.insert(*name, Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap());
        }
        save_dict(&d, dir.path().join(file), &SaveOptions::default());
    }
    for index in corpus("sharded_index") {
        load_index(dir.path(), &index);
        if index.len() < 200 {
            for at in 0..index.len() {
                for b in [b'"', b'{', b'}', b'.', b'/', b'a', 0xff] {
                    let mut changed = index.clone();
                    changed[at] = b;
                    load_index(dir.path(), &changed);
                }
            }
        }
    }
}
