//! The tree record (`__metadata__["tensorferry"]`, which maps a nested tree onto tensor
//! names) decoded from any text, beside a few tensors: a tree or an error, never a panic,
//! never unbounded recursion, never an allocation out of proportion to the input.
//! Run: cargo +nightly fuzz run tree_record
//!
//! Input: one byte choosing how many of the tensors "a", "b", "x.0", "c.d" the file holds
//! (its value modulo 5), then the record's text.
#![no_main]

use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 4] = ["a", "b", "x.0", "c.d"];

/// A safetensors file holding one U8 element per named tensor and `record` as the tree.
fn file_with(record: &str, names: &[&str]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let metadata = serde_json::json!({ "tensorferry": record });
    header.insert("__metadata__".into(), metadata);
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

fuzz_target!(|data: &[u8]| {
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let Ok(record) = std::str::from_utf8(rest) else {
        return;
    };
    let names = &NAMES[..usize::from(choice % 5)];
    if let Ok(loaded) = tensorferry::internal::io::load_bytes(&file_with(record, names)) {
        // A decoded tree holds every tensor of the file, each once.
        let tensors = loaded.root.tensors();
        assert_eq!(tensors.len(), names.len());
        for (_, t) in tensors {
            assert_eq!(t.nbytes(), 1);
        }
    }
});
